"""ReservationEnvelope: one serialized ledger writer per envelope, and settle-before-delete."""

from __future__ import annotations

import asyncio
import logging
import random
import time
from dataclasses import dataclass
from typing import Any

import kopf

from reservoir import metrics
from reservoir.core.model import API_GROUP, API_VERSION, ChildPhase
from reservoir.core.reconcile import Reconciliation
from reservoir.handlers.claims import own_claims
from reservoir.k8s.clock import utcnow
from reservoir.k8s.ledger_writer import LedgerStuckError
from reservoir.k8s.resources import FORCE_SETTLE_GONE_ANNOTATION
from reservoir.services import Services

ENVELOPES = (API_GROUP, API_VERSION, "reservationenvelopes")
# An envelope's daemon wakes at least this often (its metrics stay current: see
# metrics.STALE_AFTER_SECONDS), and makes a pass without news at least every
# QUIET_PASS_SECONDS (see PassSchedule).
IDLE_WAKEUP_SECONDS = 30.0
QUIET_PASS_SECONDS = 300.0
# A deletion waiting for its settlement hands back to kopf (a retry, an Event) this often,
# and makes one pass of news that come within DELETE_NEWS_BATCH_SECONDS of each other.
DELETE_HOLD_SECONDS = 60.0
DELETE_NEWS_BATCH_SECONDS = 0.5


def has_news(body: kopf.Body, **_: Any) -> bool:
    """A spec the ledger has not reconciled yet (closed, grown, re-policied), or a person's
    decision about entries whose claims are gone. The ledger's own writes are no news."""
    observed = (body.get("status") or {}).get("observedGeneration")
    annotations = body.get("metadata", {}).get("annotations") or {}
    return observed != body.get("metadata", {}).get("generation") or (
        FORCE_SETTLE_GONE_ANNOTATION in annotations
    )


@kopf.index(*ENVELOPES)
async def envelopes_by_parent(
    spec: kopf.Spec, name: str, namespace: str | None, **_: Any
) -> dict[tuple[str, str], str]:
    """Which envelopes draw on which: a writer lists its children only when it has some."""
    parent = spec.get("parent")
    return {(namespace or "", str(parent)): name} if parent else {}


@kopf.on.event(*ENVELOPES, when=has_news)
async def wake_the_ledger(namespace: str | None, name: str, memo: kopf.Memo, **_: Any) -> None:
    """A change to the envelope itself is a fact for its ledger, like any claim's."""
    services: Services = memo.services
    if namespace:
        services.writer.poke(namespace, name)


@kopf.daemon(*ENVELOPES, cancellation_timeout=5.0)
async def keep_the_ledger(
    namespace: str | None,
    name: str,
    stopped: kopf.DaemonStopped,
    memo: kopf.Memo,
    logger: logging.Logger | logging.LoggerAdapter[Any],
    **_: Any,
) -> None:
    """The envelope's status is the ledger: converge it whenever a claim moves, and at the
    next lease end or deadline even when none does."""
    assert namespace is not None  # the kind is namespaced
    services: Services = memo.services
    schedule = PassSchedule()
    with services.writer.keeping(namespace, name) as trigger:
        poked = False  # the first pass is due at once all the same (PassSchedule)
        while not stopped:
            if schedule.due(time.monotonic(), poked):
                wake_in = await one_pass(services, namespace, name, logger)
                schedule.ran(time.monotonic(), wake_in)
            else:
                metrics.envelopes.still_current(namespace, name)
            poked = await trigger.wait(schedule.wait(time.monotonic()))
        if poked:
            # Stopped (the envelope is being deleted) with news taken and no pass made: the
            # deletion handler, which makes the passes now, waits on the same trigger
            # (found by review: the news was lost and the deletion waited a minute).
            trigger.poke()


async def one_pass(
    services: Services,
    namespace: str,
    name: str,
    logger: logging.Logger | logging.LoggerAdapter[Any],
) -> float | None:
    """One pass of the envelope's ledger: in how many seconds it wants the next without
    news (None: only on news)."""
    try:
        wake_in = seconds_to_wake(await services.writer.reconcile_once(namespace, name))
        services.health.succeeded()
        return wake_in
    except LedgerStuckError as error:  # reported on the envelope; look again later
        logger.warning("%s", error)
        services.health.succeeded()  # the API answered: the problem is the envelope's
        return IDLE_WAKEUP_SECONDS
    except Exception as error:  # never let one bad reconcile stop the envelope's writer
        logger.exception("reconciling the ledger failed; retrying")
        services.health.failed(f"{type(error).__name__}: {error}"[:200])
        return 2.0


def seconds_to_wake(result: Reconciliation | None) -> float | None:
    """When the daemon looks again without news (None: only on news). Only this is kept
    from the pass while the daemon waits, not the pass itself: a pass holds a copy of every
    live line of its envelope, and every envelope's daemon kept its last one (about 3 KiB a
    live claim, found with tracemalloc on the scale benchmark's operator)."""
    if result is None or result.wake_at is None:
        return None
    return (result.wake_at - utcnow()).total_seconds() + 0.05


@dataclass
class PassSchedule:
    """When an envelope's daemon makes a pass: on news (a claim, its Lease, a pod or the
    envelope moved: a poke), at the moment its last pass named (a lease end, a deadline, a
    provider to ask, a window returning), soon after a failed pass, and otherwise at least
    every QUIET_PASS_SECONDS, a safety net for news missed. Between passes it wakes every
    IDLE_WAKEUP_SECONDS only to keep its metrics current: a pass reads the envelope from
    the API server and walks every live claim, and at 1,000 envelopes passes every 30 s
    without news were about 40 % of the envelope reads while 100,000 claims filled them
    (bench/results/issue-23-full/dec04-100k-bb470d2/)."""

    next_pass: float = 0.0  # monotonic seconds

    def due(self, now: float, poked: bool) -> bool:
        return poked or now >= self.next_pass

    def ran(self, now: float, wake_in: float | None) -> None:
        quiet = QUIET_PASS_SECONDS * random.uniform(0.9, 1.0)  # not all at once
        self.next_pass = now + (quiet if wake_in is None else min(max(wake_in, 0.05), quiet))

    def wait(self, now: float) -> float:
        return min(max(self.next_pass - now, 0.05), IDLE_WAKEUP_SECONDS)


@kopf.on.delete(*ENVELOPES, retries=None, timeout=None, errors=kopf.ErrorsMode.TEMPORARY)
async def settle_children_before_removal(
    namespace: str | None,
    name: str,
    body: kopf.Body,
    retry: int,
    memo: kopf.Memo,
    **_: Any,
) -> None:
    """Deleting an envelope cancels its children first; it goes only once all settled, and
    each of its claims is its own (the garbage collector takes them with it).

    kopf stops the envelope's daemon once it is being deleted: while its settlement is
    not recorded, this handler makes the passes instead, on news (a poke: a claim, a
    child or its parent moved) and at the moment its last pass named, as the daemon did,
    and hands back to kopf (a retry, an Event) every DELETE_HOLD_SECONDS. It made a pass
    every 2 s before: 3,000 envelopes deleted at once were 1,500 passes and as many kopf
    progress patches a second, and the pool that settles them crawled (about 2 envelopes
    a second, where 300 took 21 s)."""
    assert namespace is not None
    services: Services = memo.services
    held_until = time.monotonic() + DELETE_HOLD_SECONDS
    counted = retry > 0  # one deletion held back, however many times it is retried
    with services.writer.keeping(namespace, name) as trigger:
        while True:
            try:
                result = await services.writer.reconcile_once(namespace, name)
            except LedgerStuckError as error:
                raise kopf.TemporaryError(f"the ledger cannot move: {error}", delay=30) from None
            if result is None:
                return
            waiting = still_waiting(services, namespace, result)
            if waiting is None:
                await own_claims(services, namespace, body)
                services.writer.forget(namespace, name)  # its gauges' series go with it
                # Its parent retires the line it holds for this envelope on its next pass,
                # and makes room for the next ones (a pool settles 256 at a time).
                services.writer.poke_parent(namespace, result.status.parent)
                return
            if not counted:
                counted = True
                metrics.finalizer_waits.labels(namespace, "ReservationEnvelope").inc()
                kopf.warn(body, reason="AwaitingSettlement", message=waiting)
            left = held_until - time.monotonic()
            if left <= 0:
                break
            wake_in = seconds_to_wake(result)
            poked = await trigger.wait(left if wake_in is None else max(min(left, wake_in), 0.0))
            if not poked and time.monotonic() >= held_until:
                break
            await asyncio.sleep(DELETE_NEWS_BATCH_SECONDS)  # news come in bursts: one pass
    kopf.warn(body, reason="AwaitingSettlement", message=waiting)  # about once a minute
    raise kopf.TemporaryError(waiting, delay=1)


def still_waiting(services: Services, namespace: str, result: Reconciliation) -> str | None:
    """What a deleted envelope still waits for (None: nothing, it may go). Waiting on its
    parent to record its line, it pokes that parent's writer."""
    live = [f"claim {e.claim}" for e in result.lines.values() if not e.phase.terminal]
    live += [
        f"envelope {c.envelope}"
        for c in result.child_lines.values()
        if c.phase is ChildPhase.RESERVED
    ]
    if not live and result.children_unsettled:
        # Every child closed, but not every one has recorded its fate yet.
        live = [f"{result.children_unsettled} child envelopes to record their settlement"]
    if live:
        return f"waiting for {len(live)} to settle: {', '.join(live[:5])}"
    if result.done_upward:
        return None
    # Closed, but its parent has not yet recorded the balance it returns: the record of
    # what this envelope used must outlive it there.
    record = result.status.parent
    services.writer.poke_parent(namespace, record)
    parent = record.name if record is not None and record.name else "its parent"
    return f"waiting for {parent} to settle this envelope's line"
