"""The API server itself rejects bad Reservoir input, with the message each rule declares.

Schema bounds, quantity syntax, immutability and the CEL transition rules with `oldSelf`
are exercised here against a real kube-apiserver, through kubectl as a user would meet
them. tests/integration/test_crd_rules.py enumerates every rule in crds/ and shows that
none can be bypassed.
"""

from __future__ import annotations

import json
import re
import time
from pathlib import Path
from typing import Any

import pytest

from tests.clusters import ClusterHandle

REPO = Path(__file__).resolve().parents[2]
API = "reservoir.dev/v1alpha1"


class RejectedError(AssertionError):
    pass


def envelope(name: str = "wf", **spec: Any) -> dict[str, Any]:
    return {
        "apiVersion": API,
        "kind": "ReservationEnvelope",
        "metadata": {"name": name},
        "spec": {"capacity": {"tokens": "100k", "cost": "12.50"}, **spec},
    }


def claim(name: str = "a", **spec: Any) -> dict[str, Any]:
    return {
        "apiVersion": API,
        "kind": "BranchClaim",
        "metadata": {"name": name},
        "spec": {
            "envelope": "wf",
            "branch": "search",
            "requests": {"tokens": "20k"},
            # No operator runs here: no status.lease, so generation 0 is the current lease a
            # dispatch or report is fenced on (reservoir.lease_fence_rules).
            "lease": {"fence": {"generation": 0}},
            **spec,
        },
    }


def create(cluster: ClusterHandle, ns: str, obj: dict[str, Any]) -> None:
    try:
        cluster.kubectl("create", "-n", ns, "-f", "-", input=json.dumps(obj))
    except RuntimeError as error:
        raise RejectedError(str(error)) from None


def patch(cluster: ClusterHandle, ns: str, kind: str, name: str, spec: dict[str, Any]) -> None:
    try:
        cluster.kubectl(
            "patch", kind, name, "-n", ns, "--type=merge", "-p", json.dumps({"spec": spec})
        )
    except RuntimeError as error:
        raise RejectedError(str(error)) from None


# --- valid objects are accepted --------------------------------------------------------


def test_valid_envelope_and_claim_are_accepted_with_defaults(
    cluster: ClusterHandle, ns: str
) -> None:
    create(cluster, ns, envelope(policy={"maxActiveClaims": 8, "atAmbiguityDeadline": "Hold"}))
    create(
        cluster,
        ns,
        claim(
            requests={"tokens": "20k", "cost": "1.5", "nvidia.com/gpu": "1"},
            priority=5,
            commitPoint="PodScheduled",
            upstream={"operationId": "op-1", "supportsCancel": True},
        ),
    )
    stored = json.loads(cluster.kubectl("get", "bclaim", "a", "-n", ns, "-o", "json"))
    # defaulted by the API server
    assert stored["spec"]["dispatch"] is False and stored["spec"]["cancel"] is False
    assert stored["spec"]["final"] is False and stored["spec"]["usage"] == {}
    assert stored["spec"]["attempt"] == 1
    envelope_spec = json.loads(cluster.kubectl("get", "renv", "wf", "-n", ns, "-o", "json"))
    assert envelope_spec["spec"]["state"] == "Open"
    names = cluster.kubectl("get", "reservoir", "-n", ns, "-o", "name")
    assert (
        "branchclaim.reservoir.dev/a" in names and "reservationenvelope.reservoir.dev/wf" in names
    )


def test_a_valid_lifecycle_of_spec_updates_is_accepted(cluster: ClusterHandle, ns: str) -> None:
    create(cluster, ns, claim())
    patch(cluster, ns, "bclaim", "a", {"dispatch": True})
    patch(cluster, ns, "bclaim", "a", {"usage": {"tokens": "5k"}})
    patch(cluster, ns, "bclaim", "a", {"usage": {"tokens": "7k", "cost": "0.25"}})
    patch(cluster, ns, "bclaim", "a", {"cancel": True})  # after dispatch: only a request
    patch(cluster, ns, "bclaim", "a", {"usage": {"tokens": "9k", "cost": "0.25"}, "final": True,
                                       "outcome": "Cancelled"})  # fmt: skip
    create(cluster, ns, envelope())
    patch(cluster, ns, "renv", "wf", {"capacity": {"tokens": "200k", "cost": "12.50"}})
    patch(cluster, ns, "renv", "wf", {"state": "Closed"})


# --- creation-time validation ------------------------------------------------------------

BAD_CLAIMS = [
    ("negative quantity", {"requests": {"tokens": "-5"}}, "spec.requests.tokens"),
    ("malformed quantity", {"requests": {"tokens": "5 tokens"}}, "should match"),
    ("float-ish garbage", {"requests": {"tokens": "1.2.3"}}, "should match"),
    ("huge quantity", {"requests": {"tokens": "1e99"}}, "may not exceed 1E"),
    ("quantity as a number", {"requests": {"tokens": 5}}, "must be of type string"),
    ("requests as a string", {"requests": "lots"}, "must be of type object"),
    ("bad resource name", {"requests": {"tok ens!": "1"}}, "resource names look like"),
    ("dispatch as text", {"dispatch": "yes"}, "must be of type boolean"),
    ("cancel as text", {"cancel": "please"}, "must be of type boolean"),
    ("the old intent field", {"intent": "Dispatch"}, "unknown field"),
    ("unknown commit point", {"commitPoint": "Whenever"}, "Unsupported value"),
    ("attempt zero", {"attempt": 0}, "should be greater than or equal to 1"),
    ("attempt as text", {"attempt": "one"}, "must be of type integer"),
    ("huge priority", {"priority": 10**12}, "should be less than or equal to"),
    ("final without outcome", {"final": True}, "a final report needs an outcome"),
    ("too many resources", {"requests": {f"r{i}": "1" for i in range(17)}}, "17"),
    ("empty envelope name", {"envelope": ""}, "spec.envelope"),
    ("unknown outcome", {"final": True, "outcome": "Meh"}, "Unsupported value"),
    ("huge lease", {"lease": {"durationSeconds": 10**10}}, "should be less than"),
    ("ref leaving the namespace", {"upstream": {"ref": {"name": "../../other/jobs/x"}}},
     "spec.upstream.ref.name"),
    ("ref kind without apiVersion", {"upstream": {"ref": {"kind": "Training", "name": "t"}}},
     "apiVersion is required"),
    ("request id with a space", {"upstream": {"requestId": "a b"}}, "spec.upstream.requestId"),
    ("result that is not ASCII", {"result": "s3://b/é"}, "spec.result"),
]  # fmt: skip


@pytest.mark.parametrize(("case", "spec", "message"), BAD_CLAIMS, ids=[c[0] for c in BAD_CLAIMS])
def test_bad_claims_are_rejected_with_a_clear_message(
    cluster: ClusterHandle, ns: str, case: str, spec: dict[str, Any], message: str
) -> None:
    with pytest.raises(RejectedError, match=message.replace("(", r"\(")):
        create(cluster, ns, claim(**spec))


def test_unknown_fields_are_rejected(cluster: ClusterHandle, ns: str) -> None:
    with pytest.raises(RejectedError, match="unknown field"):
        create(cluster, ns, claim(reqeusts={"tokens": "1"}))


BAD_ENVELOPES = [
    ("negative capacity", {"capacity": {"tokens": "-1"}}, "spec.capacity.tokens"),
    ("null capacity", {"capacity": None}, "spec.capacity: Required value"),
    ("empty capacity", {"capacity": {}}, "spec.capacity: Invalid value"),
    ("unknown state", {"state": "Ajar"}, "Unsupported value"),
    ("unknown deadline action", {"policy": {"atAmbiguityDeadline": "Shrug"}}, "Unsupported"),
    ("zero lease", {"policy": {"defaultLeaseSeconds": 0}}, "greater than or equal to 1"),
    ("fan-out cap above the policy limit", {"policy": {"maxActiveClaims": 100001}}, "less than"),
    ("token Secret leaving the namespace",
     {"policy": {"provider": {"statusURL": "https://p.example/{operationId}",
                              "tokenSecret": {"name": "../../other/secrets/t", "key": "t"}}}},
     "tokenSecret.name"),
    ("status URL without the operation", {"policy": {"provider": {"statusURL": "https://p"}}},
     "statusURL names"),
]  # fmt: skip


@pytest.mark.parametrize(
    ("case", "spec", "message"), BAD_ENVELOPES, ids=[c[0] for c in BAD_ENVELOPES]
)
def test_bad_envelopes_are_rejected_with_a_clear_message(
    cluster: ClusterHandle, ns: str, case: str, spec: dict[str, Any], message: str
) -> None:
    with pytest.raises(RejectedError, match=message):
        create(cluster, ns, envelope(**spec))


# --- transition rules (oldSelf) ------------------------------------------------------------

SENT = {"dispatch": True}  # a report needs the claim past its commit point
BAD_CLAIM_UPDATES = [
    ("dispatch undone", [{"dispatch": True}], {"dispatch": False}, "dispatch is a fact"),
    ("dispatch removed", [{"dispatch": True}], {"dispatch": None}, "dispatch is a fact"),
    ("cancel undone", [{"cancel": True}], {"cancel": False}, "cancel is a fact"),
    ("cancel removed", [{"cancel": True}], {"cancel": None}, "cancel is a fact"),
    ("dispatch after cancel", [{"cancel": True}], {"dispatch": True},
     "a cancelled branch cannot be dispatched"),
    ("usage after cancel before dispatch", [{"cancel": True}], {"usage": {"tokens": "1"}},
     "has not reached its commit point"),
    ("usage before dispatch", [], {"usage": {"tokens": "1"}}, "has not reached its commit point"),
    ("dispatch without the lease", [], {"dispatch": True, "lease": {"fence": None}},
     "no spec.lease.fence"),
    ("dispatch with an old lease", [], {"dispatch": True, "lease": {"fence": {"generation": 1}}},
     "generation: 1}, but the lease is"),
    ("usage decreases", [SENT, {"usage": {"tokens": "5"}}], {"usage": {"tokens": "4"}},
     "cumulative"),
    ("usage dimension dropped", [SENT, {"usage": {"tokens": "5", "cost": "1"}}],
     {"usage": {"cost": None}}, "cumulative"),
    ("usage removed", [SENT, {"usage": {"tokens": "5"}}], {"usage": None}, "cumulative"),
    ("final removed", [SENT, {"final": True, "outcome": "Succeeded"}], {"final": None},
     "cannot be un-finalized"),
    ("final un-finalized", [SENT, {"final": True, "outcome": "Succeeded"}], {"final": False},
     "cannot be un-finalized"),
    ("outcome changed once final", [SENT, {"final": True, "outcome": "Succeeded"}],
     {"outcome": "Failed"}, "outcome cannot change once"),
    ("usage changed once final", [SENT, {"final": True, "outcome": "Succeeded",
                                         "usage": {"tokens": "5"}}],
     {"usage": {"tokens": "6"}}, "usage cannot change once the report is final"),
    ("envelope changed", [], {"envelope": "other"}, "envelope is immutable"),
    ("branch changed", [], {"branch": "other"}, "branch is immutable"),
    ("attempt changed", [], {"attempt": 2}, "attempt is immutable"),
    ("requests changed", [], {"requests": {"tokens": "1"}}, "requests are immutable"),
]  # fmt: skip


@pytest.mark.parametrize(
    ("case", "before", "update", "message"),
    BAD_CLAIM_UPDATES,
    ids=[c[0] for c in BAD_CLAIM_UPDATES],
)
def test_bad_claim_updates_are_rejected_and_change_nothing(
    cluster: ClusterHandle,
    ns: str,
    case: str,
    before: list[dict[str, Any]],
    update: dict[str, Any],
    message: str,
) -> None:
    create(cluster, ns, claim())
    for step in before:
        patch(cluster, ns, "bclaim", "a", step)
    stored = cluster.kubectl("get", "bclaim", "a", "-n", ns, "-o", "jsonpath={.spec}")
    with pytest.raises(RejectedError, match=message):
        patch(cluster, ns, "bclaim", "a", update)
    after = cluster.kubectl("get", "bclaim", "a", "-n", ns, "-o", "jsonpath={.spec}")
    assert json.loads(after) == json.loads(stored), "nothing already recorded is lost"


def test_envelope_capacity_may_grow_but_never_shrink(cluster: ClusterHandle, ns: str) -> None:
    create(cluster, ns, envelope())
    with pytest.raises(RejectedError, match="never shrink"):
        patch(cluster, ns, "renv", "wf", {"capacity": {"tokens": "1"}})
    with pytest.raises(RejectedError, match="never shrink"):
        patch(cluster, ns, "renv", "wf", {"capacity": {"cost": None}})
    with pytest.raises(RejectedError, match="fixed at creation"):
        patch(cluster, ns, "renv", "wf", {"capacity": {"nvidia.com/gpu": "8"}})
    with pytest.raises(RejectedError, match=re.escape("spec.capacity: Required value")):
        patch(cluster, ns, "renv", "wf", {"capacity": None})
    with pytest.raises(RejectedError, match=re.escape("spec.capacity")):
        patch(cluster, ns, "renv", "wf", {"capacity": {"tokens": None, "cost": None}})
    stored = cluster.kubectl("get", "renv", "wf", "-n", ns, "-o", "jsonpath={.spec.capacity}")
    assert json.loads(stored) == {"tokens": "100k", "cost": "12.50"}


def test_a_closed_envelope_cannot_be_reopened(cluster: ClusterHandle, ns: str) -> None:
    create(cluster, ns, envelope())
    patch(cluster, ns, "renv", "wf", {"state": "Closed"})
    with pytest.raises(RejectedError, match="cannot be reopened"):
        patch(cluster, ns, "renv", "wf", {"state": "Open"})


def test_kubectl_explain_teaches_the_api(cluster: ClusterHandle, crds: None) -> None:
    def explain(field: str) -> str:
        # The API server publishes a new CRD's OpenAPI a moment after it is Established.
        deadline = time.monotonic() + 60
        while True:
            try:
                return " ".join(cluster.kubectl("explain", field).split())
            except RuntimeError:
                if time.monotonic() > deadline:
                    raise
                time.sleep(1)

    text = explain("branchclaim.spec.dispatch")
    assert "commit point" in text and "never goes back to false" in text
    text = explain("reservationenvelope.status.totals")
    assert "committed + reserved + reconciling + available == capacity" in text


# --- a hostile tenant's objects (issue 21) ---------------------------------------------

FULL_SELECTOR = {
    "matchLabels": {"app.example.com/role": "trainer"},
    "matchExpressions": [{"key": "tier", "operator": "In", "values": ["gpu", "gpu-spot"]}],
}
FULL_POD_TERM = {
    "labelSelector": FULL_SELECTOR,
    "namespaceSelector": {"matchExpressions": [{"key": "team", "operator": "Exists"}]},
    "namespaces": ["team-a"],
    "topologyKey": "kubernetes.io/hostname",
    "matchLabelKeys": ["pod-template-hash"],
    "mismatchLabelKeys": ["tenant"],
}
FULL_NODE_TERM = {
    "matchExpressions": [
        {"key": "nvidia.com/gpu.product", "operator": "In", "values": ["H100"]},
        {"key": "nvidia.com/gpu.count", "operator": "Gt", "values": ["3"]},
    ],
    "matchFields": [{"key": "metadata.name", "operator": "NotIn", "values": ["node-7"]}],
}
# Every field of core/v1 Affinity and Toleration, set.
FULL_PLACEMENT = {
    "nodeSelector": {"kubernetes.io/arch": "amd64", "node.example.com/pool": "gpu"},
    "tolerations": [
        {"key": "nvidia.com/gpu", "operator": "Exists", "effect": "NoSchedule"},
        {
            "key": "example.com/spot",
            "operator": "Equal",
            "value": "true",
            "effect": "NoExecute",
            "tolerationSeconds": 300,
        },
        {"operator": "Exists"},
    ],
    "affinity": {
        "nodeAffinity": {
            "requiredDuringSchedulingIgnoredDuringExecution": {
                "nodeSelectorTerms": [FULL_NODE_TERM]
            },
            "preferredDuringSchedulingIgnoredDuringExecution": [
                {"weight": 50, "preference": FULL_NODE_TERM}
            ],
        },
        "podAffinity": {
            "requiredDuringSchedulingIgnoredDuringExecution": [FULL_POD_TERM],
            "preferredDuringSchedulingIgnoredDuringExecution": [
                {"weight": 10, "podAffinityTerm": FULL_POD_TERM}
            ],
        },
        "podAntiAffinity": {
            "requiredDuringSchedulingIgnoredDuringExecution": [FULL_POD_TERM],
            "preferredDuringSchedulingIgnoredDuringExecution": [
                {"weight": 100, "podAffinityTerm": FULL_POD_TERM}
            ],
        },
    },
}


def test_a_full_core_v1_affinity_and_tolerations_are_accepted_as_written(
    cluster: ClusterHandle, ns: str
) -> None:
    """Typed as core/v1 types them: every field kept, and the pod the operator would make
    from them is one the API server accepts too."""
    create(cluster, ns, claim(placement=FULL_PLACEMENT))
    stored = json.loads(cluster.kubectl("get", "bclaim", "a", "-n", ns, "-o", "json"))
    assert stored["spec"]["placement"] == FULL_PLACEMENT
    pod = {
        "apiVersion": "v1",
        "kind": "Pod",
        "metadata": {"name": "placeholder"},
        "spec": {"containers": [{"name": "hold", "image": "pause"}], **FULL_PLACEMENT},
    }
    cluster.kubectl("create", "--dry-run=server", "-n", ns, "-f", "-", input=json.dumps(pod))


def nested(obj: dict[str, Any], depth: int) -> str:
    """`obj` as JSON with each "DEEP" value nested `depth` levels deep (written as text:
    Python's own encoder stops at about a thousand levels)."""
    return json.dumps(obj).replace('"DEEP"', '{"x": ' * depth + "{}" + "}" * depth)


def create_text(cluster: ClusterHandle, ns: str, text: str, *flags: str) -> None:
    try:
        cluster.kubectl("create", *flags, "-n", ns, "-f", "-", input=text)
    except RuntimeError as error:
        raise RejectedError(str(error)) from None


def test_a_claim_nesting_2000_levels_deep_is_refused_and_never_stored(
    cluster: ClusterHandle, ns: str
) -> None:
    """Issue 21: a 2,000-deep affinity was stored, and the operator's cluster-wide watch of
    claims died decoding it. Refused at `kubectl apply`; written without field validation,
    the unknown nesting is pruned: the stored object is as shallow as the schema."""
    deep = nested(claim(placement={"affinity": {"nodeAffinity": "DEEP"}}), 2000)
    with pytest.raises(RejectedError, match=r'unknown field "spec\.placement\.affinity\.node'):
        create_text(cluster, ns, deep)
    deep_tolerations = nested(claim(placement={"tolerations": ["DEEP"]}), 2000)
    with pytest.raises(RejectedError, match="unknown field"):
        create_text(cluster, ns, deep_tolerations)
    create_text(cluster, ns, deep, "--validate=false")
    stored = json.loads(cluster.kubectl("get", "bclaim", "a", "-n", ns, "-o", "json"))
    assert stored["spec"]["placement"] == {"affinity": {"nodeAffinity": {}}}


def test_a_megabyte_claim_is_refused(cluster: ClusterHandle, ns: str) -> None:
    """Every list, map and string is bounded: no spec reaches a megabyte (at most 229,143
    bytes, reservoir.core.scheduling), however it is filled."""
    term = {
        "matchExpressions": [
            {"key": f"k{i}", "operator": "In", "values": ["v" * 63] * 8} for i in range(4)
        ]
    }
    wide = {"nodeSelectorTerms": [term] * 450}  # over a megabyte of valid terms
    big = claim(
        placement={
            "affinity": {"nodeAffinity": {"requiredDuringSchedulingIgnoredDuringExecution": wide}}
        }
    )
    assert len(json.dumps(big)) > 1_000_000
    with pytest.raises(RejectedError, match="must have at most 4 items"):
        create(cluster, ns, big)
    with pytest.raises(RejectedError, match="may not be more than 253"):
        create(cluster, ns, claim(branch="b" * 1_000_000))
    labels = {f"example.com/k{i}": "v" * 63 for i in range(12_000)}
    with pytest.raises(RejectedError, match="must have at most 16 items"):
        create(cluster, ns, claim(placement={"nodeSelector": labels}))
    with pytest.raises(RejectedError, match="label keys look like"):
        create(cluster, ns, claim(placement={"nodeSelector": {"k" * 1_000_000: "v"}}))


HOSTILE_NAMES = ["../../tenant-b/reservationenvelopes/wf", "..", "wf/status", "WF", "wf%2F.."]


@pytest.mark.parametrize("name", HOSTILE_NAMES)
def test_a_name_that_could_steer_a_url_is_refused(
    cluster: ClusterHandle, ns: str, name: str
) -> None:
    """spec.envelope and spec.parent are object names (RFC 1123 subdomains), as every
    field holding a name is: `../../tenant-b/...` read another namespace's envelope."""
    with pytest.raises(RejectedError, match=r"spec\.envelope in body should match"):
        create(cluster, ns, claim(envelope=name))
    with pytest.raises(RejectedError, match=r"spec\.parent in body should match"):
        create(cluster, ns, envelope(parent=name))
