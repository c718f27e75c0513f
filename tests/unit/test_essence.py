"""kopf's change detection builds an essence of every watched object on each of its
events; the operator leaves it empty for the kinds it only indexes and watches. That is
safe only while none of those kinds has a handler that reads it (a change handler or a
daemon): checked here against kopf's own registry."""

from __future__ import annotations

import kopf
from kopf._cogs.structs.references import Resource
from kopf._core.intents import registries

import reservoir.handlers  # noqa: F401  (registers the handlers)
from reservoir.handlers.startup import INDEXED_ONLY_KINDS, EssenceWithoutStatus

# Each kind as the API server names it (kopf matches handlers by any of these names, by a
# category, or by kopf.EVERYTHING: asking kopf itself covers every way).
RESOURCES = {
    "BranchClaim": Resource(
        "reservoir.dev", "v1alpha1", "branchclaims", kind="BranchClaim",
        singular="branchclaim", shortcuts=frozenset({"bclaim"}), namespaced=True,
    ),
    "Lease": Resource(
        "coordination.k8s.io", "v1", "leases", kind="Lease", singular="lease", namespaced=True
    ),
    "Pod": Resource(
        "", "v1", "pods", kind="Pod", singular="pod", shortcuts=frozenset({"po"}),
        namespaced=True,
    ),
    "Job": Resource("batch", "v1", "jobs", kind="Job", singular="job", namespaced=True),
    "ResourceClaim": Resource(
        "resource.k8s.io", "v1", "resourceclaims", kind="ResourceClaim",
        singular="resourceclaim", namespaced=True,
    ),
}  # fmt: skip
ENVELOPES = Resource(
    "reservoir.dev", "v1alpha1", "reservationenvelopes", kind="ReservationEnvelope",
    singular="reservationenvelope", shortcuts=frozenset({"renv"}), namespaced=True,
)  # fmt: skip


def test_no_kind_left_without_an_essence_has_a_change_handler_or_a_daemon() -> None:
    registry = registries.get_default_registry()
    assert set(RESOURCES) == INDEXED_ONLY_KINDS
    # Asked the same way of a kind that has them, the answer is yes: the question works.
    assert registry._changing.has_handlers(resource=ENVELOPES)
    assert registry._spawning.has_handlers(resource=ENVELOPES)
    for kind, resource in RESOURCES.items():
        assert not registry._changing.has_handlers(resource=resource), kind
        assert not registry._spawning.has_handlers(resource=resource), kind
        watched = registry._indexing.has_handlers(
            resource=resource
        ) or registry._watching.has_handlers(resource=resource)
        assert watched, kind  # a kind no handler watches would not be listed here


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
