"""What the operator keeps in memory per live claim, measured at unit level (tracemalloc).

Not a test and not a benchmark: it runs no cluster and times nothing. For N copies of a
claim (and its Lease), parsed from JSON as the watch delivers them, it keeps what the
operator keeps for as long as the claim lives, through the same functions the operator
runs: the records of the claim and Lease informers (reservoir.k8s.informer; a claim's
spec and status kept as compact JSON), and the
writer's parsed facts (kept from pass to pass). Everything else is dropped, then the
traced memory still allocated is divided by N.

    .venv/bin/python hack/measure_claim_memory.py            # a small claim, and 1.5 MB

Not counted: the claim's ledger entry and its share of the envelope's ledger (parsed on
each pass), Python's allocator overhead (arenas), and kopf's transient copies while it
processes an event.
"""

from __future__ import annotations

import argparse
import gc
import json
import tracemalloc
from typing import Any

from reservoir.handlers.claims import claim_key
from reservoir.handlers.leases import lease_key
from reservoir.k8s import facts as read
from reservoir.k8s.claim_source import claim_record, lease_record
from reservoir.k8s.informer import Informer
from reservoir.undecodable import loads

MANAGED_FIELDS = [
    {
        "manager": manager,
        "operation": "Update",
        "apiVersion": "reservoir.dev/v1alpha1",
        "time": "2026-12-01T10:00:00Z",
        "fieldsType": "FieldsV1",
        "fieldsV1": {"f:spec": {"f:dispatch": {}, "f:usage": {"f:tokens": {}}}},
        **({"subresource": "status"} if manager == "reservoir" else {}),
    }
    for manager in ("reservoir-sdk", "reservoir")
]


def affinity_of(size: int) -> dict[str, Any]:
    """A node affinity of about `size` bytes of JSON: many small match expressions, the
    densest shape in objects per byte that the core/v1 schema allows."""
    expression = len(json.dumps({"key": "k0000000", "operator": "In", "values": ["v0000000"]}))
    expressions = [
        {"key": f"k{i:07d}", "operator": "In", "values": [f"v{i:07d}"]}
        for i in range(max(1, size // (expression + 2)))
    ]
    required = {"nodeSelectorTerms": [{"matchExpressions": expressions}]}
    return {"nodeAffinity": {"requiredDuringSchedulingIgnoredDuringExecution": required}}


def claim_json(i: int, hints: int) -> str:
    spec: dict[str, Any] = {
        "envelope": "wf",
        "branch": f"branch-{i}",
        "attempt": 1,
        "requests": {"tokens": "20k", "cpu": "2"},
        "commitPoint": "Dispatch",
        "lease": {"durationSeconds": 60},
        "dispatch": True,
        "usage": {"tokens": "1200"},
        "upstream": {"requestId": f"req-{i:08d}"},
    }
    if hints:
        spec["placement"] = {
            "nodeSelector": {"pool": "gpu"},
            "tolerations": [{"key": "gpu", "operator": "Exists", "effect": "NoSchedule"}],
            "affinity": affinity_of(hints),
        }
    at = "2026-12-01T10:00:00Z"
    body = {
        "apiVersion": "reservoir.dev/v1alpha1",
        "kind": "BranchClaim",
        "metadata": {
            "name": f"claim-{i:08d}",
            "namespace": "team-a",
            "uid": f"00000000-0000-4000-8000-{i:012d}",
            "resourceVersion": str(100_000 + i),
            "generation": 3,
            "creationTimestamp": at,
            "labels": {"reservoir.dev/envelope": "wf"},
            "finalizers": ["reservoir.dev/claim"],
            "ownerReferences": [
                {
                    "apiVersion": "reservoir.dev/v1alpha1",
                    "kind": "ReservationEnvelope",
                    "name": "wf",
                    "uid": "11111111-0000-4000-8000-000000000000",
                }
            ],
            "managedFields": MANAGED_FIELDS,
        },
        "spec": spec,
        "status": {
            "phase": "Committed",
            "envelopeUid": "11111111-0000-4000-8000-000000000000",
            "observedGeneration": 3,
            "conditions": [
                {
                    "type": kind,
                    "status": value,
                    "reason": reason,
                    "message": "",
                    "lastTransitionTime": at,
                    "observedGeneration": 3,
                }
                for kind, value, reason in (
                    ("Reserved", "True", "Committed"),
                    ("Committed", "True", "Dispatched"),
                    ("Running", "False", "NotStarted"),
                    ("Detached", "False", "Attached"),
                    ("CancelRequested", "False", "NotRequested"),
                    ("Settled", "False", "NotSettled"),
                )
            ],
            "ledger": {
                "claim": f"claim-{i:08d}",
                "branch": f"branch-{i}",
                "attempt": 1,
                "phase": "Committed",
                "reserved": {"tokens": "20k", "cpu": "2"},
                "usage": {"tokens": "1200"},
                "consumed": {},
                "released": {},
                "occupancy": {},
                "reusableReturned": {},
                "compensations": [],
                "firstReservedAt": at,
                "expiresAt": "2026-12-01T10:01:00Z",
                "renewals": 1,
                "stamp": 2,
                "dispatchFenced": False,
                "podStartedLate": False,
                "history": [
                    {
                        "from": "Pending",
                        "to": "Tentative",
                        "reason": "Reserved",
                        "trigger": "Admission",
                        "at": at,
                        "leaseGeneration": 1,
                    },
                    {
                        "from": "Tentative",
                        "to": "Committed",
                        "reason": "Dispatched",
                        "trigger": "Worker",
                        "at": at,
                        "leaseGeneration": 1,
                    },
                ],
            },
        },
    }
    return json.dumps(body)


def lease_json(i: int) -> str:
    return json.dumps(
        {
            "apiVersion": "coordination.k8s.io/v1",
            "kind": "Lease",
            "metadata": {
                "name": f"claim-{i:08d}",
                "namespace": "team-a",
                "uid": f"22222222-0000-4000-8000-{i:012d}",
                "resourceVersion": str(200_000 + i),
                "creationTimestamp": "2026-12-01T10:00:00Z",
                "labels": {"reservoir.dev/envelope": "wf"},
                "managedFields": MANAGED_FIELDS[:1],
            },
            "spec": {
                "holderIdentity": "worker-1",
                "leaseDurationSeconds": 60,
                "renewTime": "2026-12-01T10:00:30.000000Z",
                "leaseTransitions": 0,
            },
        }
    )


def per_claim(count: int, hints: int) -> tuple[float, int]:
    """Bytes kept per claim (traced), and the size of its JSON."""
    texts = [(claim_json(i, hints), lease_json(i)) for i in range(count)]
    claims = Informer("branchclaims", claim_record, claim_key, lambda *_: None)
    leases = Informer("leases", lease_record, lease_key, lambda *_: None)
    facts: list[Any] = []
    gc.collect()
    tracemalloc.start()
    before = tracemalloc.get_traced_memory()[0]
    for claim_text, lease_text in texts:  # as the watch delivers them, one by one
        claims.apply({"type": "ADDED", "object": loads(claim_text)}, None)  # as it decodes
        leases.apply({"type": "ADDED", "object": loads(lease_text)}, None)
    by_name = {lease["metadata"]["name"]: lease for lease in leases.get(("team-a", "wf"))}
    for claim in claims.get(("team-a", "wf")):  # the writer's facts, kept between passes
        facts.append(read.claim_facts(claim, by_name[claim["metadata"]["name"]]))
    del by_name
    gc.collect()
    after = tracemalloc.get_traced_memory()[0]
    tracemalloc.stop()
    return (after - before) / count, len(texts[0][0])


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--small", type=int, default=2000, help="small claims to keep")
    parser.add_argument("--large", type=int, default=4, help="1.5 MB claims to keep")
    args = parser.parse_args()
    for label, count, hints in (
        ("small claim", args.small, 0),
        ("claim with a 1.5 MB affinity", args.large, 1_500_000),
    ):
        live, size = per_claim(count, hints)
        print(
            f"{label} (JSON {size / 1024:,.1f} KiB, N={count}): kept {live / 1024:,.1f} KiB "
            "a claim while it lives"
        )


if __name__ == "__main__":
    main()
