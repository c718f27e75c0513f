"""The load generator: one asyncio process, bounded concurrency, the SDK's verbs.

`Tracker` keeps one watch on the namespace's BranchClaims and one on its
ReservationEnvelopes, and notes (with this process's clock) when each claim is first seen in
each phase, in its envelope's ledger (authoritative, first) or in its own status (the
mirror). The lifecycle waits on the tracker rather than polling: a wait costs the API
server nothing and the latencies are not quantized by a poll interval. (`--sdk-wait` uses
`AsyncReservoir.wait` instead, to measure the SDK's own wait.)

`claim_lifecycles` drives claims through hold → Tentative → dispatch → Committed → usage
report → final report → capacity returned → delete, or (`Options.kueue_shape`) through
Kueue's performance test's shape: every claim created up front, each cancelled once it holds
(as each Workload is marked Finished once Admitted); `raw_lifecycles` makes the same kinds
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
from lightkube.generic_resource import create_namespaced_resource
from lightkube.models.core_v1 import EventSource, ObjectReference
from lightkube.models.meta_v1 import ObjectMeta
from lightkube.resources.core_v1 import Event
from lightkube.types import PatchType

from reservoir.k8s.resources import BranchClaim, ReservationEnvelope
from reservoir.k8s.transport import fast_client
from reservoir.sdk import AsyncReservoir
from reservoir.sdk.errors import NotReservedError
from reservoir.sdk.views import ClaimView, EnvelopeView

SETTLED = frozenset({"Consumed", "Released", "Expired", "Rejected"})
# Capacity back: settled, or the entry compacted out of the ledger (settled, unseen).
TERMINAL = SETTLED | {"Gone"}
HOLDING = frozenset({"Tentative", "Committed", "Running"})
QUEUED_WAIT = 24 * 3600.0  # seconds: in effect none (see _admitted_then_cancelled)
COMMITTED = frozenset({"Committed", "Running"})
RAW_GROUP = "bench.reservoir.dev"
RawClaim = create_namespaced_resource(RAW_GROUP, "v1", "RawClaim", "rawclaims")
RawEnvelope = create_namespaced_resource(RAW_GROUP, "v1", "RawEnvelope", "rawenvelopes")


def client_for(kubeconfig: str, connections: int, field_manager: str) -> AsyncClient:
    """A lightkube client on the SDK's own transport (reservoir.k8s.transport: aiohttp)
    keeping `connections` connections open (beyond them every request would wait)."""
    return fast_client(
        KubeConfig.from_file(kubeconfig),
        connections,
        field_manager=field_manager,
        timeout=httpx2.Timeout(60.0),
    )


# --- observing ----------------------------------------------------------------------------


@dataclass
class Seen:
    """When one claim (by UID) was first seen in each phase, by source."""

    ledger: dict[str, float] = field(default_factory=dict)
    status: dict[str, float] = field(default_factory=dict)

    def first(self, phases: Iterable[str]) -> float | None:
        seen = self.first_seen(phases)
        return seen[0] if seen else None

    def first_seen(self, phases: Iterable[str]) -> tuple[float, str] | None:
        """(when, phase) of the earliest of `phases` seen, in the ledger or the status."""
        times = [
            (t, p) for source in (self.ledger, self.status) for p, t in source.items()
            if p in phases
        ]  # fmt: skip
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
        self.latest: dict[str, dict[str, Any]] = {}  # claim UID -> the claim as last seen
        self._waiters: dict[str, list[tuple[frozenset[str], asyncio.Future[float]]]] = {}
        self.envelope_bytes: dict[str, int] = {}  # peak serialized size seen, per envelope
        # What the envelope held at that peak: its lines in flight and their bytes, and
        # the bytes of its managedFields (the API server's record of who set each field).
        self.envelope_peak: dict[str, dict[str, int]] = {}
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
        self.latest[uid] = body
        status = body.get("status") or {}
        phase = status.get("phase")
        if phase:
            self._note(uid, phase, "status")
        line = status.get("ledger") or {}
        if line.get("phase"):  # the claim's own ledger line (issue 23)
            self._note(uid, line["phase"], "ledger")

    def _envelope(self, body: dict[str, Any]) -> None:
        name = body["metadata"]["name"]
        status = body.get("status") or {}
        entries = status.get("entries") or {}
        size = len(json.dumps(body, separators=(",", ":")))
        if size > self.envelope_bytes.get(name, 0):
            self.envelope_bytes[name] = size
            self.envelope_peak[name] = {
                "bytes": size,
                "lines_in_flight": len(entries),
                "lines_in_flight_bytes": len(json.dumps(entries, separators=(",", ":"))),
                "managed_fields_bytes": len(
                    json.dumps(body["metadata"].get("managedFields") or [], separators=(",", ":"))
                ),
            }
        # The lines in flight: each capacity move is recorded here first (issue 23); a line
        # leaves once its claim shows it, which says nothing of the claim's phase.
        for uid, entry in entries.items():
            self._note(uid, entry.get("phase", ""), "ledger")

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

    def settled_phase(self, uid: str) -> str | None:
        """The phase the claim was first seen settled in (ledger or status), if any."""
        seen = self.seen.get(uid)
        first = seen.first_seen(SETTLED) if seen is not None else None
        return first[1] if first else None

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
    offered: float | None = None  # open loop: when it was due to start (its arrival)
    created: float = 0.0  # the create request was sent
    tentative: float | None = None
    tentative_status: float | None = None  # the claim's status mirror caught up
    dispatched: float | None = None  # the dispatch write was acknowledged
    committed: float | None = None
    final: float | None = None  # the final report's write was acknowledged
    returned: float | None = None  # the ledger shows the capacity returned
    done: float | None = None  # deleted
    settled_as: str | None = None  # the phase it settled in (a whole life: Consumed)
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
    # Kueue's shape (bench/kueue.py): creates bounded by the concurrency, not lives; each
    # claim cancelled once it holds, which returns its capacity to the next in the queue.
    kueue_shape: bool = False


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
    # Each envelope read once, as an orchestrator does: its claims are held on the view.
    views = {name: await sdk.ledger(name) for name in sorted({s.envelope for s in samples})}
    stalled = False
    begin = time.monotonic()

    async def one(index: int, sample: Sample) -> None:
        if rate:
            sample.offered = begin + index / rate
            await asyncio.sleep(max(0.0, sample.offered - time.monotonic()))
        try:
            if options.kueue_shape:
                await _admitted_then_cancelled(
                    sdk, tracker, sample, views[sample.envelope], options, slots
                )
            else:
                async with slots:
                    await _life(sdk, tracker, sample, views[sample.envelope], options)
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


async def _life(
    sdk: AsyncReservoir, tracker: Tracker, s: Sample, envelope: EnvelopeView, options: Options
) -> None:
    within = options.within
    s.created = time.monotonic()
    view = await sdk.hold(envelope, s.name, options.requests, name=s.name)
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
    # A whole life ends Consumed (charged its usage): any other settlement is a failure,
    # not a completed claim (the ledger's entry may be gone before the status says which).
    await tracker.reached(uid, SETTLED, within)
    s.settled_as = tracker.settled_phase(uid)
    if s.settled_as != "Consumed":
        raise RuntimeError(f"settled as {s.settled_as}, not Consumed")
    seen = tracker.seen.get(uid)
    if seen is not None:
        s.tentative_status = seen.first_in_status(HOLDING)
    await sdk.client.delete(BranchClaim, s.name, namespace=sdk.namespace)
    s.done = time.monotonic()


async def _admitted_then_cancelled(
    sdk: AsyncReservoir,
    tracker: Tracker,
    s: Sample,
    envelope: EnvelopeView,
    options: Options,
    creates: asyncio.Semaphore,
) -> None:
    """Kueue's performance test's life of a Workload, for a claim: created (at most
    `concurrency` creates in flight, all of them up front), seen holding (Admitted), then
    cancelled at once on the claim as last seen (marked Finished), which releases it and
    admits the next in its envelope's queue. Nothing is deleted while measured, as there."""
    async with creates:
        s.created = time.monotonic()
        view = await sdk.hold(envelope, s.name, options.requests, name=s.name)
    uid = view.uid
    # No wait of its own, as in Kueue's run: every claim is queued from the start, and the
    # last waits for nearly the whole run (a 300 s bound gave up on 11,034 of 15,000 at the
    # full size, which then held their capacity uncancelled). The stall guard ends a run
    # that stopped admitting.
    s.tentative = await tracker.reached(uid, HOLDING, QUEUED_WAIT)
    latest = tracker.latest.get(uid)
    await sdk.cancel(ClaimView.from_api(latest) if latest is not None else view)
    s.final = time.monotonic()
    s.returned = await tracker.reached(uid, TERMINAL, options.within)
    s.settled_as = tracker.settled_phase(uid)
    if s.settled_as != "Released":
        raise RuntimeError(f"settled as {s.settled_as}, not Released")
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
    """The writes one raw claim makes besides its own create, spec patches and delete
    (the SDK's): per claim, matched to what the operator made per claim in the throughput
    run, each a fraction spread over the run (3.53 status writes per claim: 3 for some
    claims, 4 for others, 3.53 on average)."""

    claim_status_writes: float = 3.0  # patch rawclaims/status (the operator's mirror)
    claim_patches: float = 1.0  # patch rawclaims (the operator's finalizer removal)
    envelope_status_writes: float = 1.0  # update rawenvelopes/status (the ledger)
    events: float = 1.0  # create events (the settlement's Event)


class Share:
    """A fractional number of writes per claim, handed out as whole writes: each claim
    takes what has accumulated, so that over the run the average is the fraction."""

    def __init__(self, per_claim: float) -> None:
        self.per_claim = per_claim
        self.owed = 0.0

    def take(self, fraction: float = 1.0) -> int:
        self.owed += self.per_claim * fraction
        whole = int(self.owed)
        self.owed -= whole
        return whole


RAW_FINALIZER = f"{RAW_GROUP}/settlement"


async def raw_envelopes(client: AsyncClient, namespace: str, envelopes: int) -> None:
    """The raw baseline's stand-in envelopes (made before its measurement starts)."""
    for index in range(envelopes):
        await client.create(
            RawEnvelope(
                metadata=ObjectMeta(name=f"env-{index}", namespace=namespace),
                spec={"capacity": {"tokens": "1e9"}},
            )
        )


async def raw_lifecycles(
    client: AsyncClient,
    namespace: str,
    count: int,
    envelopes: int,
    concurrency: int,
    plan: RawPlan,
    label: str = "raw",
) -> list[tuple[float, float]]:
    """`count` raw claims through what a Reservoir claim's life writes, by the same verbs
    on the same kinds of resources, with no operator and no schema: the create, the spec
    patches of dispatch, usage and the final report, and the delete (the SDK's), and
    `plan`'s status writes, envelope status updates (a PUT conditional on the version,
    one writer per envelope), finalizer removal and Events (the operator's). (start, end)
    per claim, monotonic. The envelopes are made beforehand (`raw_envelopes`)."""
    slots = asyncio.Semaphore(concurrency)
    progress = Progress(label, count)
    timings: list[tuple[float, float]] = []
    status_writes, claim_patches = Share(plan.claim_status_writes), Share(plan.claim_patches)
    envelope_writes, events = Share(plan.envelope_status_writes), Share(plan.events)

    async def patch(resource: Any, name: str, body: dict[str, Any]) -> None:
        await client.patch(resource, name, body, namespace=namespace, patch_type=PatchType.MERGE)

    # Per envelope, one writer at a time (as the operator's ledger writer), the version it
    # last wrote, and the claims settled since: that write drops their entries, as the
    # operator compacts settled lines (else the stand-in ledger grows with every claim,
    # and at the sizes the API server timed its writes out).
    locks: dict[str, asyncio.Lock] = {}
    bodies: dict[str, dict[str, Any]] = {}
    settled: dict[str, set[str]] = {}

    async def write_ledger(envelope: str, claim: str, phase: str) -> None:
        async with locks.setdefault(envelope, asyncio.Lock()):
            body = bodies.get(envelope)
            if body is None:
                body = (await client.get(RawEnvelope, envelope, namespace=namespace)).to_dict()
            entries = dict((body.get("status") or {}).get("entries") or {})
            for name in settled.pop(envelope, set()):
                entries.pop(name, None)
            if phase != "Consumed":
                entries[claim] = {"phase": phase}
            body = {**body, "status": {"entries": entries}}
            written = await client.replace(
                RawEnvelope.Status(
                    metadata=ObjectMeta(
                        name=envelope,
                        namespace=namespace,
                        resourceVersion=body["metadata"]["resourceVersion"],
                    ),
                    status=body["status"],
                ),
                envelope,
                namespace=namespace,
            )
            bodies[envelope] = written.to_dict()

    async def ledger(envelope: str, claim: str, phase: str) -> None:
        if phase == "Consumed":
            settled.setdefault(envelope, set()).add(claim)
        for _ in range(envelope_writes.take(0.5)):
            await write_ledger(envelope, claim, phase)

    async def one(index: int) -> None:
        async with slots:
            started = time.monotonic()
            name, envelope = f"raw-{index}", f"env-{index % envelopes}"
            phases = _spread(["Tentative", "Committed", "Consumed"], status_writes.take())
            patches = claim_patches.take()
            await client.create(
                RawClaim(
                    metadata=ObjectMeta(
                        name=name,
                        namespace=namespace,
                        finalizers=[RAW_FINALIZER] if patches else None,
                    ),
                    spec={"envelope": envelope, "requests": {"tokens": "10"}},
                )
            )
            await ledger(envelope, name, "Tentative")
            for phase in phases[: len(phases) // 2]:
                await patch(RawClaim.Status, name, {"status": {"phase": phase}})
            await patch(RawClaim, name, {"spec": {"dispatch": True}})
            await patch(RawClaim, name, {"spec": {"usage": {"tokens": "3"}}})
            await patch(RawClaim, name, {"spec": {"usage": {"tokens": "5"}, "final": True}})
            await ledger(envelope, name, "Consumed")
            for phase in phases[len(phases) // 2 :]:
                await patch(RawClaim.Status, name, {"status": {"phase": phase}})
            for number in range(events.take()):
                await client.create(raw_event(namespace, name, number))
            for _ in range(patches - 1):
                await patch(RawClaim, name, {"metadata": {"labels": {"seen": "yes"}}})
            await client.delete(RawClaim, name, namespace=namespace)
            if patches:
                await patch(RawClaim, name, {"metadata": {"finalizers": None}})
            timings.append((started, time.monotonic()))
            progress.tick()

    await asyncio.gather(*(one(index) for index in range(count)))
    return timings


def raw_event(namespace: str, claim: str, number: int) -> Event:
    """An Event about a raw claim, as the operator posts one when a claim settles."""
    return Event(
        metadata=ObjectMeta(name=f"{claim}.{number}", namespace=namespace),
        involvedObject=ObjectReference(
            apiVersion=f"{RAW_GROUP}/v1", kind="RawClaim", name=claim, namespace=namespace
        ),
        reason="Consumed",
        message="settled as Consumed",
        type="Normal",
        source=EventSource(component="bench-raw"),
    )


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
