"""The local control plane's kubectl asks `wait` again where kubectl fails at once on an
object whose status.conditions is still null (a CRD just created: seen in CI)."""

from __future__ import annotations

from pathlib import Path

import pytest

from localcluster import ClusterError
from tests.clusters import LocalCluster

FAKE_KUBECTL = """#!/bin/sh
count=$(cat "{counter}" 2>/dev/null || echo 0)
echo $((count + 1)) > "{counter}"
if [ "$count" -lt {failures} ]; then
  echo 'error: .status.conditions accessor error: <nil> is of the type <nil>' >&2
  exit 1
fi
echo ok
"""


def cluster_with(tmp_path: Path, failures: int) -> tuple[LocalCluster, Path]:
    binaries = tmp_path / "bin"
    binaries.mkdir()
    counter = tmp_path / "calls"
    kubectl = binaries / "kubectl"
    kubectl.write_text(FAKE_KUBECTL.format(counter=counter, failures=failures))
    kubectl.chmod(0o755)
    cluster = LocalCluster(tmp_path / "cluster")
    cluster.binaries = binaries
    return cluster, counter


def test_wait_is_asked_again_while_the_conditions_are_null(tmp_path: Path) -> None:
    cluster, counter = cluster_with(tmp_path, failures=2)
    assert cluster.kubectl("wait", "--for=condition=Established", "crd/x").strip() == "ok"
    assert counter.read_text().strip() == "3"


def test_other_commands_fail_at_once(tmp_path: Path) -> None:
    cluster, counter = cluster_with(tmp_path, failures=2)
    with pytest.raises(ClusterError, match="accessor error"):
        cluster.kubectl("get", "crd/x")
    assert counter.read_text().strip() == "1"
