"""ReservationPool: a tenant's quota, one serialized ledger writer per pool, and
settle-before-delete, as for envelopes."""

from __future__ import annotations

import logging
from typing import Any

import kopf

from reservoir import metrics
from reservoir.core.model import API_GROUP, API_VERSION
from reservoir.handlers.envelopes import IDLE_WAKEUP_SECONDS, has_news
from reservoir.k8s.clock import utcnow
from reservoir.k8s.ledger_writer import LedgerStuckError
from reservoir.services import Services

POOLS = (API_GROUP, API_VERSION, "reservationpools")


@kopf.on.event(*POOLS, when=has_news)
async def wake_the_pool(name: str, memo: kopf.Memo, **_: Any) -> None:
    """A grown capacity or a new namespace may admit what waits."""
    services: Services = memo.services
    services.pools.poke(name)


@kopf.daemon(*POOLS, cancellation_timeout=5.0)
async def keep_the_pool_ledger(
    name: str,
    stopped: kopf.DaemonStopped,
    memo: kopf.Memo,
    logger: logging.Logger | logging.LoggerAdapter[Any],
    **_: Any,
) -> None:
    """The pool's status is the tenant's ledger: admit root envelopes, take back what
    closed ones return."""
    services: Services = memo.services
    with services.pools.keeping(name) as trigger:
        while not stopped:
            wake_in = IDLE_WAKEUP_SECONDS
            try:
                result = await services.pools.reconcile_once(name)
                if result is not None and result.wake_at is not None:
                    # A Replenishing window returns capacity then: look again at that moment.
                    soon = (result.wake_at - utcnow()).total_seconds() + 0.05
                    wake_in = max(min(wake_in, soon), 0.5)
            except LedgerStuckError as error:
                logger.warning("%s", error)
            except Exception:  # never let one bad reconcile stop the pool's writer
                logger.exception("reconciling the pool failed; retrying")
                wake_in = 2.0
            await trigger.wait(wake_in)


@kopf.on.delete(*POOLS, retries=None, timeout=None, errors=kopf.ErrorsMode.TEMPORARY)
async def settle_envelopes_before_removal(name: str, memo: kopf.Memo, **_: Any) -> None:
    """A pool being deleted admits no more envelopes; it goes once every envelope it holds
    has closed and returned its balance."""
    services: Services = memo.services
    try:
        result = await services.pools.reconcile_once(name)
    except LedgerStuckError as error:
        raise kopf.TemporaryError(f"the pool's ledger cannot move: {error}", delay=30) from None
    if result is None:
        metrics.pools.forget(name)
        return
    # Every line, settled ones included: an envelope learns its fate from its own record,
    # so the pool goes only once each has mirrored its line (or is gone).
    lines = [f"{c.namespace}/{c.envelope}" for c in result.lines.values()]
    records = result.status.child_records
    if not lines and records is not None and records.count:
        # Not read in this pass (another operator serves some of its namespaces): the lines
        # its envelopes hold are counted all the same.
        lines = [f"{records.count} envelopes holding lines"]
    if lines:
        raise kopf.TemporaryError(
            f"waiting for {len(lines)} envelopes to close and record their settlement: "
            f"{', '.join(lines[:5])}",
            delay=5,
        )
    # It goes now: its gauges and their place go with it (else deleted pools kept their
    # places and new ones showed as _other: review).
    metrics.pools.forget(name)
