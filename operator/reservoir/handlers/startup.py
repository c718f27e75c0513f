"""Operator start-up: settings and services."""

from __future__ import annotations

import asyncio
import contextlib
import logging
from collections.abc import Iterable
from functools import partial
from typing import Any

import kopf

from reservoir import gc_tuning, kopf_watch
from reservoir.core.model import API_GROUP
from reservoir.endpoints import serve, watch_api
from reservoir.handlers import claims, leases
from reservoir.handlers.claims import claim_key
from reservoir.handlers.leases import lease_key
from reservoir.k8s.claim_source import WatchedClaims, claim_record, lease_record
from reservoir.k8s.devices import CLAIM_UID_LABEL
from reservoir.k8s.informer import Informer
from reservoir.k8s.per_object import LatestPerObject
from reservoir.k8s.resources import CLAIM_LABEL, ENVELOPE_LABEL, FINALIZER, LIST_PAGE
from reservoir.metrics_auth import MetricsAuth
from reservoir.services import Services

ADOPTIONS_GRACE_SECONDS = 5.0  # at shutdown, for adoptions under way to finish


# The kinds the operator only indexes and watches (no on.create/update/delete handler, no
# daemon): kopf compares their essence before and after each event with nothing, so it
# is left empty. Any other kind keeps its essence (tests/unit/test_essence.py checks
# these against kopf's registry).
INDEXED_ONLY_KINDS = frozenset({"BranchClaim", "Lease", "Pod", "Job", "ResourceClaim"})


class EssenceWithoutStatus(kopf.AnnotationsDiffBaseStorage):
    """kopf's change detection: the essence it compares leaves out the status (as kopf's
    own does), but without deep-copying it first, and is empty for kinds without change
    handlers. kopf builds an essence on every event of every watched object (about a
    twentieth of the operator's CPU at admission, measured: a deep copy of each claim,
    Lease and pod on each of its events, compared with nothing)."""

    def build(
        self, *, body: kopf.Body, extra_fields: Iterable[Any] | None = None
    ) -> kopf.BodyEssence:
        if body.get("kind") in INDEXED_ONLY_KINDS:
            return kopf.BodyEssence()
        meta = {k: v for k, v in body.get("metadata", {}).items() if k != "managedFields"}
        slim = {k: v for k, v in body.items() if k not in ("status", "metadata")}
        essential = kopf.Body({**slim, "metadata": meta})  # type: ignore[arg-type]
        return super().build(body=essential, extra_fields=extra_fields)


# Server-side label selectors for the kinds the operator watches but does not own: the API
# server sends only these objects, so other tenants' pods, Jobs, Leases and ResourceClaims
# never reach the operator (not only filtered out by its handlers). Every handler and
# index of each kind asks for at least these labels; placeholder pods carry the claim label
# too (see k8s/devices.py).
WATCH_LABEL_SELECTORS: dict[tuple[str, str, str], str] = {
    ("", "v1", "pods"): CLAIM_LABEL,
    ("batch", "v1", "jobs"): ENVELOPE_LABEL,
    ("coordination.k8s.io", "v1", "leases"): ENVELOPE_LABEL,
    ("resource.k8s.io", "v1", "resourceclaims"): f"{CLAIM_UID_LABEL},{ENVELOPE_LABEL}",
}


@kopf.on.startup()
async def configure(settings: kopf.OperatorSettings, memo: kopf.Memo, **kwargs: Any) -> None:
    # Our status fields belong to the ledger: kopf keeps its own bookkeeping in annotations.
    settings.persistence.finalizer = FINALIZER
    settings.persistence.progress_storage = kopf.AnnotationsProgressStorage(prefix="reservoir.dev")
    settings.persistence.diffbase_storage = EssenceWithoutStatus(
        prefix="reservoir.dev", key="last-handled-configuration"
    )
    # Transitions post their own Events; of the handlers' log lines only warnings and
    # errors (a deletion waiting for settlement, say) become Events too.
    settings.posting.level = logging.WARNING
    settings.watching.server_timeout = 300
    for resource, selector in WATCH_LABEL_SELECTORS.items():
        settings.watching.label_selectors[resource] = selector
    # The initial LIST of each kind in pages: kopf holds one page's objects at a time.
    settings.watching.chunk_size = LIST_PAGE
    memo.services = services = Services.build()
    # Claims and their Leases are served by informers of ours, not kopf's workers (see
    # reservoir.k8s.informer), each event to the handler of its kind.
    services.claims = Informer(
        "branchclaims", claim_record, claim_key, partial(claims.claim_changed, services)
    )
    services.leases = Informer(
        "leases", lease_record, lease_key, partial(leases.renewal_requested, services)
    )
    services.adoptions = LatestPerObject(
        partial(claims.adopt, services), ready=services.indexed.wait
    )
    # Before kopf starts its watchers: an object none can decode is set aside, a watcher
    # that fails is started again, and /readyz says so meanwhile (see the module).
    memo.set_aside = kopf_watch.apply(
        services.health,
        settings,
        {
            f"branchclaims.{API_GROUP}": services.claims,
            "leases.coordination.k8s.io": services.leases,
        },
        services.indexed,
    )
    # The ledger writers read claims and Leases from the informers (each namespace's first
    # list is complete before any daemon starts), confirming with a GET what a stale copy
    # could change.
    services.writer.source = WatchedClaims(services.claims, services.leases)
    services.writer.children = kwargs["envelopes_by_parent"]
    listening = memo.get("endpoints_socket")  # bound by the command line, before kopf ran
    if listening is not None:
        auth = MetricsAuth(services.client) if memo.get("metrics_auth") else None
        memo.endpoints = await serve(listening, services.health, auth)
    memo.api_watch = asyncio.create_task(watch_api(services.health, services.probe_api))
    memo.gc_freezing = asyncio.create_task(gc_tuning.keep_frozen())  # see reservoir.gc_tuning
    services.health.started = True


@kopf.on.cleanup()
async def stop_background_tasks(memo: kopf.Memo, **_: Any) -> None:
    """The endpoints, the API watch and the freezing of survivors go with the operator;
    adoptions under way are given a moment to finish."""
    if memo.get("api_watch") is not None:
        memo.api_watch.cancel()
    if memo.get("gc_freezing") is not None:
        memo.gc_freezing.cancel()
    adoptions = getattr(memo.get("services"), "adoptions", None)
    if adoptions is not None:  # adoptions under way finish (a patch each), within reason
        with contextlib.suppress(TimeoutError):
            await asyncio.wait_for(adoptions.drained(), ADOPTIONS_GRACE_SECONDS)
    if memo.get("endpoints") is not None:
        await memo.endpoints.cleanup()


@kopf.on.probe(id="ledger")
def ledger_health(memo: kopf.Memo, **_: Any) -> str:
    """Shown on the liveness endpoint: whether the latest ledger reconcile reached the API."""
    services: Services | None = memo.get("services")
    if services is None:
        return "starting"
    return services.health.problem() or "ok"
