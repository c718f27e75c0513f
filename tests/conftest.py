"""Test-suite wiring: the session-scoped `cluster` fixture and the --cluster option."""

from __future__ import annotations

from collections.abc import Iterator
from pathlib import Path

import pytest

from tests.clusters import ClusterHandle, open_cluster

REPO = Path(__file__).resolve().parent.parent


def pytest_addoption(parser: pytest.Parser) -> None:
    parser.addoption(
        "--cluster",
        choices=["local", "kind", "existing"],
        default="local",
        help="local: build and run a control plane here (default); kind: pytest-kind "
        "(needs Docker); existing: the cluster of the current KUBECONFIG",
    )


def pytest_collection_modifyitems(items: list[pytest.Item]) -> None:
    for item in items:
        if "tests/integration" in str(item.path):
            item.add_marker(pytest.mark.integration)


@pytest.fixture(scope="session")
def cluster(request: pytest.FixtureRequest) -> Iterator[ClusterHandle]:
    """A real Kubernetes control plane for the whole session, torn down at the end."""
    kind = request.config.getoption("--cluster")
    handle = open_cluster(kind, REPO)
    try:
        yield handle
    finally:
        handle.delete()
