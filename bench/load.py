"""The load generator: one asyncio process, bounded concurrency, the SDK's verbs.

`Tracker` keeps one watch on the namespace's BranchClaims and one on its
ReservationEnvelopes, and notes (with this process's clock) when each claim is first seen in
each phase, in its envelope's ledger (authoritative, first) or in its own status (the
mirror). The lifecycle waits on the tracker rather than polling: a wait costs the API
server nothing and the latencies are not quantized by a poll interval. (`--sdk-wait` uses
`AsyncReservoir.wait` instead, to measure the SDK's own wait.)

`claim_lifecycles` drives claims through hold → Tentative → dispatch → Committed → usage
report → final report → capacity returned → delete; `raw_lifecycles` makes the same kinds
and numbers of writes on a schemaless CRD with no operator (the baseline).
"""

from __future__ import annotations

import asyncio
import json
import math
import time
from collections import Counter
from collections.abc import Awaitable, Callable, Iterable
from dataclasses import dataclass, field
from typing import Any

import httpx2
from lightkube import ApiError, AsyncClient, KubeConfig
from lightkube.config.client_adapter import verify_cluster
from lightkube.generic_resource import create_namespaced_resource
from lightkube.models.meta_v1 import ObjectMeta
from lightkube.types import PatchType

from reservoir.k8s.resources import BranchClaim, ReservationEnvelope
from reservoir.sdk import AsyncReservoir
from reservoir.sdk.errors import NotReservedError
from reservoir.sdk.views import ClaimView

TERMINAL = frozenset({"Consumed", "Released", "Expired", "Rejected", "Gone"})
HOLDING = frozenset({"Tentative", "Committed", "Running"})
COMMITTED = frozenset({"Committed", "Running"})
RAW_GROUP = "bench.reservoir.dev"
RawClaim = create_namespaced_resource(RAW_GROUP, "v1", "RawClaim", "rawclaims")
RawEnvelope = create_namespaced_resource(RAW_GROUP, "v1", "RawEnvelope", "rawenvelopes")


def client_for(kubeconfig: str, connections: int, field_manager: str) -> AsyncClient:
    """A lightkube client whose connection pool keeps `connections` connections alive
    (httpx keeps 20 by default: beyond that every request would pay a TLS handshake)."""
    config = KubeConfig.from_file(kubeconfig)
    single = config.get()
    assert single.user is not None
    context = verify_cluster(single.cluster, single.user, single.abs_file)
    limits = httpx2.Limits(max_connections=connections, max_keepalive_connections=connections)
    transport = httpx2.AsyncHTTPTransport(verify=context, limits=limits)
    return AsyncClient(
        config=config,
        field_manager=field_manager,
        transport=transport,
        timeout=httpx2.Timeout(60.0),
    )


# --- observing ----------------------------------------------------------------------------


@dataclass
class Seen:
    """When one claim (by UID) was first seen in each phase, by source."""

    ledger: dict[str, float] = field(default_factory=dict)
    status: dict[str, float] = field(default_factory=dict)

    def first(self, phases: Iterable[str]) -> float | None:
        times = [
            t for source in (self.ledger, self.status) for p, t in source.items() if p in phases
        ]
        return min(times) if times else None

    def first_in_status(self, phases: Iterable[str]) -> float | None:
        times = [t for p, t in self.status.items() if p in phases]
        return min(times) if times else None


class Tracker:
    """One watch on the namespace's claims and one on its envelopes, shared by every
    waiter."""

    def __init__(self, client: AsyncClient, namespace: str) -> None:
        self.client = client
        self.namespace = namespace
        self.seen: dict[str, Seen] = {}
        self.uid_by_name: dict[str, str] = {}
        self._waiters: dict[str, list[tuple[frozenset[str], asyncio.Future[float]]]] = {}
        self._in_ledger: dict[str, set[str]] = {}  # envelope → claim UIDs in its ledger
        self.envelope_bytes: dict[str, int] = {}  # peak serialized size seen, per envelope
        self.events: Counter[str] = Counter()
        self._tasks: list[asyncio.Task[None]] = []

    async def start(self) -> None:
        for resource, handle in ((ReservationEnvelope, self._envelope), (BranchClaim, self._claim)):
            version = await self._list(resource, handle)
            self._tasks.append(asyncio.create_task(self._watch(resource, handle, version)))

    async def stop(self) -> None:
        for task in self._tasks:
            task.cancel()
        await asyncio.gather(*self._tasks, return_exceptions=True)
        self._tasks.clear()

    async def _list(self, resource: Any, handle: Callable[[dict[str, Any]], None]) -> str | None:
        listing = self.client.list(resource, namespace=self.namespace)
        async for obj in listing:
            handle(obj.to_dict())
        return listing.resourceVersion  # type: ignore[attr-defined,no-any-return]

    async def _watch(
        self, resource: Any, handle: Callable[[dict[str, Any]], None], version: str | None
    ) -> None:
        while True:
            try:
                async for kind, obj in self.client.watch(
                    resource, namespace=self.namespace, resource_version=version
                ):
                    body = obj.to_dict()
                    version = body["metadata"]["resourceVersion"]
                    self.events[f"{resource.__name__} {kind}"] += 1
                    if kind != "DELETED":
                        handle(body)
            except ApiError as error:
                if error.status.code == 410:  # too old: list again
                    version = await self._list(resource, handle)
                else:
                    await asyncio.sleep(0.2)
            except httpx2.HTTPError:
                await asyncio.sleep(0.2)

    def _claim(self, body: dict[str, Any]) -> None:
        uid = body["metadata"]["uid"]
        self.uid_by_name[body["metadata"]["name"]] = uid
        phase = (body.get("status") or {}).get("phase")
        if phase:
            self._note(uid, phase, "status")

    def _envelope(self, body: dict[str, Any]) -> None:
        name = body["metadata"]["name"]
        status = body.get("status") or {}
        entries = status.get("entries") or {}
        size = len(json.dumps(body, separators=(",", ":")))
        self.envelope_bytes[name] = max(size, self.envelope_bytes.get(name, 0))
        before = self._in_ledger.get(name, set())
        for uid, entry in entries.items():
            self._note(uid, entry.get("phase", ""), "ledger")
        # An entry leaves the ledger only once settled (compaction), or with its claim.
        for uid in before - entries.keys():
            self._note(uid, "Gone", "ledger")
        self._in_ledger[name] = set(entries)

    def _note(self, uid: str, phase: str, source: str) -> None:
        seen = self.seen.setdefault(uid, Seen())
        record = seen.ledger if source == "ledger" else seen.status
        if phase in record:
            return
        now = time.monotonic()
        record[phase] = now
        waiters = self._waiters.get(uid)
        if not waiters:
            return
        for phases, future in list(waiters):
            if phase in phases and not future.done():
                future.set_result(now)
        self._waiters[uid] = [(p, f) for p, f in waiters if not f.done()]

    async def reached(self, uid: str, phases: frozenset[str], within: float) -> float:
        """The time (monotonic) the claim was first seen in one of `phases`, waiting for it
        up to `within` seconds (TimeoutError)."""
        seen = self.seen.get(uid)
        if seen is not None:
            already = seen.first(phases)
            if already is not None:
                return already
        future: asyncio.Future[float] = asyncio.get_running_loop().create_future()
        self._waiters.setdefault(uid, []).append((phases, future))
        try:
            return await asyncio.wait_for(future, within)
        except TimeoutError:
            raise TimeoutError(
                f"claim {uid} not seen in {sorted(phases)} in {within:.0f}s"
            ) from None


# --- Reservoir's claims -------------------------------------------------------------------


@dataclass
class Sample:
    """One claim's life, in monotonic seconds (None: not reached)."""

    name: str
    envelope: str
    created: float = 0.0  # the create request was sent
    tentative: float | None = None
    tentative_status: float | None = None  # the claim's status mirror caught up
    dispatched: float | None = None  # the dispatch write was acknowledged
    committed: float | None = None
    final: float | None = None  # the final report's write was acknowledged
    returned: float | None = None  # the ledger shows the capacity returned
    done: float | None = None  # deleted
    error: str | None = None

    def latency(self, start: str, end: str) -> float | None:
        a, b = getattr(self, start), getattr(self, end)
        return None if a is None or b is None else max(0.0, b - a)


@dataclass
class Options:
    requests: dict[str, str] = field(default_factory=lambda: {"tokens": "10"})
    usage: dict[str, str] = field(default_factory=lambda: {"tokens": "3"})
    final: dict[str, str] = field(default_factory=lambda: {"tokens": "5"})
    within: float = 300.0  # per wait
    stall: float = 120.0  # give up on the rest when no claim has finished for this long
    sdk_wait: bool = False
    full_life: bool = True  # False: hold and wait for Tentative only (live leased claims)


class Progress:
    def __init__(self, label: str, total: int, every: float = 10.0) -> None:
        self.label, self.total, self.every = label, total, every
        self.done = self.failed = 0
        self.started = self.last = self.progressed = time.monotonic()

    def tick(self, failed: bool = False) -> None:
        self.done += 1
        self.failed += failed
        now = time.monotonic()
        if not failed:  # a claim that timed out is no sign of life
            self.progressed = now
        if now - self.last >= self.every or self.done == self.total:
            self.last = now
            elapsed = now - self.started
            print(
                f"  [{self.label}] {self.done}/{self.total} in {elapsed:.0f}s "
                f"({self.done / max(elapsed, 1e-9):.1f}/s, {self.failed} failed)",
                flush=True,
            )


async def claim_lifecycles(
    sdk: AsyncReservoir,
    tracker: Tracker,
    names: list[tuple[str, str]],  # (claim name, envelope)
    concurrency: int,
    options: Options,
    label: str,
    rate: float | None = None,
) -> list[Sample]:
    """Each claim through its life, at most `concurrency` at a time; with `rate`, claim i
    starts no earlier than i / rate seconds in (an offered load, open loop)."""
    slots = asyncio.Semaphore(concurrency)
    progress = Progress(label, len(names))
    samples = [Sample(name, envelope) for name, envelope in names]
    stalled = False
    begin = time.monotonic()

    async def one(index: int, sample: Sample) -> None:
        if rate:
            await asyncio.sleep(max(0.0, begin + index / rate - time.monotonic()))
        async with slots:
            try:
                await _life(sdk, tracker, sample, options)
            except asyncio.CancelledError:
                if not stalled:
                    raise
                sample.error = f"stalled: no claim finished for {options.stall:.0f}s"
                return
            except Exception as error:
                sample.error = f"{type(error).__name__}: {error}"[:300]
            progress.tick(sample.error is not None)

    tasks = [asyncio.create_task(one(i, sample)) for i, sample in enumerate(samples)]
    running = asyncio.gather(*tasks)
    # Retrieved, so that a Ctrl-C (which cancels it) prints no "never retrieved" noise.
    running.add_done_callback(lambda done: done.cancelled() or done.exception())
    while not running.done():
        await asyncio.wait([running], timeout=1.0)
        if not running.done() and time.monotonic() - progress.progressed > options.stall:
            stalled = True
            left = sum(1 for task in tasks if not task.done())
            print(f"  [{label}] stalled: giving up on {left} claims", flush=True)
            for task in tasks:
                task.cancel()
            await asyncio.gather(*tasks, return_exceptions=True)
            break
    for sample in samples:
        if sample.done is None and sample.error is None:
            sample.error = f"stalled: no claim finished for {options.stall:.0f}s"
    return samples


async def _life(sdk: AsyncReservoir, tracker: Tracker, s: Sample, options: Options) -> None:
    within = options.within
    s.created = time.monotonic()
    view = await sdk.hold(s.envelope, s.name, options.requests, name=s.name)
    uid = view.uid
    if options.sdk_wait:
        await sdk.wait(view, phase="Tentative", within=within)
    s.tentative = await tracker.reached(uid, HOLDING, within)
    if not options.full_life:
        s.done = time.monotonic()
        return
    view = await _retry_not_reserved(lambda: sdk.dispatch(view))
    s.dispatched = time.monotonic()
    if options.sdk_wait:
        await sdk.wait(view, phase="Committed", within=within)
    s.committed = await tracker.reached(uid, COMMITTED, within)
    view = await sdk.report_usage(view, options.usage)
    view = await sdk.finish(view, options.final)
    s.final = time.monotonic()
    s.returned = await tracker.reached(uid, TERMINAL, within)
    seen = tracker.seen.get(uid)
    if seen is not None:
        s.tentative_status = seen.first_in_status(HOLDING)
    await sdk.client.delete(BranchClaim, s.name, namespace=sdk.namespace)
    s.done = time.monotonic()


async def _retry_not_reserved(call: Callable[[], Awaitable[ClaimView]]) -> ClaimView:
    """The ledger said Tentative; a read of it an instant later says so too, unless the
    envelope was being rewritten: a few quick retries cover that race."""
    for attempt in range(20):
        try:
            return await call()
        except NotReservedError:
            await asyncio.sleep(0.05 * (attempt + 1))
    return await call()


# --- the raw baseline ---------------------------------------------------------------------


@dataclass
class RawPlan:
    """The writes one raw claim makes, matched to what Reservoir's run made per claim."""

    claim_status_writes: int = 3
    envelope_status_writes: float = 1.0  # per claim, spread over the run


async def raw_lifecycles(
    client: AsyncClient,
    namespace: str,
    count: int,
    envelopes: int,
    concurrency: int,
    plan: RawPlan,
    label: str = "raw",
) -> list[tuple[float, float]]:
    """`count` raw claims through create, the spec patches of dispatch, usage and the final
    report, `plan`'s status writes, and delete: (start, end) per claim, monotonic."""
    for index in range(envelopes):
        await client.create(
            RawEnvelope(
                metadata=ObjectMeta(name=f"env-{index}", namespace=namespace),
                spec={"capacity": {"tokens": "1e9"}},
            )
        )
    slots = asyncio.Semaphore(concurrency)
    progress = Progress(label, count)
    owed = [0.0]  # envelope status writes owed, fractional
    timings: list[tuple[float, float]] = []

    async def patch(resource: Any, name: str, body: dict[str, Any]) -> None:
        await client.patch(resource, name, body, namespace=namespace, patch_type=PatchType.MERGE)

    # Per envelope, the claims settled since its last write: that write drops their
    # entries, as the operator compacts settled lines (else the stand-in ledger grows with
    # every claim, and at the sizes the API server timed its writes out).
    settled: dict[str, set[str]] = {}

    async def envelope_writes(envelope: str, claim: str, phase: str, share: float) -> None:
        if phase == "Consumed":
            settled.setdefault(envelope, set()).add(claim)
        owed[0] += share
        while owed[0] >= 1.0:
            owed[0] -= 1.0
            entries: dict[str, Any] = {name: None for name in settled.pop(envelope, set())}
            if phase != "Consumed":
                entries[claim] = {"phase": phase}
            await patch(RawEnvelope.Status, envelope, {"status": {"entries": entries}})

    async def one(index: int) -> None:
        async with slots:
            started = time.monotonic()
            name, envelope = f"raw-{index}", f"env-{index % envelopes}"
            status_phases = _spread(
                ["Tentative", "Committed", "Consumed"], plan.claim_status_writes
            )
            share = plan.envelope_status_writes / 2
            await client.create(
                RawClaim(
                    metadata=ObjectMeta(name=name, namespace=namespace),
                    spec={"envelope": envelope, "requests": {"tokens": "10"}},
                )
            )
            await envelope_writes(envelope, name, "Tentative", share)
            for phase in status_phases[: len(status_phases) // 2]:
                await patch(RawClaim.Status, name, {"status": {"phase": phase}})
            await patch(RawClaim, name, {"spec": {"dispatch": True}})
            await patch(RawClaim, name, {"spec": {"usage": {"tokens": "3"}}})
            await patch(RawClaim, name, {"spec": {"usage": {"tokens": "5"}, "final": True}})
            await envelope_writes(envelope, name, "Consumed", share)
            for phase in status_phases[len(status_phases) // 2 :]:
                await patch(RawClaim.Status, name, {"status": {"phase": phase}})
            await client.delete(RawClaim, name, namespace=namespace)
            timings.append((started, time.monotonic()))
            progress.tick()

    await asyncio.gather(*(one(index) for index in range(count)))
    return timings


def _spread(phases: list[str], count: int) -> list[str]:
    """`count` status values, walking through `phases`."""
    return [phases[min(len(phases) - 1, i * len(phases) // max(count, 1))] for i in range(count)]


# --- statistics ---------------------------------------------------------------------------


def percentiles(values: list[float], points: Iterable[int] = (50, 95, 99)) -> dict[str, float]:
    """Milliseconds, nearest rank; empty dict for no values."""
    if not values:
        return {}
    ordered = sorted(values)
    out = {}
    for p in points:
        rank = max(1, math.ceil(len(ordered) * p / 100))
        out[f"p{p}"] = round(ordered[rank - 1] * 1000, 1)
    out["max"] = round(ordered[-1] * 1000, 1)
    out["mean"] = round(sum(ordered) / len(ordered) * 1000, 1)
    return out
