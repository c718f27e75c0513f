"""Helpers for the Helm chart's tests: helm itself, releases, and kubeconfigs that carry a
ServiceAccount's token and nothing else."""

from __future__ import annotations

import base64
import json
import os
import shutil
import subprocess
import uuid
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path
from typing import Any

import yaml

from tests.clusters import ClusterHandle

REPO = Path(__file__).resolve().parents[2]
CHART = REPO / "charts" / "reservoir"
BIN = Path.home() / ".cache" / "reservoir" / "bin" / "current"
KUBE_VERSION = "1.36.3"  # what `helm template` assumes (hack/tools/versions.env)


def tool(name: str) -> str:
    built = BIN / name
    return str(built) if built.exists() else (shutil.which(name) or name)


def helm(cluster: ClusterHandle | None, *args: str, check: bool = True) -> str:
    env = {**os.environ}
    if cluster is not None:
        env["KUBECONFIG"] = str(cluster.kubeconfig_path)
    result = subprocess.run(
        [tool("helm"), *args], capture_output=True, text=True, env=env, check=False
    )
    if check and result.returncode != 0:
        raise AssertionError(f"helm {' '.join(args)} failed:\n{result.stdout}\n{result.stderr}")
    return result.stdout + result.stderr


def set_args(values: dict[str, Any]) -> list[str]:
    """--set-json for each value, so lists and booleans keep their types."""
    return [
        arg for key, value in values.items() for arg in ("--set-json", f"{key}={json.dumps(value)}")
    ]


def render(
    values: dict[str, Any], namespace: str = "reservoir-system", name: str = "rel"
) -> list[dict[str, Any]]:
    out = helm(
        None,
        "template",
        name,
        str(CHART),
        "--namespace",
        namespace,
        "--kube-version",
        KUBE_VERSION,
        *set_args(values),
    )
    return [doc for doc in yaml.safe_load_all(out) if doc]


@contextmanager
def release(
    cluster: ClusterHandle, values: dict[str, Any], *extra: str, name: str | None = None
) -> Iterator[tuple[str, str]]:
    """`helm install` into a fresh namespace; (release, namespace). Uninstalled after."""
    name = name or f"r{uuid.uuid4().hex[:6]}"
    namespace = f"{name}-system"
    helm(
        cluster,
        "install",
        name,
        str(CHART),
        "-n",
        namespace,
        "--create-namespace",
        *set_args(values),
        *extra,
    )
    try:
        yield name, namespace
    finally:
        helm(cluster, "uninstall", name, "-n", namespace, "--wait", check=False)
        cluster.kubectl("delete", "namespace", namespace, "--wait=false", "--ignore-not-found")


def token_kubeconfig(
    cluster: ClusterHandle, service_account: str, namespace: str, path: Path
) -> Path:
    """A kubeconfig with the cluster's server and CA and a TokenRequest token for the
    ServiceAccount: no client certificate, no other credentials."""
    token = cluster.kubectl(
        "create", "token", service_account, "-n", namespace, "--duration=1h"
    ).strip()
    config = yaml.safe_load(Path(cluster.kubeconfig_path).read_text())
    context_name = config.get("current-context") or config["contexts"][0]["name"]
    context = next(c for c in config["contexts"] if c["name"] == context_name)["context"]
    server = next(c for c in config["clusters"] if c["name"] == context["cluster"])["cluster"]
    entry: dict[str, Any] = {"server": server["server"]}
    if "certificate-authority-data" in server:
        entry["certificate-authority-data"] = server["certificate-authority-data"]
    elif "certificate-authority" in server:
        ca = Path(server["certificate-authority"]).read_bytes()
        entry["certificate-authority-data"] = base64.b64encode(ca).decode()
    path.write_text(
        yaml.safe_dump(
            {
                "apiVersion": "v1",
                "kind": "Config",
                "clusters": [{"name": "c", "cluster": entry}],
                "users": [{"name": service_account, "user": {"token": token}}],
                "contexts": [{"name": "c", "context": {"cluster": "c", "user": service_account}}],
                "current-context": "c",
            }
        )
    )
    return path


def kubectl_as(
    kubeconfig: Path, *args: str, input: str | None = None
) -> subprocess.CompletedProcess[str]:
    env = {**os.environ, "KUBECONFIG": str(kubeconfig)}
    return subprocess.run(
        [tool("kubectl"), *args], input=input, capture_output=True, text=True, env=env, check=False
    )


def allowed(kubeconfig: Path, *args: str, input: str | None = None) -> str:
    result = kubectl_as(kubeconfig, *args, input=input)
    assert result.returncode == 0, f"kubectl {' '.join(args)}: {result.stderr.strip()}"
    return result.stdout


def forbidden(kubeconfig: Path, *args: str, input: str | None = None) -> None:
    """The request is refused by authorization (403: RBAC), not for any other reason."""
    result = kubectl_as(kubeconfig, *args, input=input)
    assert result.returncode != 0, f"kubectl {' '.join(args)} was allowed"
    assert "is forbidden: User" in result.stderr, (
        f"kubectl {' '.join(args)} failed, but not as forbidden: {result.stderr.strip()}"
    )
