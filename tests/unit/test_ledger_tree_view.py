"""`kubectl reservoir ledger` as a tree, and `kubectl reservoir pool`, without a cluster.

The objects are built from the models and rendered as the API returns them (`to_api()`);
the SDK assembles the tree from them through a fake lightkube client that answers `get`
and `list` (with the field selectors spec.envelope and spec.parent) as the API server
would."""

from __future__ import annotations

import asyncio
import dataclasses
from collections.abc import AsyncIterator, Mapping, Sequence
from datetime import UTC, datetime
from decimal import Decimal
from typing import Any

from reservoir.cli.plugin import duration, parser, run, show_ledger, show_pool
from reservoir.core.model import (
    MAX_DEPTH,
    BranchClaimSpec,
    BranchClaimStatus,
    ChildEntry,
    ChildPhase,
    ClaimPhase,
    ContractType,
    EnvelopePhase,
    LedgerEntry,
    NamespaceUsage,
    ParentKind,
    ParentRecord,
    PreemptionRequest,
    ReservationEnvelopeStatus,
    ReservationPoolStatus,
    ResourceTotals,
    Settlement,
    WindowSlice,
)
from reservoir.core.quantity import parse_resources
from reservoir.k8s.resources import BranchClaim, ReservationEnvelope, ReservationPool
from reservoir.sdk import AsyncReservoir, ClaimView, EnvelopeTree, EnvelopeView, PoolView

NS = "team-a"
T0 = datetime(2025, 1, 1, 12, 0, tzinfo=UTC)


def q(values: Mapping[str, str]) -> dict[str, Decimal]:
    return parse_resources(values)


def totals(capacity: dict[str, str], **parts: dict[str, str]) -> ResourceTotals:
    """Totals that add up: available is what the other parts leave of the capacity."""
    cap = q(capacity)
    held = {part: q(parts.get(part, {})) for part in ("committed", "reserved", "reconciling")}
    available = {k: v - sum(held[p].get(k, Decimal(0)) for p in held) for k, v in cap.items()}
    return ResourceTotals(capacity=cap, available=available, **held)


def entry(claim: str, phase: ClaimPhase, reserved: dict[str, str], **settled: Any) -> LedgerEntry:
    consumed = q(settled.get("consumed", {}))
    released = {k: v - consumed.get(k, Decimal(0)) for k, v in q(reserved).items()}
    return LedgerEntry(
        claim=claim,
        branch=claim,
        phase=phase,
        reserved=q(reserved),
        consumed=consumed if phase.terminal else {},
        released=released if phase.terminal else {},
        settlement=Settlement(key=f"{claim}/1", phase=phase, reason=settled["reason"], at=T0)
        if phase.terminal
        else None,
    )


def envelope(
    name: str,
    status: ReservationEnvelopeStatus,
    parent: str | None = None,
) -> dict[str, Any]:
    spec: dict[str, Any] = {"capacity": {k: str(v) for k, v in status.totals.capacity.items()}}
    if parent:
        spec["parent"] = parent
    return {
        "apiVersion": "reservoir.dev/v1alpha1",
        "kind": "ReservationEnvelope",
        "metadata": {"name": name, "namespace": NS, "uid": f"uid-{name}", "resourceVersion": "1"},
        "spec": spec,
        "status": status.to_api(),
    }


def claim(name: str, envelope_name: str, status: BranchClaimStatus) -> dict[str, Any]:
    spec = BranchClaimSpec(
        envelope=envelope_name, branch=name, requests=status.reserved or {"x": 1}
    )
    return {
        "metadata": {"name": name, "namespace": NS, "uid": f"uid-{name}", "resourceVersion": "1"},
        "spec": spec.to_api(),
        "status": status.to_api(),
    }


def reserved_line(name: str, reserved: dict[str, str]) -> ChildEntry:
    return ChildEntry(
        envelope=name, phase=ChildPhase.RESERVED, reserved=q(reserved), reserved_at=T0
    )


def settled_line(name: str, reserved: dict[str, str], consumed: dict[str, str]) -> ChildEntry:
    r, c = q(reserved), q(consumed)
    return ChildEntry(
        envelope=name,
        phase=ChildPhase.SETTLED,
        reserved=r,
        consumed=c,
        released={k: v - c.get(k, Decimal(0)) for k, v in r.items()},
        reserved_at=T0,
        settled_at=T0,
        reason="Closed",
    )


def from_envelope(
    parent: str,
    depth: int,
    settled: ChildEntry | None = None,
    reserved: dict[str, str] | None = None,
    stamp: int = 1,
) -> ParentRecord:
    return ParentRecord(
        kind=ParentKind.ENVELOPE,
        name=parent,
        uid=f"uid-{parent}",
        depth=depth,
        admitted_at=T0,
        reserved=q(reserved or {}),
        stamp=stamp,
        settled=settled,
    )


WRITE_LINE = settled_line(
    "write", {"tokens": "30k", "cost": "3"}, {"tokens": "12k", "cost": "1"}
).model_copy(update={"stamp": 2})
CHILD_CAPACITY = {"tokens": "30k", "cost": "3"}


def two_levels(write_line_compacted: bool = False) -> list[dict[str, Any]]:
    """planner (drawn from pool tenant-a) with one claim and three children: search (open,
    one claim), write (closed: C = tokens 12k cost 1 stays committed in planner, R − C
    returned) and late (waiting for room). Search holds its line; write's settlement is in
    flight in planner until write records it (`write_line_compacted`)."""
    children = {}
    if not write_line_compacted:
        children["uid-write"] = WRITE_LINE
    planner = ReservationEnvelopeStatus(
        phase=EnvelopePhase.OPEN,
        totals=totals(
            {"tokens": "100k", "cost": "10"},
            committed={"tokens": "12k", "cost": "1"},
            reserved={"tokens": "50k", "cost": "5"},
        ),
        entries={"uid-plan": entry("plan", ClaimPhase.COMMITTED, {"tokens": "20k", "cost": "2"})},
        children=children,
        parent=ParentRecord(
            kind=ParentKind.POOL, name="tenant-a", uid="uid-tenant-a", depth=1, admitted_at=T0
        ),
    )
    search = ReservationEnvelopeStatus(
        phase=EnvelopePhase.OPEN,
        totals=totals({"tokens": "30k", "cost": "3"}, reserved={"tokens": "10k", "cost": "1"}),
        entries={"uid-q1": entry("q1", ClaimPhase.TENTATIVE, {"tokens": "10k", "cost": "1"})},
        parent=from_envelope("planner", 2, reserved=CHILD_CAPACITY),
    )
    write = ReservationEnvelopeStatus(
        phase=EnvelopePhase.CLOSED,
        totals=totals({"tokens": "30k", "cost": "3"}, committed={"tokens": "12k", "cost": "1"}),
        entries={
            "uid-w1": entry(
                "w1",
                ClaimPhase.CONSUMED,
                {"tokens": "15k", "cost": "1.5"},
                consumed={"tokens": "12k", "cost": "1"},
                reason="Completed",
            )
        },
        parent=from_envelope(
            "planner", 2, WRITE_LINE if write_line_compacted else None, CHILD_CAPACITY
        ),
        balance_released=q({"tokens": "18k", "cost": "2"}),
    )
    late = ReservationEnvelopeStatus(
        phase=EnvelopePhase.PENDING,
        queue_reason="waiting for room in ReservationEnvelope planner",
    )
    return [
        envelope("planner", planner),
        envelope("search", search, parent="planner"),
        envelope("write", write, parent="planner"),
        envelope("late", late, parent="planner"),
    ]


class FakeClient:
    """Answers get and list as the API server would, field selectors included, and
    records the selectors it was listed with."""

    namespace = NS

    def __init__(
        self,
        envelopes: Sequence[dict[str, Any]],
        claims: Sequence[dict[str, Any]] = (),
        pools: Sequence[dict[str, Any]] = (),
    ) -> None:
        self.objects: dict[Any, list[dict[str, Any]]] = {
            ReservationEnvelope: list(envelopes),
            BranchClaim: list(claims),
            ReservationPool: list(pools),
        }
        self.lists: list[tuple[str, str]] = []

    async def get(self, kind: Any, name: str, namespace: str | None = None) -> dict[str, Any]:
        return next(o for o in self.objects[kind] if o["metadata"]["name"] == name)

    async def list(
        self, kind: Any, namespace: str | None = None, fields: dict[str, str] | None = None
    ) -> AsyncIterator[dict[str, Any]]:
        if not fields:  # a whole namespace
            for obj in self.objects[kind]:
                if obj["metadata"].get("namespace") == namespace:
                    yield obj
            return
        ((field, value),) = fields.items()
        if field == "metadata.name":  # a fresh read of one object
            for obj in self.objects[kind]:
                if obj["metadata"]["name"] == value:
                    yield obj
            return
        self.lists.append((field, value))
        for obj in self.objects[kind]:
            if obj["spec"].get(field.removeprefix("spec.")) == value:
                yield obj

    async def close(self) -> None:
        pass


def sdk_over(client: FakeClient) -> AsyncReservoir:
    return AsyncReservoir(namespace=NS, holder="test", client=client)  # type: ignore[arg-type]


async def tree_of(
    name: str, envelopes: Sequence[dict[str, Any]], claims: Sequence[dict[str, Any]] = ()
) -> EnvelopeTree:
    return await sdk_over(FakeClient(envelopes, claims)).tree(name)


def block(text: str, start: str) -> list[str]:
    """The lines from the one starting (after indentation) with `start` to the next blank."""
    lines = text.split("\n")
    begin = next(i for i, line in enumerate(lines) if line.lstrip().startswith(start))
    end = next((i for i in range(begin, len(lines)) if not lines[i]), len(lines))
    return lines[begin:end]


def words(lines: list[str]) -> dict[str, list[str]]:
    return {line.split()[0]: line.split() for line in lines if line.strip()}


# --- the tree -----------------------------------------------------------------------------


async def test_a_two_level_tree_shows_each_envelope_with_its_totals_line_and_claims() -> None:
    shown = show_ledger(await tree_of("planner", two_levels()))
    lines = shown.split("\n")
    assert (
        lines[0] == "envelope team-a/planner: Open, drawn from ReservationPool tenant-a (depth 1)"
    )
    top = words(block(shown, "RESOURCE"))
    assert top["tokens"][1:] == ["Consumable", "100000", "12000", "50000", "0", "38000"]
    assert top["cost"][1:] == ["Consumable", "10", "1", "5", "0", "4"]
    assert list(words(block(shown, "CLAIM"))) == ["CLAIM", "plan"]  # children's claims apart
    assert "child envelopes of planner (3):" in lines

    search = block(shown, "envelope team-a/search")
    assert all(line.startswith("  ") and not line.startswith("   ") for line in search)
    assert search[0].strip() == (
        "envelope team-a/search: Open, drawn from ReservationEnvelope planner (depth 2)"
    )
    assert search[1].strip() == "line in planner: Reserved cost=3 tokens=30000"
    assert words(search)["tokens"][1:] == ["Consumable", "30000", "0", "10000", "0", "20000"]
    claims = block(shown[shown.index("envelope team-a/search") :], "CLAIM")
    assert [line.split()[:3] for line in claims[1:]] == [["q1", "q1", "Tentative"]]

    write = block(shown, "envelope team-a/write")
    assert write[1].strip() == (
        "line in planner: Settled (Closed): reserved cost=3 tokens=30000, "
        "consumed cost=1 tokens=12000, released cost=2 tokens=18000"
    )
    assert words(write)["tokens"][1:] == ["Consumable", "30000", "12000", "0", "0", "18000"]
    assert "  balance released at close: cost=2 tokens=18000" in lines


async def test_the_sdk_finds_children_by_the_spec_parent_field_selector() -> None:
    client = FakeClient(two_levels())
    tree = await sdk_over(client).tree("planner")
    assert [child.envelope.name for child in tree.children or ()] == ["late", "search", "write"]
    assert ("spec.parent", "planner") in client.lists
    assert {("spec.parent", c) for c in ("late", "search", "write")} <= set(client.lists)
    assert ("spec.envelope", "search") in client.lists
    assert tree.envelope.uid == "uid-planner" and tree.children
    assert tree.children[1].envelope.parent == "planner"


async def test_a_settled_line_compacted_out_of_the_parent_is_read_from_the_child() -> None:
    shown = show_ledger(await tree_of("planner", two_levels(write_line_compacted=True)))
    write = block(shown, "envelope team-a/write")
    assert write[1].strip().startswith("line in planner: Settled (Closed): reserved cost=3")
    assert "released cost=2 tokens=18000" in write[1]
    assert "not found" not in shown  # not mistaken for a line whose child is gone


async def test_a_pending_child_shows_why_it_waits_and_holds_no_line() -> None:
    shown = show_ledger(await tree_of("planner", two_levels()))
    late = block(shown, "envelope team-a/late")
    assert late[0].strip() == (
        "envelope team-a/late: Pending, parent ReservationEnvelope planner (not admitted yet); "
        "queued: waiting for room in ReservationEnvelope planner"
    )
    assert late[1].strip() == "line in planner: none (not admitted)"
    assert late[2].strip() == "(no totals recorded yet)"


async def test_a_line_whose_child_envelope_is_gone_is_still_shown() -> None:
    objects = two_levels()
    held = reserved_line("gone", {"tokens": "5k"}).to_api()
    objects[0]["status"]["children"]["uid-gone"] = held
    shown = show_ledger(await tree_of("planner", objects))
    gone = block(shown, "envelope team-a/gone")
    assert gone == [
        "  envelope team-a/gone: not found (uid-gone)",
        "  line in planner: Reserved tokens=5000",
    ]
    assert "child envelopes of planner (4):" in shown


def chain(length: int) -> list[dict[str, Any]]:
    """e1 <- e2 <- ... <- e{length}: each the parent of the next."""
    found = []
    for level in range(1, length + 1):
        status = ReservationEnvelopeStatus(
            phase=EnvelopePhase.OPEN,
            totals=totals({"tokens": "10"}),
            parent=ParentRecord(kind=ParentKind.ROOT, admitted_at=T0)
            if level == 1
            else from_envelope(f"e{level - 1}", min(level, MAX_DEPTH)),
        )
        if level < length:
            status.children = {f"uid-e{level + 1}": reserved_line(f"e{level + 1}", {"tokens": "1"})}
        found.append(envelope(f"e{level}", status, parent=f"e{level - 1}" if level > 1 else None))
    return found


async def test_the_tree_stops_at_max_depth_levels() -> None:
    client = FakeClient(chain(MAX_DEPTH + 2))
    tree = await sdk_over(client).tree("e1")
    shown = show_ledger(tree)
    assert shown.startswith("envelope team-a/e1: Open, root: its own capacity (depth 1)")
    for level in range(1, MAX_DEPTH + 1):
        header = f"{'  ' * (level - 1)}envelope team-a/e{level}: Open"
        assert any(line.startswith(header) for line in shown.split("\n")), level
    assert f"e{MAX_DEPTH + 1}:" not in shown
    assert ("spec.parent", f"e{MAX_DEPTH}") not in client.lists  # not even listed
    assert f"below the depth bound of {MAX_DEPTH} not shown" in shown


def test_rendering_alone_stops_at_max_depth_levels() -> None:
    views = [EnvelopeView.from_api(obj) for obj in chain(MAX_DEPTH + 2)]
    tree = EnvelopeTree(views[-1])
    for view in reversed(views[:-1]):
        tree = EnvelopeTree(view, children=(tree,))
    shown = show_ledger(tree)
    assert f"envelope team-a/e{MAX_DEPTH}:" in shown
    assert f"envelope team-a/e{MAX_DEPTH + 1}:" not in shown


async def test_parents_forming_a_cycle_are_listed_once() -> None:
    waiting = ReservationEnvelopeStatus(
        phase=EnvelopePhase.PENDING, queue_reason="its parents form a cycle through b"
    )
    client = FakeClient([envelope("a", waiting, parent="b"), envelope("b", waiting, parent="a")])
    tree = await sdk_over(client).tree("a")
    assert tree.children is not None and [c.envelope.name for c in tree.children] == ["b"]
    assert tree.children[0].children == ()
    assert show_ledger(tree).count("envelope team-a/a:") == 1


def test_a_withdrawn_envelope_says_it_never_drew_on_its_parent() -> None:
    status = ReservationEnvelopeStatus(
        phase=EnvelopePhase.CLOSED,
        parent=ParentRecord(kind=ParentKind.ENVELOPE, name="planner", uid="uid-planner"),
    )
    view = EnvelopeView(name="x", namespace=NS, status=status, parent="planner")
    assert show_ledger(view).split("\n")[0] == (
        "envelope team-a/x: Closed, withdrawn from ReservationEnvelope planner (never admitted)"
    )


def test_a_leaf_envelope_reads_as_before() -> None:
    """What tests/integration/test_sdk_and_plugin.py reads of a leaf: rows keyed by their
    first word, the totals' columns, and the settled claims compacted into their status."""
    objects = two_levels()
    view = EnvelopeView.from_api(objects[2])  # write: one settled claim, no children
    compacted = BranchClaimStatus(
        phase=ClaimPhase.RELEASED,
        reserved=q({"tokens": "1k"}),
        released=q({"tokens": "1k"}),
        settlement=Settlement(key="k", phase=ClaimPhase.RELEASED, reason="Cancelled", at=T0),
    )
    claims = [ClaimView.from_api(claim("old", "write", compacted))]
    shown = show_ledger(EnvelopeTree(view, tuple(claims)))
    rows = words(shown.split("\n"))
    assert rows["tokens"][1:] == ["Consumable", "30000", "12000", "0", "0", "18000"]
    assert "Completed" in rows["w1"]
    assert rows["old"][1:3] == ["old", "Released"]
    assert "child envelopes" not in shown
    assert show_ledger(view, claims) == shown


# --- contracts ------------------------------------------------------------------------------


WINDOW_AT = datetime(2025, 1, 1, 12, 0, 20, tzinfo=UTC)


def contracted_envelope(recorded: bool = True) -> dict[str, Any]:
    """An envelope of four contracts: 8 GPUs (Reusable by default), 2 concurrency permits
    (Reusable by default), 50k tokens (Consumable by default) and 5 requests per 20 s
    (Replenishing, declared). A GPU claim settled (its 8 GPUs all back, 12k tokens kept
    committed), one holding a permit, and 3 requests still in their window."""
    gpu_claim = LedgerEntry(
        claim="train-1",
        branch="train",
        phase=ClaimPhase.CONSUMED,
        reserved=q({"nvidia.com/gpu": "8", "tokens": "20k"}),
        consumed=q({"tokens": "12k"}),
        released=q({"nvidia.com/gpu": "8", "tokens": "8k"}),
        occupancy=q({"nvidia.com/gpu": "480"}),
        settlement=Settlement(
            key="train-1/1", phase=ClaimPhase.CONSUMED, reason="Completed", at=T0
        ),
    )
    status = ReservationEnvelopeStatus(
        phase=EnvelopePhase.OPEN,
        totals=totals(
            {"nvidia.com/gpu": "8", "concurrency": "2", "tokens": "50k", "requests": "5"},
            committed={"tokens": "12k", "requests": "3"},
            reserved={"concurrency": "1", "requests": "1"},
        ),
        entries={
            "uid-train-1": gpu_claim,
            "uid-ask": entry("ask", ClaimPhase.TENTATIVE, {"concurrency": "1", "requests": "1"}),
        },
        contracts={
            "nvidia.com/gpu": ContractType.REUSABLE,
            "concurrency": ContractType.REUSABLE,
            "tokens": ContractType.CONSUMABLE,
            "requests": ContractType.REPLENISHING,
        }
        if recorded
        else {},
        peak=q({"nvidia.com/gpu": "8", "concurrency": "2", "requests": "4"}) if recorded else {},
        windows={
            "requests": [
                WindowSlice(start=T0, returns_at=WINDOW_AT, amount=Decimal(2)),
                WindowSlice(start=T0, returns_at=WINDOW_AT.replace(second=22), amount=Decimal(1)),
            ]
        }
        if recorded
        else {},
    )
    obj = envelope("fine-tune", status)
    obj["spec"]["contracts"] = {"requests": {"type": "Replenishing", "windowSeconds": 20}}
    return obj


def test_the_totals_show_each_resources_contract_its_peak_and_the_window() -> None:
    shown = show_ledger(EnvelopeView.from_api(contracted_envelope()))
    header = block(shown, "RESOURCE")[0].split()
    assert header == [
        "RESOURCE",
        "CONTRACT",
        *("CAPACITY", "COMMITTED", "RESERVED", "RECONCILING", "AVAILABLE"),
        "PEAK",
        "WINDOW",
    ]
    rows = words(block(shown, "RESOURCE"))
    assert rows["nvidia.com/gpu"][1:] == ["Reusable", "8", "0", "0", "0", "8", "8", "-"]
    assert rows["concurrency"][1:] == ["Reusable", "2", "0", "1", "0", "1", "2", "-"]
    assert rows["tokens"][1:] == ["Consumable", "50000", "12000", "0", "0", "38000", "-", "-"]
    assert rows["requests"][1:] == ["Replenishing", "5", "3", "1", "0", "1", "4", "20s"]
    assert (
        "window requests: 3 committed in its 20s window, returning "
        "2 at 2025-01-01T12:00:20Z, 1 at 2025-01-01T12:00:22Z"
    ) in shown.split("\n")


def test_a_reusable_claim_shows_all_of_r_released_and_its_occupancy() -> None:
    shown = show_ledger(EnvelopeView.from_api(contracted_envelope()))
    claims = block(shown, "CLAIM")
    assert claims[0].split()[-1] == "OCCUPANCY"
    train = words(claims)["train-1"]
    assert train[2:] == [
        "Consumed",
        "nvidia.com/gpu=8",
        "tokens=20000",
        "tokens=12000",  # the GPUs are not consumed: only the tokens are
        "nvidia.com/gpu=8",
        "tokens=8000",
        "Completed",
        "nvidia.com/gpu=480",
    ]
    assert words(claims)["ask"][-1] == "-"


def test_before_the_operator_records_them_contracts_are_the_declared_or_the_defaults() -> None:
    view = EnvelopeView.from_api(contracted_envelope(recorded=False))
    assert view.contracts == {
        "concurrency": ContractType.REUSABLE,
        "nvidia.com/gpu": ContractType.REUSABLE,
        "requests": ContractType.REPLENISHING,
        "tokens": ContractType.CONSUMABLE,
    }
    rows = words(block(show_ledger(view), "RESOURCE"))
    assert rows["nvidia.com/gpu"][1] == "Reusable" and rows["tokens"][1] == "Consumable"
    assert rows["requests"][-1] == "20s"


def test_the_recorded_contract_is_shown_over_a_default() -> None:
    obj = contracted_envelope()
    obj["status"]["contracts"]["concurrency"] = "Consumable"  # as the operator resolved it
    assert EnvelopeView.from_api(obj).contracts["concurrency"] is ContractType.CONSUMABLE


def test_the_sdk_view_exposes_contracts_peak_windows_and_occupancy() -> None:
    obj = contracted_envelope()
    view = EnvelopeView.from_api(obj)
    assert view.contracts["requests"] is ContractType.REPLENISHING
    assert view.peak == {"nvidia.com/gpu": 8, "concurrency": 2, "requests": 4}
    assert view.window_seconds == {"requests": 20}
    assert [s.amount for s in view.windows["requests"]] == [2, 1]
    entry = LedgerEntry.model_validate(obj["status"]["entries"]["uid-train-1"])
    status = BranchClaimStatus(phase=ClaimPhase.CONSUMED, occupancy=q({"nvidia.com/gpu": "1"}))
    claim_view = ClaimView.from_api(claim("train-1", "fine-tune", status))
    assert claim_view.occupancy == {"nvidia.com/gpu": 1}  # the status, with no entry read
    with_entry = dataclasses.replace(claim_view, entry=entry)
    assert with_entry.occupancy == {"nvidia.com/gpu": 480}  # the ledger's entry first


def test_consumable_budgets_show_no_peak_window_or_occupancy_columns() -> None:
    shown = show_ledger(EnvelopeView.from_api(two_levels()[2]))
    assert block(shown, "RESOURCE")[0].split()[-1] == "AVAILABLE"
    assert block(shown, "CLAIM")[0].split()[-1] == "SETTLED"
    assert "window" not in shown


def test_a_window_length_is_shown_in_its_largest_whole_unit() -> None:
    assert [duration(s) for s in (20, 60, 90, 3600, 5400, 86400)] == [
        "20s",
        "1m",
        "90s",
        "1h",
        "90m",
        "1d",
    ]


# --- the pool -----------------------------------------------------------------------------


def pool_object() -> dict[str, Any]:
    status = ReservationPoolStatus(
        totals=totals(
            {"tokens": "1M", "cost": "100"},
            committed={"tokens": "12k", "cost": "1"},
            reserved={"tokens": "100k", "cost": "10"},
        ),
        children={  # planner holds its line; old's settlement is in flight
            "uid-old": ChildEntry(
                envelope="old",
                namespace="team-b",
                phase=ChildPhase.SETTLED,
                reserved=q({"tokens": "50k", "cost": "5"}),
                consumed=q({"tokens": "12k", "cost": "1"}),
                released=q({"tokens": "38k", "cost": "4"}),
                reason="Closed",
            ),
        },
        counts={"Pending": 1, "Reserved": 1, "Settled": 1},
    )
    return {
        "metadata": {"name": "tenant-a", "uid": "uid-tenant-a"},
        "spec": {"capacity": {"tokens": "1M", "cost": "100"}, "namespaces": ["team-a", "team-b"]},
        "status": status.to_api(),
    }


async def test_a_pool_shows_its_totals_and_each_envelopes_line() -> None:
    """Lines in flight on the pool, and those its envelopes hold (listed by namespace)."""
    planner = envelope("planner", ReservationEnvelopeStatus())
    planner["status"] = ReservationEnvelopeStatus(
        phase=EnvelopePhase.OPEN,
        parent=ParentRecord(
            kind=ParentKind.POOL,
            name="tenant-a",
            uid="uid-tenant-a",
            admitted_at=T0,
            reserved=q({"tokens": "100k", "cost": "10"}),
        ),
    ).to_api()
    pool = await sdk_over(FakeClient([planner], pools=[pool_object()])).pool("tenant-a")
    shown = show_pool(pool)
    lines = shown.split("\n")
    assert lines[0] == "pool tenant-a: namespaces team-a, team-b; 1 envelope(s) waiting"
    rows = words(lines)
    assert rows["tokens"][1:] == ["Consumable", "1000000", "12000", "100000", "0", "888000"]
    assert rows["team-a/planner"][1:] == ["Reserved", "cost=10", "tokens=100000", "-", "-", "-"]
    assert rows["team-b/old"][1:] == [
        "Settled",
        "cost=5",
        "tokens=50000",
        "cost=1",
        "tokens=12000",
        "cost=4",
        "tokens=38000",
        "Closed",
    ]
    assert lines.index(block(shown, "ENVELOPE")[1]) < lines.index(block(shown, "ENVELOPE")[2])


def test_a_pool_shows_its_contracts_and_peak() -> None:
    obj = pool_object()
    obj["spec"]["capacity"]["nvidia.com/gpu"] = "16"
    status = ReservationPoolStatus.model_validate(obj["status"])
    status.totals = totals({"tokens": "1M", "cost": "100", "nvidia.com/gpu": "16"})
    status.contracts = {"nvidia.com/gpu": ContractType.REUSABLE}  # cost, tokens: defaults
    status.peak = q({"nvidia.com/gpu": "12"})
    obj["status"] = status.to_api()
    pool = PoolView.from_api(obj)
    assert pool.contracts["tokens"] is ContractType.CONSUMABLE
    rows = words(show_pool(pool).split("\n"))
    assert rows["nvidia.com/gpu"][1:] == ["Reusable", "16", "0", "0", "0", "16", "12"]
    assert rows["tokens"][1:] == ["Consumable", "1000000", "0", "0", "0", "1000000", "-"]


def test_a_pool_shows_each_namespaces_fair_share_first_in_line_first() -> None:
    obj = pool_object()
    status = ReservationPoolStatus.model_validate(obj["status"])
    status.shares = {
        "team-a": NamespaceUsage(held=q({"tokens": "500k"}), share="0.5000", open=2),
        "team-b": NamespaceUsage(held=q({"tokens": "100k"}), share="0.0500", weight=2,
                                 open=1, waiting=3),
    }  # fmt: skip
    obj["status"] = status.to_api()
    lines = show_pool(PoolView.from_api(obj)).split("\n")
    start = lines.index("fair share (lowest weighted dominant share goes first):")
    assert [line.split() for line in lines[start + 1 :]] == [
        ["NAMESPACE", "WEIGHT", "SHARE", "HELD", "OPEN", "WAITING"],
        ["team-b", "2", "0.0500", "tokens=100000", "1", "3"],
        ["team-a", "1", "0.5000", "tokens=500000", "2", "0"],
    ]


def test_an_empty_pool_says_so() -> None:
    pool = PoolView(name="p", status=ReservationPoolStatus(), namespaces=("n",))
    assert show_pool(pool) == (
        "pool p: namespaces n\n(no totals recorded yet)\n\n(no envelopes in the pool's ledger)"
    )


# --- the verbs ----------------------------------------------------------------------------


class SyncOver:
    """The synchronous SDK's tree and pool, over the fake client."""

    def __init__(self, client: FakeClient) -> None:
        self.sdk = sdk_over(client)

    def tree(self, envelope: str) -> EnvelopeTree:
        return asyncio.run(self.sdk.tree(envelope))

    def pool(self, name: str) -> PoolView:
        return asyncio.run(self.sdk.pool(name))


def test_the_ledger_and_pool_verbs_print_the_tree_and_the_pool() -> None:
    fake = SyncOver(FakeClient(two_levels(), pools=[pool_object()]))
    ledger = run(parser().parse_args(["ledger", "planner"]), fake)  # type: ignore[arg-type]
    assert "  envelope team-a/search: Open, drawn from ReservationEnvelope planner" in ledger
    pool = run(parser().parse_args(["pool", "tenant-a"]), fake)  # type: ignore[arg-type]
    assert pool.startswith("pool tenant-a: namespaces team-a, team-b")


async def test_a_line_kept_for_children_removed_by_hand_says_how_to_settle_it() -> None:
    objects = two_levels()
    lost = reserved_line("lost-children-7", {"tokens": "5k"}).to_api()
    objects[0]["status"]["children"]["lost-children-7"] = lost
    shown = show_ledger(await tree_of("planner", objects))
    (line,) = [x for x in shown.split("\n") if x.strip().startswith("lost-children-7:")]
    assert "child envelopes removed by hand" in line
    assert "reservoir.dev/force-settle-gone" in line


def test_a_pool_shows_whom_it_asked_to_give_their_room() -> None:
    obj = pool_object()
    status = ReservationPoolStatus.model_validate(obj["status"])
    status.preemptions = {
        "uid-1": PreemptionRequest(
            envelope="explore",
            namespace="team-a",
            preemptor="team-b/incident",
            preemptor_uid="uid-2",
            priority_class="urgent",
            requested_at=T0,
        )
    }
    obj["status"] = status.to_api()
    lines = show_pool(PoolView.from_api(obj)).split("\n")
    start = lines.index("asked to give their room (preemption of tentative holds, undecided):")
    assert [line.split() for line in lines[start + 1 :]] == [
        ["ENVELOPE", "FOR", "CLASS", "ASKED"],
        ["team-a/explore", "team-b/incident", "urgent", T0.strftime("%Y-%m-%dT%H:%M:%SZ")],
    ]
