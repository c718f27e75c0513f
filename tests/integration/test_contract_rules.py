"""The API server's rules for resource contracts and compensations (issue 22), as a user
meets them with kubectl: a declaration that cannot hold is refused at the earliest layer
(the CRD schema), on envelopes and pools alike, and nothing recorded is changed by it.

test_crd_rules.py holds every transition rule to account in six removal ways; here are the
user's own paths: a manifest re-applied without `contracts`, a contract edited in place,
a compensation taken back or sent twice under one key.
"""

from __future__ import annotations

import json
import uuid
from collections.abc import Iterator
from typing import Any

import pytest

from tests.clusters import ClusterHandle

GPU = "nvidia.com/gpu"
API_VERSION = "reservoir.dev/v1alpha1"


def envelope(ns: str, name: str, capacity: dict[str, str], contracts: Any) -> dict[str, Any]:
    spec: dict[str, Any] = {"capacity": capacity}
    if contracts is not None:
        spec["contracts"] = contracts
    return {
        "apiVersion": API_VERSION,
        "kind": "ReservationEnvelope",
        "metadata": {"name": name, "namespace": ns},
        "spec": spec,
    }


def pool(name: str, ns: str, capacity: dict[str, str], contracts: Any) -> dict[str, Any]:
    spec: dict[str, Any] = {"capacity": capacity, "namespaces": [ns]}
    if contracts is not None:
        spec["contracts"] = contracts
    return {
        "apiVersion": API_VERSION,
        "kind": "ReservationPool",
        "metadata": {"name": name},
        "spec": spec,
    }


def create(cluster: ClusterHandle, obj: dict[str, Any]) -> None:
    cluster.kubectl("create", "-f", "-", input=json.dumps(obj))


def refused(cluster: ClusterHandle, message: str, *args: str, input: str | None = None) -> str:
    """Run kubectl, which must fail with `message` in what the API server said."""
    with pytest.raises(RuntimeError) as failure:
        cluster.kubectl(*args, input=input)
    text = str(failure.value)
    assert message in text, text
    return text


def stored(cluster: ClusterHandle, kind: str, name: str, ns: str | None = None) -> dict[str, Any]:
    where = ["-n", ns] if ns else []
    out = cluster.kubectl("get", kind, name, *where, "--ignore-not-found", "-o", "json")
    return json.loads(out) if out.strip() else {}


@pytest.fixture
def pools(cluster: ClusterHandle, crds: None) -> Iterator[list[str]]:
    """Names of the (cluster-scoped) pools a test makes: deleted at its end."""
    made: list[str] = []
    yield made
    for name in made:
        cluster.kubectl("delete", "rpool", name, "--wait=false", "--ignore-not-found")


def pool_name(pools: list[str]) -> str:
    name = f"contract-rules-{uuid.uuid4().hex[:8]}"
    pools.append(name)
    return name


# --- declarations that cannot hold ---------------------------------------------------------

WINDOW = "windowSeconds is set for a Replenishing resource, and only for one"
DEVICE = "a device resource (nvidia.com/gpu) is Reusable"
IN_CAPACITY = "contracts name resources of the capacity"

CAPACITY = {GPU: "8", "tokens": "100k", "requests": "600"}
IMPOSSIBLE = [
    ("gpu-consumable", {GPU: {"type": "Consumable"}}, DEVICE),
    ("gpu-replenishing", {GPU: {"type": "Replenishing", "windowSeconds": 60}}, DEVICE),
    ("not-in-capacity", {"cost": {"type": "Consumable"}}, IN_CAPACITY),
    ("replenishing-without-window", {"requests": {"type": "Replenishing"}}, WINDOW),
    ("consumable-with-window", {"tokens": {"type": "Consumable", "windowSeconds": 60}}, WINDOW),
    ("reusable-with-window", {"requests": {"type": "Reusable", "windowSeconds": 60}}, WINDOW),
    ("unknown-type", {"tokens": {"type": "Refundable"}}, "Unsupported value"),
    ("window-zero", {"requests": {"type": "Replenishing", "windowSeconds": 0}}, "windowSeconds"),
    (
        "window-past-a-week",
        {"requests": {"type": "Replenishing", "windowSeconds": 7 * 24 * 3600 + 1}},
        "windowSeconds",
    ),
    ("no-type", {"requests": {"windowSeconds": 60}}, "type: Required value"),
]


@pytest.mark.parametrize(
    ("contracts", "message"), [c[1:] for c in IMPOSSIBLE], ids=[c[0] for c in IMPOSSIBLE]
)
def test_an_envelope_declaring_a_contract_that_cannot_hold_is_refused(
    cluster: ClusterHandle, ns: str, contracts: dict[str, Any], message: str
) -> None:
    obj = envelope(ns, "bad", CAPACITY, contracts)
    refused(cluster, message, "create", "-f", "-", input=json.dumps(obj))
    assert not stored(cluster, "renv", "bad", ns)


@pytest.mark.parametrize(
    ("contracts", "message"), [c[1:] for c in IMPOSSIBLE], ids=[c[0] for c in IMPOSSIBLE]
)
def test_a_pool_declaring_a_contract_that_cannot_hold_is_refused(
    cluster: ClusterHandle, ns: str, pools: list[str], contracts: dict[str, Any], message: str
) -> None:
    name = pool_name(pools)
    refused(
        cluster, message, "create", "-f", "-", input=json.dumps(pool(name, ns, CAPACITY, contracts))
    )
    assert not stored(cluster, "rpool", name)


VALID = {
    GPU: {"type": "Reusable"},
    "tokens": {"type": "Consumable"},
    "requests": {"type": "Replenishing", "windowSeconds": 60},
}


def test_every_contract_that_can_hold_is_accepted_and_stored_as_declared(
    cluster: ClusterHandle, ns: str, pools: list[str]
) -> None:
    create(cluster, envelope(ns, "declared", CAPACITY, VALID))
    create(cluster, envelope(ns, "undeclared", CAPACITY, None))
    assert stored(cluster, "renv", "declared", ns)["spec"]["contracts"] == VALID
    # Nothing declared: the schema default, {} (the defaults by name apply).
    assert stored(cluster, "renv", "undeclared", ns)["spec"]["contracts"] == {}
    name = pool_name(pools)
    create(cluster, pool(name, ns, CAPACITY, VALID))
    assert stored(cluster, "rpool", name)["spec"]["contracts"] == VALID


# --- fixed at creation ----------------------------------------------------------------------

FIXED = "contracts are fixed at creation"
CHANGES = [
    ("window", {"requests": {"type": "Replenishing", "windowSeconds": 1}}),
    ("type", {"requests": {"type": "Consumable"}}),
    ("one-more", {"tokens": {"type": "Consumable"}}),
    ("none", {}),
]


@pytest.mark.parametrize("kind", ["renv", "rpool"])
@pytest.mark.parametrize(("change", "contracts"), CHANGES, ids=[c for c, _ in CHANGES])
def test_a_contract_cannot_change_after_creation_even_through_a_reapplied_manifest(
    cluster: ClusterHandle,
    ns: str,
    pools: list[str],
    kind: str,
    change: str,
    contracts: dict[str, Any],
) -> None:
    """`kubectl apply` of the edited manifest, and of one without `contracts` at all: the
    schema default ({}) puts the field back, so the rule still sees the change."""
    original = {"requests": {"type": "Replenishing", "windowSeconds": 60}}
    name = "fixed" if kind == "renv" else pool_name(pools)

    def manifest(with_contracts: Any) -> dict[str, Any]:
        if kind == "renv":
            return envelope(ns, name, CAPACITY, with_contracts)
        return pool(name, ns, CAPACITY, with_contracts)

    scope = ns if kind == "renv" else None
    where = ["-n", ns] if scope else []
    cluster.kubectl("apply", "-f", "-", input=json.dumps(manifest(original)))
    before = stored(cluster, kind, name, scope)
    assert before["spec"]["contracts"] == original

    refused(cluster, FIXED, "apply", "-f", "-", input=json.dumps(manifest(contracts)))
    # The manifest without the field: kubectl's three-way merge removes it.
    refused(cluster, FIXED, "apply", "-f", "-", input=json.dumps(manifest(None)))
    refused(
        cluster, FIXED, "patch", kind, name, *where, "--type=json",
        "-p", '[{"op": "remove", "path": "/spec/contracts"}]',
    )  # fmt: skip
    after = stored(cluster, kind, name, scope)
    assert after["metadata"]["resourceVersion"] == before["metadata"]["resourceVersion"]
    assert after["spec"]["contracts"] == original


def test_an_envelope_created_without_contracts_cannot_be_given_one_later(
    cluster: ClusterHandle, ns: str
) -> None:
    create(cluster, envelope(ns, "plain", CAPACITY, None))
    refused(
        cluster, FIXED, "patch", "renv", "plain", "-n", ns, "--type=merge",
        "-p", json.dumps({"spec": {"contracts": {"requests": VALID["requests"]}}}),
    )  # fmt: skip
    assert stored(cluster, "renv", "plain", ns)["spec"]["contracts"] == {}


# --- compensations: append-only, one per key ------------------------------------------------

APPEND_ONLY = "compensations are append-only"
OWN_KEY = "each compensation has its own key"


def compensation(key: str, **fields: Any) -> dict[str, Any]:
    return {"key": key, "reason": "a refund to the customer", **fields}


def claim(ns: str, compensations: list[dict[str, Any]] | None = None) -> dict[str, Any]:
    spec: dict[str, Any] = {"envelope": "wf", "requests": {"tokens": "20"}}
    if compensations is not None:
        spec["compensations"] = compensations
    return {
        "apiVersion": API_VERSION,
        "kind": "BranchClaim",
        "metadata": {"name": "c", "namespace": ns},
        "spec": spec,
    }


def compensations_of(cluster: ClusterHandle, ns: str) -> list[dict[str, Any]]:
    return list(stored(cluster, "bclaim", "c", ns)["spec"]["compensations"])


def patch_compensations(cluster: ClusterHandle, ns: str, value: Any) -> str:
    patch = json.dumps({"spec": {"compensations": value}})
    return cluster.kubectl("patch", "bclaim", "c", "-n", ns, "--type=merge", "-p", patch)


def test_compensations_are_appended_never_changed_or_removed(
    cluster: ClusterHandle, ns: str
) -> None:
    create(cluster, claim(ns))
    assert compensations_of(cluster, ns) == []
    first = compensation("refund-1", refund={"tokens": "5"}, reference="invoice-7")
    second = compensation("charge-1", charge={"tokens": "3"})
    patch_compensations(cluster, ns, [first])
    patch_compensations(cluster, ns, [first, second])  # appended: accepted
    assert compensations_of(cluster, ns) == [first, second]

    for attempt in (
        [first],  # the second taken back
        [],
        [first, {**second, "charge": {"tokens": "300"}}],  # changed in place
        [first, {**second, "reason": "another reason"}],
        [first, {**second, "key": "charge-2"}],  # renamed
        [second, first],  # reordered: the order decides what a capped refund gives back
        [compensation("charge-0", charge={"tokens": "1"}), first, second],  # put in front
    ):
        refused(
            cluster, APPEND_ONLY, "patch", "bclaim", "c", "-n", ns, "--type=merge",
            "-p", json.dumps({"spec": {"compensations": attempt}}),
        )  # fmt: skip
    refused(
        cluster, APPEND_ONLY, "patch", "bclaim", "c", "-n", ns, "--type=json",
        "-p", '[{"op": "remove", "path": "/spec/compensations"}]',
    )  # fmt: skip
    assert compensations_of(cluster, ns) == [first, second]


def test_a_compensation_key_is_used_once(cluster: ClusterHandle, ns: str) -> None:
    first = compensation("refund-1", refund={"tokens": "5"})
    twice = [first, compensation("refund-1", refund={"tokens": "7"})]
    refused(cluster, OWN_KEY, "create", "-f", "-", input=json.dumps(claim(ns, twice)))
    assert not stored(cluster, "bclaim", "c", ns)

    create(cluster, claim(ns, [first]))
    refused(
        cluster, OWN_KEY, "patch", "bclaim", "c", "-n", ns, "--type=merge",
        "-p", json.dumps({"spec": {"compensations": twice}}),
    )  # fmt: skip
    assert compensations_of(cluster, ns) == [first]


MALFORMED = [
    ("negative-amount", compensation("k", refund={"tokens": "-5"}), "spec.compensations[0].refund"),
    ("key-with-spaces", compensation("a key"), "spec.compensations[0].key"),
    ("no-reason", {"key": "k", "charge": {"tokens": "1"}}, "spec.compensations[0].reason"),
    ("empty-reason", compensation("k", reason=""), "spec.compensations[0].reason"),
    ("bad-resource", compensation("k", charge={"tok ens": "1"}), "resource names look like"),
]


@pytest.mark.parametrize(
    ("item", "message"), [m[1:] for m in MALFORMED], ids=[m[0] for m in MALFORMED]
)
def test_a_malformed_compensation_is_refused(
    cluster: ClusterHandle, ns: str, item: dict[str, Any], message: str
) -> None:
    refused(cluster, message, "create", "-f", "-", input=json.dumps(claim(ns, [item])))
    create(cluster, claim(ns))
    refused(
        cluster, message, "patch", "bclaim", "c", "-n", ns, "--type=merge",
        "-p", json.dumps({"spec": {"compensations": [item]}}),
    )  # fmt: skip
    assert compensations_of(cluster, ns) == []


def test_at_most_eight_compensations(cluster: ClusterHandle, ns: str) -> None:
    eight = [compensation(f"k{i}", charge={"tokens": "1"}) for i in range(8)]
    create(cluster, claim(ns, eight))
    refused(
        cluster, "must have at most 8 items", "patch", "bclaim", "c", "-n", ns, "--type=merge",
        "-p", json.dumps({"spec": {"compensations": [*eight, compensation("k8")]}}),
    )  # fmt: skip
    assert len(compensations_of(cluster, ns)) == 8
