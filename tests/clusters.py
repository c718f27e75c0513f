"""Clusters for the tests, all with the surface of pytest-kind's `KindCluster`:
`kubeconfig_path`, `kubectl(*args)` (returns stdout) and `delete()`."""

from __future__ import annotations

import fcntl
import os
import shutil
import subprocess
import sys
from pathlib import Path
from typing import Protocol

REPO = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(REPO / "hack"))

from localcluster import LocalCluster, NodeShape, free_port  # noqa: E402, F401 (free_port: for the tests)


def schemaless_crd(group: str, kind: str, plural: str) -> dict[str, object]:
    """A namespaced CRD with a status subresource and no schema to speak of: a plain object
    for tests and baselines that exercise the API server itself, not Reservoir's kinds."""
    any_object = {"type": "object", "x-kubernetes-preserve-unknown-fields": True}
    return {
        "apiVersion": "apiextensions.k8s.io/v1",
        "kind": "CustomResourceDefinition",
        "metadata": {"name": f"{plural}.{group}"},
        "spec": {
            "group": group,
            "scope": "Namespaced",
            "names": {"kind": kind, "plural": plural, "singular": kind.lower()},
            "versions": [
                {
                    "name": "v1",
                    "served": True,
                    "storage": True,
                    "subresources": {"status": {}},
                    "schema": {
                        "openAPIV3Schema": {
                            "type": "object",
                            "properties": {"spec": any_object, "status": any_object},
                        }
                    },
                }
            ],
        },
    }


class ClusterHandle(Protocol):
    kubeconfig_path: Path

    def kubectl(self, *args: str, input: str | None = None) -> str: ...

    def delete(self) -> None: ...


class LocalTestCluster:
    """The envtest-style control plane of hack/localcluster.py, in its own directory. A
    second test session running at the same time (another terminal, a helper) gets a
    directory of its own instead of sharing, and tearing down, the first one's."""

    def __init__(self, directory: Path, feature_gates: str = "") -> None:
        directory.parent.mkdir(parents=True, exist_ok=True)
        self._lock = (directory.parent / f"{directory.name}.lock").open("w")
        self._private = False
        try:
            fcntl.flock(self._lock, fcntl.LOCK_EX | fcntl.LOCK_NB)
        except BlockingIOError:
            directory = directory.parent / f"{directory.name}-{os.getpid()}"
            self._private = True
        self._directory = directory
        self._cluster = LocalCluster(directory, NodeShape(), feature_gates=feature_gates)
        self._cluster.up()
        self.kubeconfig_path = self._cluster.kubeconfig

    def kubectl(self, *args: str, input: str | None = None) -> str:
        return self._cluster.kubectl(*args, input=input)

    def delete(self) -> None:
        self._cluster.down(quiet=True)
        if self._private:
            shutil.rmtree(self._directory, ignore_errors=True)
        self._lock.close()


class ExistingCluster:
    """Whatever the current KUBECONFIG points at; never torn down by the tests."""

    def __init__(self) -> None:
        path = os.environ.get("KUBECONFIG", str(Path.home() / ".kube" / "config"))
        self.kubeconfig_path = Path(path.split(os.pathsep)[0])
        built = Path.home() / ".cache" / "reservoir" / "bin" / "current" / "kubectl"
        self._kubectl = shutil.which("kubectl") or str(built)

    def kubectl(self, *args: str, input: str | None = None) -> str:
        result = subprocess.run(
            [self._kubectl, "--kubeconfig", str(self.kubeconfig_path), *args],
            input=input,
            capture_output=True,
            text=True,
            check=False,
        )
        if result.returncode != 0:
            raise RuntimeError(f"kubectl {' '.join(args)} failed: {result.stderr.strip()}")
        return result.stdout

    def delete(self) -> None:
        pass


class KindTestCluster:
    """pytest-kind, for machines with Docker. GPU nodes are not simulated there: tests that
    need `nvidia.com/gpu` capacity expect KWOK nodes, so install KWOK in the kind cluster
    (see README) before running the GPU tests against it."""

    def __init__(self) -> None:
        from pytest_kind import KindCluster

        self._kind = KindCluster("reservoir-test")
        self._kind.create()
        self.kubeconfig_path = Path(self._kind.kubeconfig_path)

    def kubectl(self, *args: str, input: str | None = None) -> str:
        if input is not None:
            return str(self._kind.kubectl(*args, input=input))
        return str(self._kind.kubectl(*args))

    def delete(self) -> None:
        self._kind.delete()


def open_cluster(kind: str, repo: Path) -> ClusterHandle:
    if kind == "local":
        return LocalTestCluster(repo / ".cluster" / "test")
    if kind == "existing":
        return ExistingCluster()
    if kind == "kind":
        return KindTestCluster()
    raise ValueError(f"unknown --cluster {kind!r}")
