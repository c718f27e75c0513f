"""Parsed facts kept from pass to pass share pydantic's per-model set of given fields
(`share_field_sets`): the same facts, a third less memory, and no copy or change of one
model reaching another through the shared set."""

from __future__ import annotations

import json
from typing import Any

from reservoir.core.model import ClaimPhase, LedgerEntry
from reservoir.core.model.common import SHARED_FIELD_SETS, _field_sets, share_field_sets
from reservoir.k8s import facts as read

AT = "2026-12-04T05:13:29.039185Z"


def claim(i: int) -> dict[str, Any]:
    name = f"s-{i:05d}"
    line = {
        "attempt": 1, "branch": name, "claim": name, "phase": "Tentative",
        "reserved": {"tokens": "10"}, "firstReservedAt": AT, "expiresAt": AT, "stamp": 1,
        "history": [{"at": AT, "from": "Pending", "to": "Tentative", "reason": "Reserved",
                     "trigger": "Admission", "leaseGeneration": 1}],
    }  # fmt: skip
    return {
        "metadata": {"name": name, "namespace": "ns", "uid": f"u-{i}",
                     "resourceVersion": str(i), "creationTimestamp": AT},
        "spec": {"envelope": "wf", "branch": name, "requests": {"tokens": "10"},
                 "lease": {"holder": "w"}, "upstream": {"supportsCancel": False}},
        "status": {"phase": "Tentative", "ledger": line},
    }  # fmt: skip


def facts(i: int) -> read.ClaimFacts:
    found = read.claim_facts(json.loads(json.dumps(claim(i))), None)
    assert isinstance(found, read.ClaimFacts)
    return found


def test_facts_share_their_field_sets_and_read_the_same() -> None:
    a, b = facts(1), facts(2)
    assert a.line is not None and b.line is not None
    assert a.spec.__pydantic_fields_set__ is b.spec.__pydantic_fields_set__
    assert a.line.history[0].__pydantic_fields_set__ is b.line.history[0].__pydantic_fields_set__
    assert a.spec.model_fields_set == {"envelope", "branch", "requests", "lease", "upstream"}
    # The same facts as parsed without sharing.
    plain = LedgerEntry.model_validate(claim(1)["status"]["ledger"])
    assert a.line == plain and a.line.to_api() == plain.to_api()


def test_no_copy_or_change_of_one_reaches_another() -> None:
    a, b = facts(3), facts(4)
    assert a.line is not None and b.line is not None
    shared = set(b.line.__pydantic_fields_set__)
    twin = a.line.copied()
    twin.phase = ClaimPhase.COMMITTED
    twin.renewals = 3
    updated = a.line.model_copy(update={"renewals": 5})
    deep = a.line.model_copy(deep=True, update={"usage": {}})
    assert twin.__pydantic_fields_set__ is not a.line.__pydantic_fields_set__
    assert updated.__pydantic_fields_set__ is not a.line.__pydantic_fields_set__
    assert deep.__pydantic_fields_set__ is not a.line.__pydantic_fields_set__
    assert b.line.__pydantic_fields_set__ == shared, "the others' sets are as they were"
    assert b.line.phase == ClaimPhase.TENTATIVE and b.line.renewals == 0


def test_the_table_of_shared_sets_is_bounded() -> None:
    """Models given ever new combinations of names never grow the table past its bound."""
    for i in range(SHARED_FIELD_SETS + 10):
        line = facts(i).line
        assert line is not None
        object.__setattr__(line, "__pydantic_fields_set__", {"claim", f"x{i}"})
        share_field_sets(line)
        assert len(_field_sets) <= SHARED_FIELD_SETS
