"""The pure parts of the adapters: reading API objects into facts, the plugin's parsing."""

from __future__ import annotations

import pytest

from reservoir.cli.plugin import resources, table
from reservoir.core.model import Intent
from reservoir.k8s.facts import InvalidClaim, claim_facts, heartbeat_token
from reservoir.sdk import ReservoirError


def claim(**spec: object) -> dict[str, object]:
    return {
        "metadata": {
            "name": "x",
            "uid": "u-1",
            "creationTimestamp": "2026-11-29T10:00:00Z",
            "annotations": {"reservoir.dev/force-settle": "OPS-1"},
        },
        "spec": {"envelope": "wf", "requests": {"tokens": "20k"}, **spec},
        "status": {"settlement": {"key": "u-1/1/1"}},
    }


def test_a_claim_object_becomes_facts() -> None:
    facts = claim_facts(claim(intent="Dispatch"), None)
    assert not isinstance(facts, InvalidClaim)
    assert facts.spec.intent is Intent.DISPATCH
    assert facts.spec.requests == {"tokens": 20000}
    assert facts.created_at.tzinfo is not None
    assert (facts.settled_key, facts.force_settle, facts.deleting) == ("u-1/1/1", "OPS-1", False)


def test_a_spec_the_operator_cannot_read_is_reported_not_acted_on() -> None:
    facts = claim_facts(claim(requests={"tokens": "-1"}), None)
    assert isinstance(facts, InvalidClaim)
    assert "requests.tokens" in facts.problem


def test_every_lease_renewal_changes_the_heartbeat_token() -> None:
    first = {"spec": {"renewTime": "2026-11-29T10:00:00.000001Z", "holderIdentity": "w1"}}
    again = {"spec": {"renewTime": "2026-11-29T10:00:00.000002Z", "holderIdentity": "w1"}}
    assert heartbeat_token(None) is None
    assert heartbeat_token({"spec": {}}) is None
    assert heartbeat_token(first) != heartbeat_token(again)
    assert heartbeat_token(first) == heartbeat_token(dict(first))


def test_plugin_resource_arguments() -> None:
    assert resources(["tokens=20k", "cost=1.5"]) == {"tokens": "20k", "cost": "1.5"}
    with pytest.raises(ReservoirError, match="RESOURCE=QUANTITY"):
        resources(["tokens"])


def test_plugin_tables_align() -> None:
    assert table([["A", "BB"], ["ccc", "d"]]).splitlines() == ["A    BB", "ccc  d"]
