"""How each watch begins (reservoir.watch_list): streamed by an API server that can (the
suite's own control plane: see test_hostile_objects for a restart that streams past an
object set aside), and listed in pages by one that cannot. A server before Kubernetes
1.32, or a 1.33 one, refuses `sendInitialEvents`; here an API server with its WatchList
gate off stands in for it."""

from __future__ import annotations

import urllib.request
import uuid
from pathlib import Path

import pytest

from reservoir.sdk import Reservoir
from tests.clusters import LocalTestCluster
from tests.integration.conftest import REPO, OperatorProcess, _free_port, install_crds
from tests.integration.helpers import create_envelope, settled_ledger, wait_phase


def initial_states(port: int) -> dict[str, float]:
    """reservoir_watch_initial_states_total of the claims' watch, by how."""
    found: dict[str, float] = {}
    with urllib.request.urlopen(f"http://127.0.0.1:{port}/metrics", timeout=5) as response:
        for line in response.read().decode().splitlines():
            # (the exposition sorts labels by name)
            if line.startswith("reservoir_watch_initial_states_total{") and (
                'resource="branchclaims.reservoir.dev"' in line
            ):
                how = line.split('how="')[1].split('"')[0]
                found[how] = float(line.split()[-1])
    return found


def test_an_api_server_that_cannot_stream_is_listed_in_pages(
    request: pytest.FixtureRequest, tmp_path: Path
) -> None:
    if request.config.getoption("--cluster") != "local":
        pytest.skip("starts a local control plane of its own")
    older = LocalTestCluster(tmp_path / "no-watch-list", feature_gates="WatchList=false")
    operator: OperatorProcess | None = None
    try:
        install_crds(older)
        ns = f"paged-{uuid.uuid4().hex[:6]}"
        older.kubectl("create", "namespace", ns)
        create_envelope(older, ns, "wf", {"tokens": "100"}, defaultLeaseSeconds=300)
        with Reservoir(namespace=ns, kubeconfig=str(older.kubeconfig_path)) as sdk:
            # A claim made before the operator starts is in its first list.
            early = sdk.hold("wf", "early", {"tokens": "20"}, name="early")
            port = _free_port()
            log = REPO / ".cluster" / "test-logs" / f"watch-list-refused-{ns}.log"
            log.parent.mkdir(parents=True, exist_ok=True)
            operator = OperatorProcess(older, ns, log, "--metrics-port", str(port))
            claim = sdk.dispatch(wait_phase(sdk, early, "Tentative"))
            sdk.finish(wait_phase(sdk, claim, "Committed"), {"tokens": "5"})
            settled_ledger(sdk, "wf", committed="5", reserved="0")
            counted = initial_states(port)
            assert counted["listed"] == 1 and counted.get("streamed", 0) == 0
            assert "does not stream initial states" in log.read_text()
    finally:
        if operator is not None:
            operator.stop()
        older.delete()
