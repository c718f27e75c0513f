"""The Reservoir SDK for orchestrators and workers.

A claim's authoritative record is its line of the ledger. The SDK reads it from the claim
itself: `status.ledger` when the operator writes the line there, else the claim's status,
which mirrors the line (and carries it once a settled line was compacted away). A verb
reads nothing but the claim, and the claim at most once.

Every write is one JSON patch to the claim (reservoir.sdk.patches) whose `test`
operations carry the verb's preconditions on the claim object: its UID, its
`metadata.generation` (which moves with every spec write and with the deletion: not
cancelled, not deleting, the same holder, the same report as checked) and, in the record,
the fields the decision read (the phase, no settlement, the lease's end). The operator's
other status writes do not refuse it. The API server applies the whole patch to the whole
object, status included, before it keeps only the spec: a test that fails answers 422 and
nothing is written. A verb decides first on the caller's view, without reading: only a
decision to write is taken on it, so a stale view costs a refused patch, never a wrong
write. A refused patch, and a decision not to write (an error, or "already done"), make the
SDK read the claim again and decide on it as it is now: the caller gets an error instead
of a silent success only when the claim as it is now says so, and the error says why. The
checks:

- every verb: the same claim as the caller's view (UID and attempt), not settled;
- `dispatch`: not cancelled, not being deleted, the claim's `spec.lease.holder` (when set)
  is this SDK's holder, the claim holds capacity (phase Tentative; Committed or Running was
  already dispatched and returns without a write; Pending raises `NotReservedError`,
  Detached `StaleClaimError`), and the lease does not end within `LEASE_SAFETY_MARGIN`
  (else `LeaseUncertainError`);
- `cancel`: a claim already cancelled, or being deleted (deletion cancels it), returns
  without a write;
- `report_usage`, `finish`: nothing more, save that a claim deleted before it was
  dispatched never ran and takes no usage. Usage and a final report are facts, accepted
  from whoever knows them (a reconciler finishing a Detached claim after its worker died)
  and on a dispatched claim being deleted, which waits for exactly that report.

The envelope is not read by the verbs (`hold` reads it once, for its owner reference).
What concerns the envelope is the operator's to refuse: it treats every claim of a deleting
envelope as deleted (a Tentative one is released on its next pass, and the phase test then
refuses a dispatch), extends no lease of a closed, expired or deleting envelope (`renew`
then goes unconfirmed), and records a dispatch that reaches a settled claim as refused
(condition DispatchRefused), never as work started.

A write the API server refuses as invalid (usage that decreases; dispatching a cancelled
branch or a claim being deleted) raises `ReservoirError` (`StaleClaimError` for `dispatch`)
with its message.

The SDK acts as one lease holder: `holder=`, else `$RESERVOIR_HOLDER`, else host/pid. `hold`
names it in `spec.lease.holder`, and only that holder may dispatch or renew the claim.

`hold(name=...)` is idempotent: a claim of that name that is the one the call would create
(same envelope, branch, attempt, requests, holder, upstream ids, ...) is returned instead of
failing, so a client that lost the answer may simply hold again; any other claim of that
name raises `ClaimExistsError`. A claim's outcome outlives its worker: `finish(...,
result=URI)` records a result reference, and `result(name)` and `history(name)` read what
became of the claim and how, from its record (ledger entry, else status), by name only.

`compensate` is for after settlement (a refund, the void of an external authorization, a
follow-up charge): it appends to `spec.compensations` with a JSON patch that tests the
claim's UID, generation and the list as read (in the caller's view, else in the claim read
once), and is idempotent by its key (by default a hash of amount, reason and reference).
The operator applies each once (reservoir.core.compensation).

`renew` writes no claim: it reads the claim, then heartbeats the claim's
`coordination.k8s.io/v1` Lease, only for the claim the caller's view names (same UID and
attempt), only when the claim names no other holder and is not cancelled, deleting, settled
or Detached, and never taking over a Lease another holder holds. The Lease write is
conditional on the Lease's resourceVersion. It then waits for the operator, the authority,
to grant the renewal (which it refuses for an envelope that admits no more work).

`wait` (and `renew`'s wait for the grant) follows the claim through a watch, not by
polling: an `AsyncReservoir` runs one watch of its namespace's claims, started by the first
wait and stopped by `close()`, shared by all its waits (`reservoir.sdk.watch`). `Reservoir`,
which runs an event loop only during a call, opens a watch of the one claim for each wait.

`hold` creates the claim with what the operator would otherwise add to it: the claim
finalizer (`CLAIM_FINALIZER`), and an owner reference to its envelope (when it exists).

    async with AsyncReservoir(namespace="team-a") as reservoir:
        claim = await reservoir.hold("research-agent", "web-search", {"tokens": "20k"})
        claim = await reservoir.wait(claim, phase="Tentative")
        claim = await reservoir.dispatch(claim)
        ...
        claim = await reservoir.finish(claim, {"tokens": "12k"}, outcome="Succeeded")

`Reservoir` is the same API, synchronous.
"""

from __future__ import annotations

import asyncio
import dataclasses
import json
import os
from collections.abc import Callable, Coroutine, Iterable, Mapping
from datetime import UTC, datetime, timedelta
from decimal import Decimal
from types import TracebackType
from typing import Any, TypeVar

from lightkube import ALL_NS, ApiError, AsyncClient, KubeConfig
from lightkube.models.coordination_v1 import LeaseSpec
from lightkube.models.meta_v1 import ObjectMeta, OwnerReference
from lightkube.resources.coordination_v1 import Lease
from lightkube.types import PatchType

from reservoir.core.claimstatus import settled_record
from reservoir.core.ledger import render
from reservoir.core.model import (
    API_GROUP,
    API_VERSION,
    MAX_DEPTH,
    BranchClaimSpec,
    ClaimPhase,
    CommitPoint,
    LedgerEntry,
    Model,
    ObjectRef,
    Placement,
    ReservationEnvelopeStatus,
    Transition,
    Upstream,
)
from reservoir.core.quantity import format_quantity, parse_resources
from reservoir.k8s import budgets
from reservoir.k8s.facts import as_dict
from reservoir.k8s.request_ids import claims_with_request_id
from reservoir.k8s.resources import (
    CLAIM_FINALIZER,
    CLAIM_LABEL,
    CLAIM_NAME_ANNOTATION,
    ENVELOPE_LABEL,
    ENVELOPE_NAME_ANNOTATION,
    BranchClaim,
    ReservationEnvelope,
    ReservationPool,
    envelope_label,
    field_value,
    get_object,
    path_segment,
)
from reservoir.k8s.transport import fast_client
from reservoir.sdk import patches
from reservoir.sdk.compensation import already_sent, compensation_request
from reservoir.sdk.errors import (
    ClaimExistsError,
    ClaimNotFoundError,
    CompensationError,
    DuplicateRequestIdError,
    LeaseUncertainError,
    NotReservedError,
    ReservoirError,
    StaleClaimError,
)
from reservoir.sdk.keepalive import LeaseKeeper
from reservoir.sdk.kept_lease import KeptLease, OnLost, ThreadedKeptLease
from reservoir.sdk.patches import (
    DISPATCH_RELIES_ON,
    UNSETTLED,
    Patch,
    compensation_patch,
    failed_tests,
    lease_fence,
)
from reservoir.sdk.views import ClaimView, EnvelopeTree, EnvelopeView, PoolView, ResultView
from reservoir.sdk.watch import ClaimWatch, Predicate, WaitTimeoutError

FENCED_RETRIES = 5
# A worker stops starting irreversible work this long before its lease's expiry.
LEASE_SAFETY_MARGIN = timedelta(seconds=2)
# The holder identity used when none is given to the SDK.
HOLDER_ENV = "RESERVOIR_HOLDER"

# Checks a verb's precondition on the current claim: raises when the verb no longer
# applies, returns True when it is already done (nothing to write), False to write.
Check = Callable[[ClaimView], bool]
# A verb's decision on the claim as read: the patch to send (its tests carry what the
# decision relied on), None when there is nothing to write; raises when the verb no
# longer applies.
Decide = Callable[[ClaimView], Patch | None]

ALREADY_DISPATCHED = frozenset({ClaimPhase.COMMITTED, ClaimPhase.RUNNING})


def _settled_problem(view: ClaimView) -> str | None:
    if view.settled:
        phase = view.settlement.phase if view.settlement else view.ledger_phase
        return f"the claim already settled as {phase.value}"
    return None


def _not_settled(view: ClaimView) -> bool:
    problem = _settled_problem(view)
    if problem:
        raise StaleClaimError(f"branchclaim/{view.name}: {problem}")
    return False


def _may_report(usage: Mapping[str, str | int]) -> Check:
    """Usage is a fact, taken from any reporter and on a claim being deleted, which waits
    for it, except new usage on a claim deleted before it was dispatched: it never ran
    (the API server refuses that too)."""
    reported = parse_resources(usage)

    def check(view: ClaimView) -> bool:
        _not_settled(view)
        never_ran = (
            view.deleting
            and not view.spec.dispatch
            and view.spec.commit_point is CommitPoint.DISPATCH
        )
        if never_ran and {**view.spec.usage, **reported} != view.spec.usage:
            raise StaleClaimError(
                f"branchclaim/{view.name}: the claim was deleted before it was dispatched: "
                "it never ran, so it takes no usage"
            )
        return False

    return check


def _same_claim(caller: ClaimView, current: ClaimView) -> None:
    """The current object is the claim the caller's view names: a claim deleted and
    re-created under the same name, or a new attempt, is another claim."""
    if current.uid != caller.uid or current.spec.attempt != caller.spec.attempt:
        raise StaleClaimError(
            f"branchclaim/{caller.name} is now a different claim "
            f"(attempt {current.spec.attempt}, uid {current.uid}; "
            f"you hold attempt {caller.spec.attempt}, uid {caller.uid})"
        )


class AsyncReservoir:
    def __init__(
        self,
        namespace: str | None = None,
        kubeconfig: str | None = None,
        holder: str | None = None,
        client: AsyncClient | None = None,
        *,
        shared_watch: bool = True,
    ) -> None:
        """`shared_watch`: waits share one watch of the namespace's claims, running from
        the first wait until `close()`; False: each wait watches its one claim for as long
        as it waits (for an event loop that does not run between calls)."""
        config = KubeConfig.from_file(kubeconfig) if kubeconfig else None
        self.client = client or fast_client(config, field_manager="reservoir-sdk")
        self.namespace = namespace or self.client.namespace
        self.holder = holder or os.environ.get(HOLDER_ENV) or f"{os.uname().nodename}/{os.getpid()}"
        self.shared_watch = shared_watch
        self._watches: dict[str, ClaimWatch] = {}  # shared, by namespace
        self.kept_leases: dict[str, LeaseKeeper] = {}  # by claim UID: see keep_alive
        self._call_watches: set[ClaimWatch] = set()  # without shared_watch: one per wait

    async def __aenter__(self) -> AsyncReservoir:
        return self

    async def __aexit__(self, *exc: object) -> None:
        await self.close()

    async def close(self) -> None:
        """Stop the watches, then close the connections."""
        try:
            for watch in [*self._watches.values(), *self._call_watches]:
                await watch.stop()
            self._watches.clear()
            self._call_watches.clear()
        finally:
            await self.client.close()

    @property
    def watches(self) -> tuple[ClaimWatch, ...]:
        """The watches this SDK runs now (one per namespace it waits in; none before the
        first wait, after `close()`, or without `shared_watch` outside a wait)."""
        watches = [*self._watches.values(), *self._call_watches]
        return tuple(watch for watch in watches if watch.running)

    # --- reading ------------------------------------------------------------------------

    async def get(self, claim: ClaimView | str) -> ClaimView:
        """The claim and its authoritative record, as the claim carries it (`view.entry`:
        its `status.ledger`, else `view.ledger_phase`, ... read its status). One read: the
        envelope is not read (`claims` and `tree` list claims with their envelope)."""
        name = claim.name if isinstance(claim, ClaimView) else claim
        return await self._read_claim(name)

    async def ledger(self, envelope: str) -> EnvelopeView:
        obj = await self.client.get(
            ReservationEnvelope, path_segment(envelope), namespace=self.namespace
        )
        return EnvelopeView.from_api(as_dict(obj))

    async def tree(self, envelope: str) -> EnvelopeTree:
        """The envelope, its claims (each with its ledger entry) and, recursively, the
        child envelopes drawing on it (by `spec.parent`, same namespace) with theirs:
        at most MAX_DEPTH levels, the envelope being the first. An envelope already on
        the path from the top (parents that form a cycle) is not listed again."""
        obj = await self.client.get(
            ReservationEnvelope, path_segment(envelope), namespace=self.namespace
        )
        return await self._tree(as_dict(obj), 1, frozenset())

    async def _tree(self, body: dict[str, Any], level: int, above: frozenset[str]) -> EnvelopeTree:
        view = EnvelopeView.from_api(body)
        claims = tuple(
            [
                ClaimView.from_api(as_dict(obj)).with_ledger(body)
                async for obj in self.client.list(
                    BranchClaim,
                    namespace=view.namespace,
                    fields={"spec.envelope": field_value(view.name)},
                )
            ]
        )
        if level >= MAX_DEPTH:
            return EnvelopeTree(view, claims, None)
        path = above | {view.uid}
        found = [
            as_dict(obj)
            async for obj in self.client.list(
                ReservationEnvelope,
                namespace=view.namespace,
                fields={"spec.parent": field_value(view.name)},
            )
        ]
        children = [
            await self._tree(child, level + 1, path)
            for child in sorted(found, key=lambda child: str(child["metadata"]["name"]))
            if child["metadata"].get("uid", "") not in path
        ]
        return EnvelopeTree(view, claims, tuple(children))

    async def pool(self, name: str) -> PoolView:
        """A ReservationPool (cluster-scoped): its totals and its envelopes' lines (each
        envelope holds its own: those of namespaces the caller may not list are left out,
        and the view says so)."""
        pool = PoolView.from_api(
            as_dict(await self.client.get(ReservationPool, path_segment(name)))
        )
        envelopes: list[EnvelopeView] = []
        complete = True
        for namespace in pool.namespaces:
            try:
                async for obj in self.client.list(ReservationEnvelope, namespace=namespace):
                    envelopes.append(EnvelopeView.from_api(as_dict(obj)))
            except ApiError as error:
                if error.status.code != 403:
                    raise
                complete = False
        return pool.with_envelopes(envelopes, complete)

    async def covering_pool(self, namespace: str | None = None) -> PoolView | None:
        """The pool the namespace's new root envelopes draw from (the oldest listing it and
        not being deleted), with the envelopes the caller may list; None: no pool covers it
        (or pools cannot be listed)."""
        pools = await budgets.list_pools(self.client)
        chosen = budgets.chosen_pool(pools, namespace or self.namespace)
        if chosen is None:
            return None
        view = await self.pool(chosen["metadata"]["name"])
        # A namespace two pools list draws from the older one: not this pool's queue.
        drawing = tuple(
            ns
            for ns in view.namespaces
            if (pool := budgets.chosen_pool(pools, ns)) is not None
            and pool["metadata"]["uid"] == view.uid
        )
        return dataclasses.replace(view, drawing=drawing)

    async def claims(self, envelope: str) -> list[ClaimView]:
        """The envelope's claims (by `spec.envelope`), each with its ledger line: the one the
        claim carries (`status.ledger`), else its entry in the envelope's ledger. A settled
        claim whose entry was compacted out of the ledger carries its record in its status
        (`view.settlement`)."""
        body = await self._read_envelope(envelope)
        return [
            ClaimView.from_api(as_dict(obj)).with_ledger(body)
            async for obj in self.client.list(
                BranchClaim,
                namespace=self.namespace,
                fields={"spec.envelope": field_value(envelope)},
            )
        ]

    async def envelopes(
        self, labels: Mapping[str, str], all_namespaces: bool = False
    ) -> list[EnvelopeView]:
        """The envelopes carrying every label in `labels` (e.g. {WORKFLOW_CLASS_LABEL:
        "research-agent"}), in this SDK's namespace or in all of them, by namespace and
        name."""
        found = [
            EnvelopeView.from_api(as_dict(obj))
            async for obj in self.client.list(
                ReservationEnvelope,
                namespace=ALL_NS if all_namespaces else self.namespace,
                labels=dict(labels),
            )
        ]
        return sorted(found, key=lambda view: (view.namespace, view.name))

    async def settled_records(
        self, envelope: str, namespace: str | None = None
    ) -> list[LedgerEntry]:
        """The record of every settled claim of `envelope` (in `namespace`, default this
        SDK's): its settled ledger entries, then the records carried by the statuses of
        settled claims whose entries were compacted out of the ledger (they last until
        `policy.settledClaimTTLSeconds` deletes the claim). The envelope is read first, so
        an entry compacted meanwhile is found in its claim's status."""
        namespace = namespace or self.namespace
        obj = await self.client.get(
            ReservationEnvelope, path_segment(envelope), namespace=namespace
        )
        status = ReservationEnvelopeStatus.model_validate(as_dict(obj).get("status") or {})
        found = [entry for entry in status.entries.values() if entry.settlement is not None]
        async for claim in self.client.list(
            BranchClaim, namespace=namespace, fields={"spec.envelope": field_value(envelope)}
        ):
            view = ClaimView.from_api(as_dict(claim))
            if view.uid in status.entries:
                continue
            line = view.entry  # the claim's own line, when it carries one
            record = (
                line
                if line is not None and line.settlement is not None
                else settled_record(view.status, view.uid, view.name, view.spec.attempt)
            )
            if record is not None:
                found.append(record)
        return found

    async def wait(
        self,
        claim: ClaimView | str,
        phase: str | ClaimPhase | None = None,
        condition: str | None = None,
        within: float = 60.0,
    ) -> ClaimView:
        """Until the claim's status shows `phase` and `condition` True (the first view
        that does); TimeoutError after `within` seconds;
        ClaimNotFoundError if the claim does not exist or is deleted meanwhile. (The
        status mirrors the ledger: once it shows a phase, the ledger has reached it.)
        The claim is read once the watch follows it, then followed by the watch's
        events; while the watch is broken, it is read every second or so."""
        name = claim.name if isinstance(claim, ClaimView) else claim

        def shows(view: ClaimView) -> bool:
            return (phase is None or view.phase == phase) and (
                condition is None or view.condition(condition)
            )

        try:
            view = await self.await_claim(name, shows, within)
        except WaitTimeoutError as timeout:
            raise TimeoutError(
                f"branchclaim/{name} is {timeout.last.phase.value}, "
                f"not {phase or condition}, after {within:.0f}s"
            ) from None
        return view

    # --- the verbs ----------------------------------------------------------------------

    async def hold(
        self,
        envelope: str | EnvelopeView,
        branch: str,
        requests: Mapping[str, str | int],
        *,
        name: str | None = None,
        attempt: int = 1,
        priority: int = 0,
        commit_point: str = "Dispatch",
        lease_seconds: int | None = None,
        dispatch: bool = False,
        upstream: Mapping[str, Any] | None = None,
        placement: Mapping[str, Any] | None = None,
        request_id: str | None = None,
        retry_window_seconds: int | None = None,
        speculation_group: str | None = None,
    ) -> ClaimView:
        """Create a claim on `envelope`, held by this SDK's holder (dispatch=True: the branch
        is sent as soon as it is reserved, reserving and committing in one step).
        `speculation_group`: the claim is one speculative copy of a branch; the first copy of
        the group to win (the envelope's policy.speculationWinner) has the others cancelled
        (`ClaimView.superseded_by` names it on each loser).
        `placement`: hints for device resources ({"nodeSelector": ..., "tolerations": ...}).
        `request_id`: the submission's idempotency key (`spec.upstream.requestId`; two
        claims of a namespace may not share one). `retry_window_seconds`: a failed
        attempt keeps what it did not use for the branch's next attempt this long.

        With `name`, the hold is idempotent: if a claim of that name already exists and is
        the one this call would create (`spec_differences` finds nothing), it is returned as
        it is now, settled or not; otherwise `ClaimExistsError` names the fields that
        differ, and nothing is written.

        `envelope` by name, or as an `EnvelopeView` (from `ledger`): by name, the envelope
        is read for its UID (the claim's owner reference); a view gives it, so an
        orchestrator that holds many branches on one envelope reads it once. The claim is
        owned by that envelope: if it was deleted since (even if another was made under its
        name), the garbage collector deletes the claim, which is settled as any deleted
        claim is."""
        owner_uid: str | None = None
        if isinstance(envelope, EnvelopeView):
            if envelope.namespace != self.namespace:
                raise ValueError(
                    f"envelope {envelope.namespace}/{envelope.name} is not in this client's "
                    f"namespace {self.namespace!r}: a claim draws on its own namespace's "
                    "envelopes"
                )
            owner_uid = envelope.uid or None
            envelope = envelope.name
        spec = BranchClaimSpec(
            envelope=envelope,
            branch=branch,
            attempt=attempt,
            requests=parse_resources(requests),
            priority=priority,
            commit_point=commit_point,
            dispatch=dispatch,
            lease={"duration_seconds": lease_seconds, "holder": self.holder},
            upstream=_upstream(upstream, request_id),
            placement=placement,
            retry_window_seconds=retry_window_seconds,
            speculation_group=speculation_group,
        )
        if spec.upstream.request_id is not None:
            await self._refuse_duplicate_request(spec.upstream.request_id, name)
        # Born with what the operator would otherwise patch in: the claim finalizer and,
        # when the envelope exists, its owner reference (as the operator sets it).
        if owner_uid is None:
            owner = await self._read_envelope(envelope)
            owner_uid = owner["metadata"]["uid"] if owner is not None else None
        metadata = ObjectMeta(
            name=name,
            generateName=None if name else f"{envelope}-{branch}-"[:58],
            namespace=self.namespace,
            labels={ENVELOPE_LABEL: envelope_label(envelope)},
            finalizers=[CLAIM_FINALIZER],
            ownerReferences=(
                [
                    OwnerReference(
                        apiVersion=f"{API_GROUP}/{API_VERSION}",
                        kind="ReservationEnvelope",
                        name=envelope,
                        uid=owner_uid,
                    )
                ]
                if owner_uid is not None
                else None
            ),
        )
        body = BranchClaim(metadata=metadata, spec=spec.to_api())
        for _ in range(FENCED_RETRIES):
            try:
                created = await self.client.create(body)
            except ApiError as error:
                if name is None or error.status.code != 409:
                    raise
                try:
                    existing = await self._read_claim(name)
                except ClaimNotFoundError:
                    continue  # deleted since: create it again
                _require_same_hold(spec, existing)
                return existing
            return ClaimView.from_api(as_dict(created))
        raise StaleClaimError(
            f"branchclaim/{name}: created and deleted under us {FENCED_RETRIES} times"
        )

    async def _refuse_duplicate_request(self, request_id: str, name: str | None) -> None:
        """The earliest place to say it: another claim of the namespace already carries
        this idempotency key (a claim the operator rejected for it does not count)."""
        for body in await claims_with_request_id(self.client, self.namespace, request_id):
            other = body["metadata"]["name"]
            if other != name:
                raise DuplicateRequestIdError(
                    f"upstream.requestId {request_id!r} is already branchclaim/{other}: "
                    "this submission was made before; use that claim, or a new requestId "
                    "for a new attempt",
                    claim=other,
                )

    async def dispatch(self, claim: ClaimView) -> ClaimView:
        """Cross the commit point: `spec.dispatch: true`. Only for a claim that holds
        capacity, held by this SDK's holder, whose lease can be confirmed: a worker that is
        unsure of its lease must not start irreversible work. A claim already Committed or
        Running is returned as it is (idempotent).

        The patch tests the claim's UID and generation (not cancelled, not being deleted, the
        same holder, as checked) and that its record still shows Tentative, unsettled, with
        the lease end checked. The envelope is not read: the operator answers for it. It
        treats every claim of a deleting envelope as deleted and releases a Tentative one on
        its next pass, after which this patch's test of the phase refuses the dispatch
        (`StaleClaimError`, the claim read again says it settled); a dispatch that lands
        before that pass is a commit like any other, and the envelope's deletion waits for
        the claim's final report (a cancel after the commit point). A dispatch written past
        the SDK onto a settled claim is recorded as refused (condition DispatchRefused),
        never counted as work started."""

        def may_dispatch(view: ClaimView) -> bool:
            _not_settled(view)
            refuse = f"branchclaim/{view.name}: do not dispatch"
            if view.deleting:
                raise StaleClaimError(f"{refuse}: the claim is being deleted")
            if view.spec.cancel:
                raise StaleClaimError(f"{refuse}: the branch was cancelled")
            self._require_holder(view, refuse)
            self._require_granted(view, refuse)
            phase = view.ledger_phase
            if phase in ALREADY_DISPATCHED:
                return True
            if phase is ClaimPhase.DETACHED:
                raise StaleClaimError(
                    f"{refuse}: its lease lapsed after the commit point (Detached)"
                )
            if phase is not ClaimPhase.TENTATIVE:
                raise NotReservedError(
                    f"{refuse}: it holds nothing yet ({phase.value}): wait until it is Tentative"
                )
            self._require_lease(view)
            kept = self.kept_leases.get(view.uid)
            if kept is not None:
                kept.require()  # the lease this process keeps is no longer vouched for
            return view.spec.dispatch  # already written: the operator has yet to see it

        return await self._fenced(
            claim,
            _spec_write({"dispatch": True}, may_dispatch, DISPATCH_RELIES_ON),
            StaleClaimError,
        )

    async def cancel(self, claim: ClaimView) -> ClaimView:
        """Prune the branch: `spec.cancel: true`. Released at once before the commit point,
        a cancel request (waiting for the final usage) after it. A claim already cancelled,
        or being deleted (deletion cancels it), is returned as it is. (The envelope is not
        read: a claim of a deleting envelope, which the operator cancels anyway, is written
        `spec.cancel` like any other.)"""

        def may_cancel(view: ClaimView) -> bool:
            _not_settled(view)
            return view.spec.cancel or view.deleting

        return await self._fenced(claim, _spec_write({"cancel": True}, may_cancel, UNSETTLED))

    async def report_usage(self, claim: ClaimView, usage: Mapping[str, str | int]) -> ClaimView:
        """Report cumulative usage so far (never a delta)."""
        patch = {"usage": _quantities(usage)}
        return await self._fenced(claim, _spec_write(patch, _may_report(usage), UNSETTLED))

    async def finish(
        self,
        claim: ClaimView,
        usage: Mapping[str, str | int],
        outcome: str = "Succeeded",
        result: str | None = None,
    ) -> ClaimView:
        """The final, confirmed usage and the outcome: the claim settles (commit C,
        return R − C). `result`: a durable reference to the branch's result (a URI or an
        object's name, `spec.result`, set once), recorded in the claim's status and kept
        after settlement, where `result()` finds it."""
        patch: dict[str, Any] = {"usage": _quantities(usage), "final": True, "outcome": outcome}
        if result is not None:
            patch["result"] = result
        return await self._fenced(claim, _spec_write(patch, _may_report(usage), UNSETTLED))

    async def result(self, claim: ClaimView | str) -> ResultView:
        """What became of the claim, by name: phase, outcome, result reference, when it
        settled, C and R − C. Read from its ledger entry, else its own status, so it
        answers after settlement, after compaction and after its worker is gone.
        `ClaimNotFoundError` if there is no such claim."""
        return ResultView.of(await self.get(claim))

    async def history(self, claim: ClaimView | str) -> list[Transition]:
        """The claim's recorded transitions, oldest first (from, to, reason, trigger, time,
        lease generation). `ClaimNotFoundError` if there is no such claim."""
        return (await self.get(claim)).history

    async def compensate(
        self,
        claim: ClaimView | str,
        amount: Mapping[str, Decimal | str],
        reason: str,
        reference: str | None = None,
        key: str | None = None,
    ) -> ClaimView:
        """A business reversal or follow-up charge after the claim settled (a refund, the
        void of an external authorization, a late invoice): per resource, a positive
        amount is charged to the envelope, a negative one given back. Applied by the
        operator once the claim has settled, once per `key`, to Consumable resources only,
        never below zero and at most what the envelope has available; recorded only while
        the envelope is not open (`status.compensations`, `kubectl reservoir history`).
        `key` defaults to a hash of the amount, reason and reference, so a retried call
        writes nothing twice. `CompensationError` for an empty or zero amount, no reason,
        a key naming another compensation, or a claim that holds the most it keeps."""
        wanted = compensation_request(amount, reason, reference, key)

        def append(view: ClaimView) -> Patch | None:
            if already_sent(view.spec.compensations, wanted, view.name):
                return None
            assert view.body is not None
            return compensation_patch(view.body, wanted.to_api())

        if isinstance(claim, ClaimView):
            return await self._fenced(claim, append, CompensationError)
        current = await self._read_claim(claim)  # by name: read once, then as any view
        return await self._fenced(current, append, CompensationError, fresh=True)

    async def renew(self, claim: ClaimView, confirm_timeout: float | None = 10.0) -> ClaimView:
        """Heartbeat the claim's Lease, then (by default) wait for the operator to grant the
        renewal. Reads the claim (not its envelope). Refused (`StaleClaimError`) when the
        claim is no longer the one `claim` names (UID, attempt), names another holder, is
        cancelled, being deleted, settled or Detached, before the heartbeat or once the
        wait ends. A Lease held by another holder is never taken over
        (`LeaseUncertainError`). The operator refuses the renewal of a claim whose envelope
        is closed, expired or being deleted: the renewal is then not confirmed. A renewal
        that cannot be confirmed raises `LeaseUncertainError`: stop starting irreversible
        work until the claim is read again."""
        view = await self._current_claim(claim)
        problem = self.renew_problem(view)
        if problem:
            raise StaleClaimError(f"branchclaim/{view.name}: cannot renew: {problem}")
        # Confirmed once the status shows a grant later than anything recorded now.
        before = _renewals(view)
        await self._beat(view)
        if confirm_timeout is None:
            return view

        uid, attempt = view.uid, view.spec.attempt

        def granted_or_hopeless(current: ClaimView) -> bool:
            # Another claim of the name, settled, Detached, cancelled, deleting...: no
            # grant is coming; the claim as read next says which.
            return (
                _renewals(current) > before
                or current.uid != uid
                or current.spec.attempt != attempt
                or self.renew_problem(current) is not None
            )

        try:
            await self.await_claim(view.name, granted_or_hopeless, confirm_timeout)
        except WaitTimeoutError:
            pass  # read once more below: a grant may have landed just now
        except ClaimNotFoundError:
            raise StaleClaimError(f"branchclaim/{view.name} no longer exists") from None
        view = await self._current_claim(claim)
        if _renewals(view) > before:
            return view
        problem = self.renew_problem(view)
        if problem:
            raise StaleClaimError(f"branchclaim/{view.name}: renewal refused: {problem}")
        raise LeaseUncertainError(
            f"branchclaim/{view.name}: renewal not confirmed (phase {view.ledger_phase.value}); "
            "do not start irreversible work"
        )

    def keep_alive(
        self,
        claim: ClaimView,
        *,
        on_lost: Callable[[str], None] | None = None,
        margin: float = LEASE_SAFETY_MARGIN.total_seconds(),
        confirm_timeout: float = 10.0,
    ) -> KeptLease:
        """Keep the claim's lease alive while the block runs (`async with`): one renewal
        is confirmed on entry, then the lease is renewed at a third of its length with
        jittered backoff, measured on the monotonic clock from the last confirmed grant,
        and given up `margin` seconds before that grant could end. Then `valid` is False,
        `require()` and this SDK's `dispatch` of the claim raise `LeaseUncertainError`,
        renewals stop and `on_lost(why)` is called once (reservoir.sdk.kept_lease)."""
        return KeptLease(
            self, claim, margin=margin, on_lost=on_lost, confirm_timeout=confirm_timeout
        )

    # --- internals ----------------------------------------------------------------------

    async def await_claim(self, name: str, predicate: Predicate, within: float) -> ClaimView:
        """The first view of the claim (without its ledger entry) that satisfies
        `predicate`: through this SDK's shared watch of its namespace, or through a watch of
        this one claim for as long as the wait lasts. WaitTimeoutError, ClaimNotFoundError."""
        if self.shared_watch:
            watch = self._watches.get(self.namespace)
            if watch is None:
                watch = self._watches[self.namespace] = ClaimWatch(self.client, self.namespace)
            return await watch.wait_for(name, predicate, within, self._read_claim)
        watch = ClaimWatch(self.client, self.namespace, name=name)
        self._call_watches.add(watch)
        try:
            return await watch.wait_for(name, predicate, within, self._read_claim)
        finally:
            self._call_watches.discard(watch)
            await watch.stop()

    async def _read_claim(self, name: str) -> ClaimView:
        obj = await get_object(self.client, BranchClaim, name, self.namespace)
        if obj is None:
            raise ClaimNotFoundError(f"branchclaim/{name} not found")
        return ClaimView.from_api(obj)

    async def _read_envelope(self, name: str) -> dict[str, Any] | None:
        return await get_object(self.client, ReservationEnvelope, name, self.namespace)

    async def _current_claim(self, caller: ClaimView) -> ClaimView:
        """The claim `caller` names as it is now (its record as the claim carries it);
        StaleClaimError if it is gone or is now another claim."""
        try:
            current = await self._read_claim(caller.name)
        except ClaimNotFoundError:
            raise StaleClaimError(f"branchclaim/{caller.name} no longer exists") from None
        _same_claim(caller, current)
        return current

    def _require_holder(self, view: ClaimView, refuse: str) -> None:
        holder = view.spec.lease.holder
        if holder is not None and holder != self.holder:
            raise StaleClaimError(
                f"{refuse}: the claim is held by {holder!r}, not by this worker ({self.holder!r})"
            )

    def _require_granted(self, view: ClaimView, refuse: str) -> None:
        """The lease, as the claim's status carries it (the fence the API server compares),
        was granted to this worker or to nobody yet: a claim naming no holder whose lease
        another worker's heartbeat renewed is that worker's now."""
        fence = lease_fence(view.body or {})
        granted = fence.get("holder")
        if granted is not None and granted != self.holder:
            raise StaleClaimError(
                f"{refuse}: its lease (generation {fence['generation']}) was granted to "
                f"{granted!r}, not to this worker ({self.holder!r})"
            )

    def _require_lease(self, view: ClaimView) -> None:
        """The ledger's lease must outlast the safety margin (by this machine's clock)."""
        expires = view.ledger_expires_at
        if expires is None:
            raise LeaseUncertainError(
                f"branchclaim/{view.name}: no lease recorded in the ledger; renew and re-read "
                "before dispatching"
            )
        if datetime.now(UTC) > expires - LEASE_SAFETY_MARGIN:
            raise LeaseUncertainError(
                f"branchclaim/{view.name}: lease expires at {expires.isoformat()}; renew and "
                "re-read before dispatching"
            )

    def renew_problem(self, view: ClaimView) -> str | None:
        """Why the claim's lease is not this worker's to renew any more (None: it is)."""
        holder = view.spec.lease.holder
        if holder is not None and holder != self.holder:
            return f"the claim is held by {holder!r}, not by this worker ({self.holder!r})"
        if view.settled:
            return _settled_problem(view)
        if view.spec.cancel:
            return "the branch was cancelled: its lease is not extended"
        if view.deleting:
            return "the claim is being deleted"
        if view.ledger_phase is ClaimPhase.DETACHED:
            return "the lease already lapsed (Detached)"
        return None

    async def _fenced(
        self,
        claim: ClaimView,
        decide: Decide,
        refused: type[ReservoirError] = ReservoirError,
        *,
        fresh: bool = False,
    ) -> ClaimView:
        """Write the claim with one JSON patch, reading at most the claim. `decide` runs on
        the claim as the caller's view read it (`fresh`: as just read) and returns the patch,
        whose tests carry what it relied on, or None when there is nothing to write, or
        raises when the verb no longer applies. A caller's view is not read again before
        the write: if it is stale, the patch's tests refuse it (422) and the claim read
        again says why. Only a decision to write is taken on an unread view: a refusal or
        "nothing to write" is decided again on the claim as it is now, so no error and no
        return is ever based on a stale view. A 422 whose tests the claim read again still
        passes is a refusal (a rule of the schema or of an admission policy): `refused`."""
        view = ClaimView.from_api(claim.body) if claim.body is not None else None
        if view is None:
            view, fresh = await self._current_claim(claim), True
        for _ in range(FENCED_RETRIES):
            _same_claim(claim, view)
            try:
                patch = decide(view)
            except ReservoirError:
                if fresh:
                    raise
                view, fresh = await self._current_claim(claim), True
                continue
            if patch is None:
                if fresh:
                    return view
                view, fresh = await self._current_claim(claim), True
                continue
            try:
                patched = await self.client.patch(
                    BranchClaim,
                    path_segment(view.name),
                    patch,
                    namespace=self.namespace,
                    patch_type=PatchType.JSON,
                )
            except ApiError as error:
                code = error.status.code
                if code == 404:
                    raise StaleClaimError(f"branchclaim/{view.name} no longer exists") from None
                if code not in (409, 422):
                    raise
                # A failed test and a refusal both answer 422: the claim read again tells
                # them apart, and is what the verb decides on next.
                current = await get_object(self.client, BranchClaim, view.name, self.namespace)
                if current is None:
                    raise StaleClaimError(f"branchclaim/{view.name} no longer exists") from None
                if code == 409 or failed_tests(patch, current):
                    view, fresh = ClaimView.from_api(current), True
                    continue
                raise refused(
                    f"branchclaim/{view.name}: refused by the API server: {error.status.message}"
                ) from None
            return ClaimView.from_api(as_dict(patched))
        raise StaleClaimError(
            f"branchclaim/{view.name}: kept changing under {FENCED_RETRIES} tries"
        )

    async def _beat(self, view: ClaimView) -> None:
        """One heartbeat on the claim's Lease, as this SDK's holder: created if missing,
        else renewed conditionally on its resourceVersion. A Lease left by an earlier claim
        of the same name is never taken over, nor another holder's, unless the claim itself
        names this worker (`spec.lease.holder`: the lease was handed to it)."""
        now = datetime.now(UTC).strftime("%Y-%m-%dT%H:%M:%S.%fZ")
        not_ours = f"lease/{view.name}: not taken over; do not start irreversible work"
        try:
            lease = await self.client.get(Lease, path_segment(view.name), namespace=self.namespace)
        except ApiError as error:
            if error.status.code != 404:
                raise
            lease = Lease(
                metadata=ObjectMeta(
                    name=view.name,
                    namespace=self.namespace,
                    # The claim's UID: its name may not fit in a label value (issue 25).
                    labels={
                        ENVELOPE_LABEL: envelope_label(view.spec.envelope),
                        CLAIM_LABEL: view.uid,
                    },
                    annotations={
                        ENVELOPE_NAME_ANNOTATION: view.spec.envelope,
                        CLAIM_NAME_ANNOTATION: view.name,
                    },
                    ownerReferences=[
                        OwnerReference(
                            apiVersion=f"{API_GROUP}/{API_VERSION}",
                            kind="BranchClaim",
                            name=view.name,
                            uid=view.uid,
                        )
                    ],
                ),
                spec=LeaseSpec(holderIdentity=self.holder, renewTime=now),  # type: ignore[arg-type]
            )
            try:
                await self.client.create(lease)
            except ApiError as error:
                if error.status.code == 409:
                    raise LeaseUncertainError(f"{not_ours}: created meanwhile by another") from None
                raise
            return
        owners = (lease.metadata.ownerReferences if lease.metadata else None) or []
        if owners and not any(owner.uid == view.uid for owner in owners):
            raise LeaseUncertainError(
                f"{not_ours}: it belongs to an earlier claim of this name (not yet collected)"
            )
        spec = lease.spec or LeaseSpec()
        handed_to_us = view.spec.lease.holder == self.holder
        if spec.holderIdentity not in (None, self.holder):
            if not handed_to_us:
                raise LeaseUncertainError(
                    f"{not_ours}: it is held by {spec.holderIdentity!r}, not by {self.holder!r}"
                )
            # The claim names this worker (a handover): the Lease follows the claim.
            spec.leaseTransitions = (spec.leaseTransitions or 0) + 1
        spec.holderIdentity = self.holder
        spec.renewTime = now  # type: ignore[assignment]
        lease.spec = spec
        try:
            await self.client.replace(lease)  # carries the resourceVersion it read
        except ApiError as error:
            if error.status.code == 409:
                raise LeaseUncertainError(
                    f"lease/{view.name} changed under us: another holder may own it"
                ) from None
            raise


def fenced_patch(
    view: ClaimView, spec_patch: Mapping[str, Any], relies_on: Iterable[str] = ()
) -> Patch:
    """`reservoir.sdk.patches.fenced_patch` of the claim object `view` was read from."""
    if view.body is None:
        raise ValueError(f"branchclaim/{view.name}: a view not read from the API server")
    return patches.fenced_patch(view.body, spec_patch, relies_on)


def _spec_write(spec_patch: Mapping[str, Any], requires: Check, relies_on: Iterable[str]) -> Decide:
    """A verb's decision: `spec_patch`, fenced on what `requires` checked, unless
    `requires` says it is done already (or raises)."""

    def decide(view: ClaimView) -> Patch | None:
        if requires(view):
            return None
        return fenced_patch(view, spec_patch, relies_on)

    return decide


def _renewals(view: ClaimView) -> int:
    return max(view.renewals, view.ledger_renewals)


def _quantities(values: Mapping[str, str | int]) -> dict[str, str]:
    return {name: format_quantity(amount) for name, amount in parse_resources(values).items()}


def _require_same_hold(spec: BranchClaimSpec, existing: ClaimView) -> None:
    differences = spec_differences(spec, existing.spec)
    if existing.deleting:
        differences.append("metadata.deletionTimestamp (the claim is being deleted)")
    if differences:
        raise ClaimExistsError(
            f"branchclaim/{existing.name} already exists and is not the claim this hold "
            f"would create: {'; '.join(differences)}. Choose another name, or read the "
            "claim with get()",
            existing.name,
            tuple(d.split(" ", 1)[0] for d in differences),
        )


def _upstream(given: Mapping[str, Any] | None, request_id: str | None) -> Upstream:
    upstream = Upstream.model_validate(dict(given or {}))
    if request_id is None:
        return upstream
    if upstream.request_id not in (None, request_id):
        raise ValueError(
            f"request_id {request_id!r} and upstream's requestId {upstream.request_id!r} differ"
        )
    return Upstream.model_validate({**upstream.to_api(), "requestId": request_id})


def _shown(value: Any) -> str:
    if value is None:
        return "unset"
    if isinstance(value, dict) and all(isinstance(v, Decimal) for v in value.values()):
        return render(value) or "{}"
    if isinstance(value, Model):
        return json.dumps(value.to_api(), sort_keys=True)
    return str(value)


def spec_differences(wanted: BranchClaimSpec, existing: BranchClaimSpec) -> list[str]:
    """Where an existing claim's spec is not the one `hold` would create, as
    "spec.FIELD (VALUE asked, VALUE on the claim)": the fields `hold` sets. Requests
    compare as quantities (20k is 20000). Facts that only move forward (dispatch,
    upstream.state) differ only when the claim is behind what the hold asks; facts a
    worker adds later (usage, cancel, a final report, result) are not compared."""
    empty = Placement()
    pairs: list[tuple[str, Any, Any]] = [
        ("envelope", wanted.envelope, existing.envelope),
        ("branch", wanted.branch, existing.branch),
        ("attempt", wanted.attempt, existing.attempt),
        ("requests", wanted.requests, existing.requests),
        ("priority", wanted.priority, existing.priority),
        ("commitPoint", wanted.commit_point, existing.commit_point),
        ("lease.durationSeconds", wanted.lease.duration_seconds, existing.lease.duration_seconds),
        ("lease.holder", wanted.lease.holder, existing.lease.holder),
        ("placement", wanted.placement or empty, existing.placement or empty),
        ("retryWindowSeconds", wanted.retry_window_seconds, existing.retry_window_seconds),
        ("speculationGroup", wanted.speculation_group, existing.speculation_group),
    ]
    asked, found = wanted.upstream, existing.upstream
    pairs += [
        (f"upstream.{field}", getattr(asked, attr), getattr(found, attr))
        for field, attr in (
            ("requestId", "request_id"),
            ("operationId", "operation_id"),
            ("supportsCancel", "supports_cancel"),
            ("cancelsRunning", "cancels_running"),
            ("supportsStatus", "supports_status"),
            ("deadline", "deadline"),
        )
    ]
    # A ref as the operator reads it: an unset apiVersion is its kind's default.
    pairs.append(("upstream.ref", _resolved(asked.ref), _resolved(found.ref)))
    differences = [
        f"spec.{field} ({_shown(mine)} asked, {_shown(theirs)} on the claim)"
        for field, mine, theirs in pairs
        if mine != theirs
    ]
    if wanted.dispatch and not existing.dispatch:
        differences.append("spec.dispatch (true asked, not dispatched on the claim)")
    if asked.state is not None and (found.state is None or found.state.rank < asked.state.rank):
        differences.append(
            f"spec.upstream.state ({asked.state.value} asked, {_shown(found.state)} on the claim)"
        )
    return differences


def _resolved(ref: ObjectRef | None) -> ObjectRef | None:
    if ref is None:
        return None
    return ref.model_copy(update={"api_version": ref.resolved_api_version})


T = TypeVar("T")


class Reservoir:
    """The synchronous SDK: `AsyncReservoir`'s verbs, each run to completion on a private
    event loop. (Inside an asyncio program, use `AsyncReservoir`.)"""

    def __init__(
        self,
        namespace: str | None = None,
        kubeconfig: str | None = None,
        holder: str | None = None,
    ) -> None:
        self._loop = asyncio.new_event_loop()
        self._async = self._run(_make_async(namespace, kubeconfig, holder))
        self._kubeconfig = kubeconfig

    def _run(self, coroutine: Coroutine[Any, Any, T]) -> T:
        return self._loop.run_until_complete(coroutine)

    @property
    def namespace(self) -> str:
        return self._async.namespace

    @property
    def holder(self) -> str:
        return self._async.holder

    def get(self, claim: ClaimView | str) -> ClaimView:
        return self._run(self._async.get(claim))

    def ledger(self, envelope: str) -> EnvelopeView:
        return self._run(self._async.ledger(envelope))

    def claims(self, envelope: str) -> list[ClaimView]:
        return self._run(self._async.claims(envelope))

    def tree(self, envelope: str) -> EnvelopeTree:
        return self._run(self._async.tree(envelope))

    def pool(self, name: str) -> PoolView:
        return self._run(self._async.pool(name))

    def covering_pool(self, namespace: str | None = None) -> PoolView | None:
        return self._run(self._async.covering_pool(namespace))

    def envelopes(
        self, labels: Mapping[str, str], all_namespaces: bool = False
    ) -> list[EnvelopeView]:
        return self._run(self._async.envelopes(labels, all_namespaces))

    def settled_records(self, envelope: str, namespace: str | None = None) -> list[LedgerEntry]:
        return self._run(self._async.settled_records(envelope, namespace))

    def wait(
        self,
        claim: ClaimView | str,
        phase: str | ClaimPhase | None = None,
        condition: str | None = None,
        within: float = 60.0,
    ) -> ClaimView:
        return self._run(self._async.wait(claim, phase, condition, within))

    def hold(
        self,
        envelope: str | EnvelopeView,
        branch: str,
        requests: Mapping[str, str | int],
        **options: Any,
    ) -> ClaimView:
        return self._run(self._async.hold(envelope, branch, requests, **options))

    def dispatch(self, claim: ClaimView) -> ClaimView:
        return self._run(self._async.dispatch(claim))

    def cancel(self, claim: ClaimView) -> ClaimView:
        return self._run(self._async.cancel(claim))

    def report_usage(self, claim: ClaimView, usage: Mapping[str, str | int]) -> ClaimView:
        return self._run(self._async.report_usage(claim, usage))

    def finish(
        self,
        claim: ClaimView,
        usage: Mapping[str, str | int],
        outcome: str = "Succeeded",
        result: str | None = None,
    ) -> ClaimView:
        return self._run(self._async.finish(claim, usage, outcome, result))

    def result(self, claim: ClaimView | str) -> ResultView:
        return self._run(self._async.result(claim))

    def history(self, claim: ClaimView | str) -> list[Transition]:
        return self._run(self._async.history(claim))

    def renew(self, claim: ClaimView, confirm_timeout: float | None = 10.0) -> ClaimView:
        return self._run(self._async.renew(claim, confirm_timeout))

    def compensate(
        self,
        claim: ClaimView | str,
        amount: Mapping[str, Decimal | str],
        reason: str,
        reference: str | None = None,
        key: str | None = None,
    ) -> ClaimView:
        return self._run(self._async.compensate(claim, amount, reason, reference, key))

    def keep_alive(
        self,
        claim: ClaimView,
        *,
        on_lost: OnLost | None = None,
        margin: float = LEASE_SAFETY_MARGIN.total_seconds(),
        confirm_timeout: float = 10.0,
    ) -> ThreadedKeptLease:
        """`AsyncReservoir.keep_alive` as a `with` block: the renewals run on a thread of
        their own, with their own connection, while the caller's code runs."""

        def make() -> AsyncReservoir:
            return AsyncReservoir(
                namespace=self.namespace,
                kubeconfig=self._kubeconfig,
                holder=self.holder,
                shared_watch=False,
            )

        return ThreadedKeptLease(
            make,
            claim,
            self._async.kept_leases,
            margin=margin,
            on_lost=on_lost,
            confirm_timeout=confirm_timeout,
        )

    def close(self) -> None:
        self._run(self._async.close())
        self._loop.close()

    def __enter__(self) -> Reservoir:
        return self

    def __exit__(
        self,
        kind: type[BaseException] | None,
        error: BaseException | None,
        trace: TracebackType | None,
    ) -> None:
        self.close()


async def _make_async(
    namespace: str | None, kubeconfig: str | None, holder: str | None
) -> AsyncReservoir:
    # The async client must be created inside the loop that will run it. No loop runs
    # between the synchronous SDK's calls to serve a shared watch: each wait has its own.
    return AsyncReservoir(
        namespace=namespace, kubeconfig=kubeconfig, holder=holder, shared_watch=False
    )
