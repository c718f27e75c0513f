"""`kubectl reservoir result` and `history`, the SDK's `result()` / `history()` and its
idempotent `hold(name=...)`, without a cluster.

Records are built from the models; the SDK runs over a fake lightkube client that answers
`create`, `get` and nothing else, as the API server would (409 AlreadyExists, 404)."""

from __future__ import annotations

import asyncio
from collections.abc import AsyncIterator, Mapping
from datetime import UTC, datetime, timedelta, timezone
from decimal import Decimal
from typing import Any

import pytest
from lightkube import ApiError
from lightkube.models.meta_v1 import Status

from reservoir.cli.plugin import (
    adjustment_line,
    history_lines,
    history_table,
    parser,
    retry_line,
    run,
    show_history,
    show_result,
)
from reservoir.core.model import (
    Adjustment,
    BranchClaimSpec,
    BranchClaimStatus,
    ClaimPhase,
    LedgerEntry,
    Outcome,
    ReservationEnvelopeStatus,
    RetryHold,
    Settlement,
    Transition,
    Trigger,
)
from reservoir.core.quantity import parse_resources
from reservoir.k8s.resources import BranchClaim, ReservationEnvelope
from reservoir.sdk import (
    AsyncReservoir,
    ClaimExistsError,
    ClaimNotFoundError,
    ClaimView,
    ReservoirError,
    ResultView,
)
from reservoir.sdk.client import spec_differences

NS = "team-a"
T0 = datetime(2025, 1, 1, 12, 0, tzinfo=UTC)
HEADER = ["TIME", "FROM → TO", "REASON", "TRIGGER", "LEASE-GEN", "AMOUNTS"]


def q(values: Mapping[str, str]) -> dict[str, Decimal]:
    return parse_resources(values)


def move(
    old: ClaimPhase, new: ClaimPhase, reason: str, trigger: Trigger, minute: int, gen: int
) -> Transition:
    return Transition.model_validate(
        {
            "from": old,
            "to": new,
            "reason": reason,
            "trigger": trigger,
            "at": T0 + timedelta(minutes=minute),
            "leaseGeneration": gen,
        }
    )


RESERVED = move(ClaimPhase.PENDING, ClaimPhase.TENTATIVE, "Reserved", Trigger.ADMISSION, 0, 1)
COMMITTED = move(
    ClaimPhase.TENTATIVE, ClaimPhase.COMMITTED, "CommitPointReached", Trigger.WORKER, 1, 1
)
COMPLETED = move(ClaimPhase.COMMITTED, ClaimPhase.CONSUMED, "Completed", Trigger.WORKER, 3, 2)


def consumed_status(**extra: Any) -> BranchClaimStatus:
    """R = tokens 20k cost 2; C = tokens 12k cost 0.5; R − C = tokens 8k cost 1.5."""
    return BranchClaimStatus(
        phase=ClaimPhase.CONSUMED,
        reserved=q({"tokens": "20k", "cost": "2"}),
        consumed=q({"tokens": "12k", "cost": "0.5"}),
        released=q({"tokens": "8k", "cost": "1.5"}),
        settlement=Settlement(
            key="uid-x/1/1",
            phase=ClaimPhase.CONSUMED,
            reason="Completed",
            outcome=Outcome.SUCCEEDED,
            at=T0 + timedelta(minutes=3),
        ),
        result="s3://bucket/out",
        history=[RESERVED, COMMITTED, COMPLETED],
        **extra,
    )


def rows(table: str) -> list[dict[str, str]]:
    """The table's rows by header, cut at the header's column starts (cells hold spaces)."""
    header, *lines = table.split("\n")
    starts = [header.index(name) for name in HEADER]
    ends = [*starts[1:], None]
    return [
        {name: line[a:b].strip() for name, a, b in zip(HEADER, starts, ends, strict=True)}
        for line in lines
    ]


def view_of(
    status: BranchClaimStatus, entry: LedgerEntry | None = None, name: str = "x"
) -> ClaimView:
    return ClaimView(
        name=name,
        namespace=NS,
        uid=f"uid-{name}",
        resource_version="1",
        spec=BranchClaimSpec(envelope="wf", branch=name, requests=status.reserved or {"x": 1}),
        status=status,
        entry=entry,
        ledger_read=True,
    )


# --- the history table ---------------------------------------------------------------------


def test_the_history_table_shows_r_when_reserved_and_c_and_r_minus_c_when_settled() -> None:
    table = history_table(consumed_status())
    assert table.split("\n")[0].split("  ")[0] == "TIME"
    assert rows(table) == [
        {
            "TIME": "2025-01-01T12:00:00Z",
            "FROM → TO": "Pending → Tentative",
            "REASON": "Reserved",
            "TRIGGER": "Admission",
            "LEASE-GEN": "1",
            "AMOUNTS": "R cost=2 tokens=20000",
        },
        {
            "TIME": "2025-01-01T12:01:00Z",
            "FROM → TO": "Tentative → Committed",
            "REASON": "CommitPointReached",
            "TRIGGER": "Worker",
            "LEASE-GEN": "1",
            "AMOUNTS": "-",
        },
        {
            "TIME": "2025-01-01T12:03:00Z",
            "FROM → TO": "Committed → Consumed",
            "REASON": "Completed",
            "TRIGGER": "Worker",
            "LEASE-GEN": "2",
            "AMOUNTS": "C cost=0.5 tokens=12000, R−C cost=1.5 tokens=8000",
        },
    ]


def test_times_are_shown_in_utc_whatever_zone_they_were_read_in() -> None:
    east = timezone(timedelta(hours=2))
    status = consumed_status()
    status.history = [RESERVED.model_copy(update={"at": T0.astimezone(east)})]
    assert rows(history_table(status))[0]["TIME"] == "2025-01-01T12:00:00Z"


@pytest.mark.parametrize(
    ("phase", "reason", "trigger"),
    [
        (ClaimPhase.EXPIRED, "LeaseExpired", Trigger.CLOCK),
        (ClaimPhase.RELEASED, "Cancelled", Trigger.WORKER),
    ],
)
def test_a_claim_that_never_ran_returns_all_of_r_on_its_last_move(
    phase: ClaimPhase, reason: str, trigger: Trigger
) -> None:
    status = BranchClaimStatus(
        phase=phase,
        reserved=q({"tokens": "20k"}),
        released=q({"tokens": "20k"}),
        history=[RESERVED, move(ClaimPhase.TENTATIVE, phase, reason, trigger, 2, 1)],
    )
    last = rows(history_table(status))[-1]
    assert last["FROM → TO"] == f"Tentative → {phase.value}"
    assert (last["REASON"], last["TRIGGER"]) == (reason, trigger.value)
    assert last["AMOUNTS"] == "C -, R−C tokens=20000"


def test_a_claim_reserved_and_committed_in_one_move_shows_r_on_it() -> None:
    status = BranchClaimStatus(
        phase=ClaimPhase.COMMITTED,
        reserved=q({"tokens": "30"}),
        history=[
            move(ClaimPhase.PENDING, ClaimPhase.COMMITTED, "Reserved", Trigger.ADMISSION, 0, 1)
        ],
    )
    assert rows(history_table(status))[0]["AMOUNTS"] == "R tokens=30"


def test_moves_between_holding_phases_show_no_amounts() -> None:
    status = BranchClaimStatus(
        phase=ClaimPhase.DETACHED,
        reserved=q({"tokens": "30"}),
        history=[
            RESERVED,
            COMMITTED,
            move(ClaimPhase.COMMITTED, ClaimPhase.RUNNING, "ExecutionStarted", Trigger.POD, 2, 1),
            move(ClaimPhase.RUNNING, ClaimPhase.DETACHED, "LeaseLapsed", Trigger.CLOCK, 5, 1),
        ],
    )
    assert [row["AMOUNTS"] for row in rows(history_table(status))] == [
        "R tokens=30",
        "-",
        "-",
        "-",
    ]


def test_a_claim_without_recorded_moves_says_so() -> None:
    assert history_table(BranchClaimStatus()) == "(no transitions recorded)"


# --- adjustment and retry ------------------------------------------------------------------


def test_an_applied_adjustment_says_what_it_returned() -> None:
    line = adjustment_line(
        Adjustment(returned=q({"tokens": "5k"}), applied=True, outcome=Outcome.SUCCEEDED, at=T0)
    )
    assert line == (
        "adjustment at 2025-01-01T12:00:00Z (late report, outcome Succeeded): "
        "returned tokens=5000; applied"
    )


def test_an_adjustment_recorded_only_says_it_moved_nothing() -> None:
    line = adjustment_line(Adjustment(charged=q({"tokens": "3"}), applied=False, at=T0))
    assert "charged tokens=3" in line and "returned" not in line
    assert line.endswith("; recorded only (not applied to the envelope)")
    assert "applied;" not in line and "outcome" not in line


def test_a_retry_hold_says_until_when_and_what_became_of_it() -> None:
    until = T0 + timedelta(minutes=10)
    held = RetryHold(resources=q({"tokens": "8k"}), until=until)
    assert retry_line(held) == (
        "retry: tokens=8000 held for the next attempt until 2025-01-01T12:10:00Z"
    )
    taken = retry_line(held.model_copy(update={"taken_by": "x-2"}))
    assert taken.endswith("; taken by x-2")
    returned = retry_line(held.model_copy(update={"returned": True}))
    assert returned.endswith("; returned to the envelope (window closed)")


def test_the_history_adds_the_adjustment_and_retry_lines_only_when_recorded() -> None:
    plain = history_lines("team-a/x", consumed_status())
    assert plain[0] == "branchclaim team-a/x: Consumed"
    assert len(plain) == 2 and not any(line.startswith(("adjustment", "retry")) for line in plain)
    both = history_lines(
        "team-a/x",
        consumed_status(
            adjustment=Adjustment(returned=q({"tokens": "1"}), applied=True, at=T0),
            retry=RetryHold(resources=q({"tokens": "8k"}), until=T0),
        ),
    )
    assert both[2].startswith("adjustment at ") and both[3].startswith("retry: tokens=8000")


def test_show_history_reads_the_ledger_entry_before_the_status_mirror() -> None:
    status = consumed_status()
    status.history = [RESERVED]  # the mirror lags
    entry = LedgerEntry(
        claim="x",
        phase=ClaimPhase.CONSUMED,
        reserved=status.reserved,
        consumed=status.consumed,
        released=status.released,
        history=[RESERVED, COMMITTED, COMPLETED],
    )
    assert len(show_history(view_of(status, entry)).split("\n")) == 2 + 3  # header, title, rows
    assert len(show_history(view_of(status)).split("\n")) == 2 + 1


# --- the result view -----------------------------------------------------------------------


def test_a_settled_claim_shows_its_outcome_result_and_c_and_r_minus_c() -> None:
    shown = show_result(ResultView.of(view_of(consumed_status())))
    assert shown.split("\n") == [
        "branchclaim team-a/x: Consumed (Completed, settled 2025-01-01T12:03:00Z)",
        "outcome: Succeeded",
        "result:  s3://bucket/out",
        "amounts: C cost=0.5 tokens=12000, R−C cost=1.5 tokens=8000",
    ]


def test_a_settled_reusable_claim_shows_its_occupancy_and_all_of_r_returned() -> None:
    status = BranchClaimStatus(
        phase=ClaimPhase.CONSUMED,
        reserved=q({"nvidia.com/gpu": "8", "tokens": "20k"}),
        consumed=q({"tokens": "12k"}),
        released=q({"nvidia.com/gpu": "8", "tokens": "8k"}),
        occupancy=q({"nvidia.com/gpu": "480"}),
        settlement=Settlement(key="k", phase=ClaimPhase.CONSUMED, reason="Completed", at=T0),
    )
    result = ResultView.of(view_of(status))
    assert result.occupancy == {"nvidia.com/gpu": 480}
    assert show_result(result).split("\n")[3:] == [
        "amounts: C tokens=12000, R−C nvidia.com/gpu=8 tokens=8000",
        "occupancy: nvidia.com/gpu=480 (R × seconds held; returned in full, not charged)",
    ]
    assert "occupancy" not in show_result(ResultView.of(view_of(consumed_status())))


def test_a_claim_not_settled_yet_says_so_and_shows_only_r() -> None:
    status = BranchClaimStatus(phase=ClaimPhase.RUNNING, reserved=q({"tokens": "30"}))
    result = ResultView.of(view_of(status))
    assert not result.settled and result.outcome is None and result.result is None
    shown = show_result(result).split("\n")
    assert shown[0] == "branchclaim team-a/x: Running (not settled yet)"
    assert shown[1:] == [
        "outcome: - (not settled yet)",
        "result:  - (none recorded)",
        "amounts: R tokens=30 held, nothing settled yet",
    ]


def test_the_result_comes_from_the_ledger_entry_while_there_is_one() -> None:
    status = BranchClaimStatus(phase=ClaimPhase.COMMITTED, reserved=q({"tokens": "30"}))
    entry = LedgerEntry(
        claim="x",
        phase=ClaimPhase.CONSUMED,
        reserved=q({"tokens": "30"}),
        consumed=q({"tokens": "10"}),
        released=q({"tokens": "20"}),
        result="s3://bucket/new",
        settlement=Settlement(
            key="k", phase=ClaimPhase.CONSUMED, reason="Completed", outcome=Outcome.FAILED, at=T0
        ),
    )
    result = ResultView.of(view_of(status, entry))
    assert (result.phase, result.outcome, result.result) == (
        ClaimPhase.CONSUMED,
        Outcome.FAILED,
        "s3://bucket/new",
    )
    assert result.consumed == q({"tokens": "10"}) and result.released == q({"tokens": "20"})
    assert result.settled_at == T0 and result.reason == "Completed"


# --- the SDK over a fake API server --------------------------------------------------------


def api_error(code: int, reason: str) -> ApiError:
    return ApiError(status=Status(code=code, reason=reason, message=f"{reason} (fake)"))


class FakeClient:
    """Claims and envelopes by name; `create` refuses a name that exists."""

    namespace = NS

    def __init__(self, *objects: tuple[Any, dict[str, Any]]) -> None:
        self.objects: dict[tuple[Any, str], dict[str, Any]] = {
            (kind, obj["metadata"]["name"]): obj for kind, obj in objects
        }
        self.created: list[dict[str, Any]] = []
        self.gone_once: set[str] = set()  # names that vanish right after a 409

    async def create(self, obj: Any) -> dict[str, Any]:
        body: dict[str, Any] = obj.to_dict()
        name = body["metadata"]["name"]
        if (BranchClaim, name) in self.objects:
            if name in self.gone_once:
                self.gone_once.discard(name)
                del self.objects[(BranchClaim, name)]
            raise api_error(409, "AlreadyExists")
        body["metadata"] |= {"uid": f"uid-new-{len(self.created)}", "resourceVersion": "1"}
        self.created.append(body)
        self.objects[(BranchClaim, name)] = body
        return body

    async def list(
        self, kind: Any, namespace: str | None = None, fields: dict[str, str] | None = None
    ) -> AsyncIterator[dict[str, Any]]:
        """Objects by `metadata.name` (the SDK's fresh reads), or claims by
        `spec.upstream.requestId` (the value unescaped as the API server does)."""
        if "metadata.name" in (fields or {}):
            found = self.objects.get((kind, (fields or {})["metadata.name"]))
            if found is not None:
                yield found
            return
        wanted = (fields or {}).get("spec.upstream.requestId", "")
        wanted = wanted.replace("\\=", "=").replace("\\,", ",").replace("\\\\", "\\")
        for (stored_kind, _), obj in list(self.objects.items()):
            upstream = (obj.get("spec") or {}).get("upstream") or {}
            if stored_kind is kind and upstream.get("requestId") == wanted:
                yield obj

    async def get(self, kind: Any, name: str, namespace: str | None = None) -> dict[str, Any]:
        try:
            return self.objects[(kind, name)]
        except KeyError:
            raise api_error(404, "NotFound") from None

    async def close(self) -> None:
        pass


def claim_object(
    name: str, spec: BranchClaimSpec, status: BranchClaimStatus | None = None, **meta: Any
) -> tuple[Any, dict[str, Any]]:
    body = {
        "metadata": {"name": name, "namespace": NS, "uid": "uid-old", "resourceVersion": "7"}
        | meta,
        "spec": spec.to_api(),
        "status": (status or BranchClaimStatus()).to_api(),
    }
    return BranchClaim, body


def envelope_object(entries: dict[str, LedgerEntry]) -> tuple[Any, dict[str, Any]]:
    status = ReservationEnvelopeStatus(entries=entries)
    body = {
        "metadata": {"name": "wf", "namespace": NS, "uid": "uid-wf", "resourceVersion": "1"},
        "spec": {"capacity": {"tokens": "100k"}},
        "status": status.to_api(),
    }
    return ReservationEnvelope, body


def held_spec(**changes: Any) -> BranchClaimSpec:
    """What `hold("wf", "search", {"tokens": "20k"}, name="x", request_id="req-1")` by the
    holder "me" creates."""
    fields: dict[str, Any] = {
        "envelope": "wf",
        "branch": "search",
        "requests": {"tokens": "20000"},
        "lease": {"holder": "me"},
        "upstream": {"requestId": "req-1"},
    }
    return BranchClaimSpec.model_validate(fields | changes)


def sdk_over(client: FakeClient) -> AsyncReservoir:
    return AsyncReservoir(namespace=NS, holder="me", client=client)  # type: ignore[arg-type]


def hold(client: FakeClient, **options: Any) -> ClaimView:
    options = {"name": "x", "request_id": "req-1"} | options
    return asyncio.run(sdk_over(client).hold("wf", "search", {"tokens": "20k"}, **options))


def test_hold_sets_the_request_id_on_the_claim_it_creates() -> None:
    client = FakeClient()
    view = hold(client)
    assert view.spec.upstream.request_id == "req-1"
    assert client.created[0]["spec"]["upstream"] == {
        "requestId": "req-1",
        "supportsCancel": False,
        "supportsStatus": False,
    }


def test_holding_again_by_name_returns_the_existing_claim_as_it_is_now() -> None:
    existing = held_spec(dispatch=True, usage={"tokens": "5"})  # moved on since: still it
    client = FakeClient(claim_object("x", existing))
    view = hold(client)
    assert view.uid == "uid-old" and view.resource_version == "7"
    assert view.spec.usage == q({"tokens": "5"})
    assert client.created == []


@pytest.mark.parametrize(
    ("existing", "options", "named"),
    [
        (held_spec(requests={"tokens": "10"}), {}, "spec.requests"),
        (held_spec(lease={"holder": "someone-else"}), {}, "spec.lease.holder"),
        (held_spec(upstream={"requestId": "req-2"}), {}, "spec.upstream.requestId"),
        (held_spec(upstream={}), {}, "spec.upstream.requestId"),
        (held_spec(attempt=2), {}, "spec.attempt"),
        (held_spec(), {"priority": 5}, "spec.priority"),
        (held_spec(), {"dispatch": True}, "spec.dispatch"),
        (held_spec(), {"retry_window_seconds": 60}, "spec.retryWindowSeconds"),
        (held_spec(), {"placement": {"nodeSelector": {"gpu": "h100"}}}, "spec.placement"),
        (held_spec(), {"lease_seconds": 30}, "spec.lease.durationSeconds"),
    ],
)
def test_holding_by_name_over_another_claim_raises_naming_what_differs(
    existing: BranchClaimSpec, options: dict[str, Any], named: str
) -> None:
    client = FakeClient(claim_object("x", existing))
    with pytest.raises(ClaimExistsError, match="already exists") as raised:
        hold(client, **options)
    assert raised.value.differences == (named,)
    assert raised.value.name == "x"
    assert named in str(raised.value)
    assert client.created == []


def test_a_claim_being_deleted_is_not_returned_by_a_hold() -> None:
    client = FakeClient(claim_object("x", held_spec(), deletionTimestamp="2025-01-01T12:00:00Z"))
    with pytest.raises(ClaimExistsError, match="being deleted"):
        hold(client)


def test_a_claim_deleted_between_the_409_and_the_read_is_created_again() -> None:
    client = FakeClient(claim_object("x", held_spec(requests={"tokens": "1"})))
    client.gone_once.add("x")
    view = hold(client)
    assert view.uid == "uid-new-0" and view.spec.requests == q({"tokens": "20k"})


def test_a_hold_without_a_name_is_not_made_idempotent() -> None:
    client = FakeClient()

    async def refuse(obj: Any) -> dict[str, Any]:
        raise api_error(409, "AlreadyExists")

    client.create = refuse  # type: ignore[method-assign]
    with pytest.raises(ApiError):
        hold(client, name=None)


def test_spec_differences_compare_requests_as_quantities_and_facts_forward_only() -> None:
    assert spec_differences(held_spec(), held_spec(requests={"tokens": "2e4"})) == []
    assert spec_differences(held_spec(), held_spec(placement={})) == []
    # A claim dispatched, or further upstream, since is still the one asked for...
    assert spec_differences(held_spec(), held_spec(dispatch=True)) == []
    submitted = {"requestId": "req-1", "state": "Submitted"}
    running = {"requestId": "req-1", "state": "Running"}
    assert spec_differences(held_spec(upstream=submitted), held_spec(upstream=running)) == []
    # ...but one behind what the hold asks is not.
    assert [
        d.split(" ")[0]
        for d in spec_differences(held_spec(upstream=running), held_spec(upstream=submitted))
    ] == ["spec.upstream.state"]
    named = spec_differences(held_spec(), held_spec(requests={"tokens": "20001"}))
    assert named == ["spec.requests (tokens=20000 asked, tokens=20001 on the claim)"]


def test_result_and_history_read_the_record_by_name_and_refuse_a_missing_claim() -> None:
    compacted = claim_object("x", held_spec(), consumed_status())  # no ledger entry left
    client = FakeClient(compacted, envelope_object({}))
    sdk = sdk_over(client)
    result = asyncio.run(sdk.result("x"))
    assert (result.phase, result.outcome, result.result) == (
        ClaimPhase.CONSUMED,
        Outcome.SUCCEEDED,
        "s3://bucket/out",
    )
    assert asyncio.run(sdk.history("x")) == [RESERVED, COMMITTED, COMPLETED]
    with pytest.raises(ClaimNotFoundError, match="branchclaim/nope not found"):
        asyncio.run(sdk.result("nope"))
    with pytest.raises(ClaimNotFoundError):
        asyncio.run(sdk.history("nope"))


# --- the verbs -----------------------------------------------------------------------------


def test_result_and_history_take_the_namespace_before_or_after_the_verb() -> None:
    args = parser().parse_args(["result", "x", "-n", "other"])
    assert (args.verb, args.claim, args.namespace) == ("result", "x", "other")
    args = parser().parse_args(["-n", "team-b", "history", "x"])
    assert (args.verb, args.claim, args.namespace) == ("history", "x", "team-b")
    args = parser().parse_args(["finish", "x", "tokens=1", "--result", "s3://b/o"])
    assert args.result == "s3://b/o"


def test_the_result_and_history_verbs_print_the_claim() -> None:
    client = FakeClient(claim_object("x", held_spec(), consumed_status()), envelope_object({}))

    class Sync:
        def __init__(self) -> None:
            self.sdk = sdk_over(client)

        def result(self, name: str) -> ResultView:
            return asyncio.run(self.sdk.result(name))

        def get(self, name: str) -> ClaimView:
            return asyncio.run(self.sdk.get(name))

    shown = run(parser().parse_args(["result", "x"]), Sync())  # type: ignore[arg-type]
    assert "result:  s3://bucket/out" in shown.split("\n")
    history = run(parser().parse_args(["history", "x"]), Sync())  # type: ignore[arg-type]
    lines = history.split("\n")
    assert lines[0] == "branchclaim team-a/x: Consumed"
    assert [row["REASON"] for row in rows("\n".join(lines[1:]))] == [
        "Reserved",
        "CommitPointReached",
        "Completed",
    ]


# --- found by review -----------------------------------------------------------------------


def test_an_adjustment_row_shows_what_moved_not_the_settlement_again() -> None:
    adjusted = move(
        ClaimPhase.CONSUMED, ClaimPhase.CONSUMED, "LateCompletionAdjusted", Trigger.WORKER, 9, 2
    )
    status = consumed_status(
        adjustment=Adjustment(returned=q({"tokens": "5k"}), applied=True, at=T0),
    )
    status.history.append(adjusted)
    table = rows(history_table(status))
    assert table[-2]["AMOUNTS"] == "C cost=0.5 tokens=12000, R−C cost=1.5 tokens=8000"
    assert table[-1]["AMOUNTS"] == "returned tokens=5000"


def test_the_result_shows_an_adjustment_and_a_retry_hold() -> None:
    status = consumed_status(
        adjustment=Adjustment(
            returned=q({"tokens": "5k"}), applied=True, outcome=Outcome.SUCCEEDED, at=T0
        ),
        retry=RetryHold(resources=q({"tokens": "8k"}), until=T0 + timedelta(minutes=10)),
    )
    view = ResultView.of(view_of(status))
    assert view.adjustment is not None and view.retry is not None
    lines = show_result(view).split("\n")
    assert lines[4].startswith("adjustment at ") and "returned tokens=5000; applied" in lines[4]
    assert lines[5] == "retry: tokens=8000 held for the next attempt until 2025-01-01T12:10:00Z"


def test_a_ref_with_its_kinds_default_api_version_spelled_out_is_the_same_ref() -> None:
    stored = held_spec(upstream={"ref": {"name": "job1"}})
    asked = held_spec(upstream={"ref": {"name": "job1", "kind": "Job", "apiVersion": "batch/v1"}})
    assert spec_differences(asked, stored) == []
    other = held_spec(upstream={"ref": {"name": "job2"}})
    assert [d.split(" ")[0] for d in spec_differences(other, stored)] == ["spec.upstream.ref"]


# --- terminal escapes (issue 21) -----------------------------------------------------------


def test_control_characters_in_a_result_or_reason_are_shown_not_sent_to_the_terminal() -> None:
    """A result reference and a settlement reason come from a worker, a provider or a Job:
    an escape sequence in one must not reach the terminal, nor a newline forge a line."""
    status = consumed_status()
    status.result = "s3://b/out\x1b]0;owned\x07\x1b[2J\nresult:  s3://forged\u202e"
    assert status.settlement is not None
    status.settlement.reason = "Completed\x1b[1A\r"
    shown = show_result(ResultView.of(view_of(status)))
    assert "\x1b" not in shown and "\x07" not in shown and "\r" not in shown
    assert "\u202e" not in shown
    lines = shown.split("\n")
    assert len(lines) == 4
    assert lines[0].startswith("branchclaim team-a/x: Consumed (Completed\\x1b[1A\\r, settled")
    assert lines[2] == (
        "result:  s3://b/out\\x1b]0;owned\\x07\\x1b[2J\\nresult:  s3://forged\\u202e"
    )


def test_the_plugin_prints_no_control_character_whatever_the_verb_shows(
    monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]
) -> None:
    """The last line of defence: whatever a view lays out, control characters in it are
    escaped on the way out, its own newlines kept; an error message is escaped too."""
    from reservoir.cli import plugin

    class Sdk:
        def __init__(self, **_: Any) -> None:
            pass

        def __enter__(self) -> Sdk:
            return self

        def __exit__(self, *_: object) -> None:
            pass

    monkeypatch.setattr(plugin, "Reservoir", Sdk)
    monkeypatch.setattr(plugin, "run", lambda *_: "line one\x1b[31m\nline two\x9b")
    assert plugin.main(["result", "x"]) == 0
    assert capsys.readouterr().out == "line one\\x1b[31m\nline two\\x9b\n"

    def refuse(*_: object) -> str:
        raise ReservoirError("no claim 'x\x1b[2J'")

    monkeypatch.setattr(plugin, "run", refuse)
    assert plugin.main(["result", "x"]) == 1
    assert capsys.readouterr().err == "error: no claim 'x\\x1b[2J'\n"
