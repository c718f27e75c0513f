"""How each watch begins (reservoir.watch_list): streamed by an API server that can (the
suite's own control plane: see test_hostile_objects for a restart that streams past an
object set aside), and listed in pages by one that cannot. A server before Kubernetes
1.32, or a 1.33 one, refuses `sendInitialEvents`; here an API server with its WatchList
gate off stands in for it."""

from __future__ import annotations

import uuid
from pathlib import Path

import pytest

from reservoir.sdk import Reservoir
from tests.clusters import LocalTestCluster, free_port
from tests.integration.conftest import REPO, OperatorProcess, install_crds
from tests.integration.helpers import create_envelope, metric, settled_ledger, wait_phase

INITIAL_STATES = "reservoir_watch_initial_states_total"


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
            port = free_port()
            log = REPO / ".cluster" / "test-logs" / f"watch-list-refused-{ns}.log"
            log.parent.mkdir(parents=True, exist_ok=True)
            operator = OperatorProcess(older, ns, log, "--metrics-port", str(port))
            claim = sdk.dispatch(wait_phase(sdk, early, "Tentative"))
            sdk.finish(wait_phase(sdk, claim, "Committed"), {"tokens": "5"})
            settled_ledger(sdk, "wf", committed="5", reserved="0")
            claims = "branchclaims.reservoir.dev"
            listed = metric(port, INITIAL_STATES, resource=claims, how="listed")
            streamed = metric(port, INITIAL_STATES, resource=claims, how="streamed")
            assert (listed, streamed) == (1, 0)
            assert "does not stream initial states" in log.read_text()
    finally:
        if operator is not None:
            operator.stop()
        older.delete()
