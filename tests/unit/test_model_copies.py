"""`Model.copied()`, the core's deep copy made field by field (reservoir.core.model.common):
the same value as pydantic's `model_copy(deep=True)`, sharing nothing that can change in
place with its original, on the fullest records the core makes."""

from __future__ import annotations

import copy
from collections.abc import Iterator
from typing import Any

import pytest
from pydantic import BaseModel

from reservoir.core.claimstatus import claim_status
from reservoir.core.model import common
from reservoir.core.model.common import Model
from tests.unit.sim import Sim
from tests.unit.test_ledger_size import heavy_entry


def mutable_parts(value: Any) -> Iterator[Any]:
    """Every object in `value` that can change in place: models, dicts, lists."""
    if isinstance(value, BaseModel):
        yield value
        for part in value.__dict__.values():
            yield from mutable_parts(part)
    elif isinstance(value, dict):
        yield value
        for part in value.values():
            yield from mutable_parts(part)
    elif isinstance(value, list):
        yield value
        for part in value:
            yield from mutable_parts(part)


def records() -> list[Model]:
    """The fullest line the size test knows, and an envelope's status and a claim's after a
    simulated history with every kind of move (admission, dispatch, usage, settlement,
    a late report, a cancel, a deletion)."""
    sim = Sim(capacity={"tokens": "100", "cost": "10"}, max_active_claims=3)
    sim.create("a", {"tokens": "10", "cost": "1"}).create("b").create("c").create("d")
    sim.reconcile().write_lines().mirror().dispatch("a").usage("a", "4").tick()
    sim.reconcile().write_lines().cancel("b").delete("c").tick().reconcile().write_lines()
    sim.usage("a", "6", final=True, outcome="Succeeded", cost="1").tick()
    sim.reconcile().write_lines().mirror().usage("a", "7", final=True).tick().reconcile()
    lines = [*sim.status.entries.values(), *(f.line for f in sim.claims.values() if f.line)]
    found: list[Model] = [heavy_entry(1), sim.status, *lines]
    found += [claim_status(line, None, None, 1, sim.now) for line in lines]
    return found


@pytest.mark.parametrize("record", records(), ids=lambda r: type(r).__name__)
def test_a_copy_is_equal_and_shares_nothing_mutable(record: Model) -> None:
    twin = record.copied()

    assert twin == record.model_copy(deep=True)
    assert twin.model_dump(mode="json") == record.model_dump(mode="json")
    assert twin.model_fields_set == record.model_fields_set
    originals = {id(part) for part in mutable_parts(record)}
    assert not any(id(part) in originals for part in mutable_parts(twin))


def test_the_fast_path_covers_every_field_of_the_records_the_core_makes(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """No field of these records falls back to copy.deepcopy (the slow way it avoids)."""

    def refuse(value: Any, memo: Any = None) -> Any:
        raise AssertionError(f"copied by deepcopy: {type(value).__name__}")

    monkeypatch.setattr(common.copy, "deepcopy", refuse)
    for record in records():
        record.copied()


def test_a_change_to_the_copy_leaves_the_original_as_it_was() -> None:
    line = heavy_entry(2)
    before = copy.deepcopy(line.model_dump())
    twin = line.copied()
    twin.reserved["tokens"] = twin.reserved["tokens"] + 1
    assert twin.overrun is not None and twin.settlement is not None
    twin.overrun.usage.clear()
    twin.settlement.reason = "Changed"
    assert line.model_dump() == before


def test_a_model_with_state_beyond_its_fields_is_copied_the_slow_way() -> None:
    """Private attributes and extra fields are not in the fields `copied` walks."""
    from pydantic import ConfigDict, PrivateAttr

    class Extended(Model):
        model_config = ConfigDict(extra="allow")
        name: str = "x"
        _cache: dict[str, int] = PrivateAttr(default_factory=dict)

    record = Extended.model_validate({"name": "a", "more": {"k": [1]}})
    record._cache["k"] = 1
    twin = record.copied()
    assert twin == record and twin._cache == {"k": 1} and twin.model_extra == {"more": {"k": [1]}}
    assert twin._cache is not record._cache
