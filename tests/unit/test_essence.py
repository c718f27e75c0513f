"""kopf's change detection builds an essence of every watched object on each of its
events; the operator leaves it empty for the kinds it only indexes and watches. That is
safe only while none of those kinds has a handler that reads it (a change handler or a
daemon): checked here against kopf's own registry."""

from __future__ import annotations

import kopf
from kopf._core.intents import registries

import reservoir.handlers  # noqa: F401  (registers the handlers)
from reservoir.handlers.startup import INDEXED_ONLY_KINDS, EssenceWithoutStatus

PLURALS = {
    "BranchClaim": "branchclaims",
    "Lease": "leases",
    "Pod": "pods",
    "Job": "jobs",
    "ResourceClaim": "resourceclaims",
}


def plurals_of(*parts: registries.ResourceRegistry) -> set[str]:  # type: ignore[type-arg]
    found: set[str] = set()
    for part in parts:
        for handler in part.get_all_handlers():
            selector = handler.selector
            assert selector is not None
            found |= {name for name in (selector.plural, selector.any_name) if name}
    return found


def test_no_kind_left_without_an_essence_has_a_change_handler_or_a_daemon() -> None:
    registry = registries.get_default_registry()
    assert set(PLURALS) == INDEXED_ONLY_KINDS
    changing = plurals_of(registry._changing, registry._spawning)
    assert changing, "the envelopes' and pools' handlers are registered"
    watched = plurals_of(registry._indexing, registry._watching)
    for kind, plural in PLURALS.items():
        assert plural not in changing and kind not in changing, kind
        assert plural in watched, kind  # a kind no handler watches would not be here


def test_an_indexed_kind_has_an_empty_essence_and_an_envelope_keeps_its_own() -> None:
    storage = EssenceWithoutStatus(prefix="reservoir.dev", key="last-handled-configuration")
    claim = kopf.Body(
        {
            "apiVersion": "reservoir.dev/v1alpha1",
            "kind": "BranchClaim",
            "metadata": {"name": "c", "namespace": "t", "labels": {"a": "b"}},
            "spec": {"envelope": "wf"},
            "status": {"phase": "Pending"},
        }
    )
    assert storage.build(body=claim) == {}
    envelope = kopf.Body(
        {
            "apiVersion": "reservoir.dev/v1alpha1",
            "kind": "ReservationEnvelope",
            "metadata": {"name": "wf", "namespace": "t", "labels": {"a": "b"}},
            "spec": {"capacity": {"tokens": "10"}},
            "status": {"phase": "Open"},
        }
    )
    essence = storage.build(body=envelope)
    assert essence["spec"] == {"capacity": {"tokens": "10"}}
    assert "status" not in essence
    assert essence["metadata"]["labels"] == {"a": "b"}
