"""The writer's mirror passes by claims whose status already says all of it (LedgerWriter._mirror,
`_told`): over random histories driven through the pure core and the writer's real mirror
(claims held by a small in-memory API, its status writes conditional as the API server's
are), every claim the mirror counts as saying what the ledger says without writing it does
say it: the status the mirror would compute for it from scratch is the one it has. The
histories mix creations, dispatches, cancels, usage and final reports, deletions, the
clock, writer replicas coming and going, refused writes and stale copies of the claims."""

from __future__ import annotations

import asyncio
import copy
import random
from collections.abc import Mapping
from datetime import UTC, datetime, timedelta
from typing import Any

import pytest
from lightkube import ApiError
from lightkube.models.meta_v1 import Status

from reservoir.core.claimstatus import claim_status
from reservoir.core.inflight import ClaimViewBehindError, EnvelopeBehindError, counts
from reservoir.core.model import (
    BranchClaimSpec,
    EnvelopePolicy,
    ReservationEnvelopeSpec,
    ReservationEnvelopeStatus,
)
from reservoir.core.reconcile import EnvelopeFacts, Reconciliation, reconcile
from reservoir.k8s import facts as read
from reservoir.k8s import ledger_writer

T0 = datetime(2026, 1, 1, tzinfo=UTC)


def stamp(moment: datetime) -> str:
    return moment.strftime("%Y-%m-%dT%H:%M:%SZ")


class Claims:
    """The API server's claims: status patches applied only if their tests hold."""

    def __init__(self, rnd: random.Random) -> None:
        self.rnd, self.version = rnd, 100
        self.refusing = 0.0  # the share of status writes answered 409
        self.bodies: dict[str, dict[str, Any]] = {}

    def moved(self, body: dict[str, Any]) -> None:
        self.version += 1
        body["metadata"]["resourceVersion"] = str(self.version)

    async def patch(self, kind: Any, name: str, ops: list[dict[str, Any]], **_: Any) -> Any:
        body = self.bodies.get(name)
        if body is None:
            raise ApiError(status=Status(code=404, message="gone"))
        if self.rnd.random() < self.refusing:
            raise ApiError(status=Status(code=409, message="refused"))
        tests = [op for op in ops if op["op"] == "test"]
        for test in tests:
            path = [p for p in test["path"].split("/") if p]
            value: Any = body
            for part in path:
                value = value.get(part) if isinstance(value, dict) else None
            if value != test["value"]:
                raise ApiError(status=Status(code=422, message="test failed"))
        for op in ops:
            if op["op"] in ("add", "replace") and op["path"] == "/status":
                body["status"] = copy.deepcopy(op["value"])
        self.moved(body)
        return copy.deepcopy(body)


class CheckedWriter(ledger_writer.LedgerWriter):
    """The real mirror, then a check of what it counted as mirrored without writing."""

    unwritten = 0  # claims counted as mirrored without a write, over the run

    async def _mirror(
        self,
        namespace: str,
        envelope: str,
        claims: list[dict[str, Any]],
        result: Reconciliation,
        now: datetime,
        problems: Mapping[str, str],
    ) -> tuple[set[str], set[str]]:
        mirrored, rewritten = await super()._mirror(
            namespace, envelope, claims, result, now, problems
        )
        for claim in claims:
            meta = claim["metadata"]
            uid = meta["uid"]
            if uid not in mirrored or uid in rewritten or uid in result.replaced:
                continue
            CheckedWriter.unwritten += 1
            previous = read.claim_status(claim)
            wanted = claim_status(
                result.entry(uid),
                result.pending.get(uid),
                previous,
                meta.get("generation"),
                now,
                deleting=bool(meta.get("deletionTimestamp")),
                problem=problems.get(uid),
                awaiting_devices=result.awaiting_devices.get(uid),
                envelope_uid=result.envelope_uid or None,
            )
            assert wanted == previous, f"{meta['name']} counted as mirrored, but is not"
        return mirrored, rewritten


def writer(claims: Claims) -> CheckedWriter:
    made = CheckedWriter(claims, lambda *_: None)  # type: ignore[arg-type]
    made.queue_reason_after = timedelta(0)
    return made


def history(seed: int, monkeypatch: pytest.MonkeyPatch, steps: int = 40) -> None:
    rnd = random.Random(seed)
    claims = Claims(rnd)

    async def get_object(client: Any, kind: Any, name: str, namespace: str | None) -> Any:
        body = claims.bodies.get(name)
        return copy.deepcopy(body) if body else None

    monkeypatch.setattr(ledger_writer, "get_object", get_object)  # the writer's fresh reads
    policy = EnvelopePolicy(max_active_claims=rnd.choice([2, 3, 10]))
    spec = ReservationEnvelopeSpec.model_validate(
        {"capacity": {"tokens": "100"}, "policy": policy.model_dump(by_alias=True)}
    )
    envelope = EnvelopeFacts(spec=spec, created_at=T0, name="env", uid="env-uid")
    status = ReservationEnvelopeStatus()
    writers = [writer(claims)]
    now, made, seen = T0, 0, None
    for _ in range(steps):
        roll, names = rnd.random(), list(claims.bodies)
        if roll < 0.25 or not names:
            made += 1
            name = f"c{made}"
            lease = {"durationSeconds": rnd.choice([30, 60, 300])} if rnd.random() < 0.5 else {}
            claim_spec = BranchClaimSpec(
                envelope="env", requests={"tokens": str(rnd.choice([10, 30, 50]))}, lease=lease
            )
            claims.version += 1
            claims.bodies[name] = {
                "metadata": {
                    "name": name, "namespace": "ns", "uid": f"u-{name}",
                    "resourceVersion": str(claims.version), "generation": 1,
                    "creationTimestamp": stamp(now), "finalizers": ["reservoir.dev/claim"],
                },
                "spec": claim_spec.model_dump(mode="json", by_alias=True, exclude_none=True),
            }  # fmt: skip
        elif roll < 0.6:
            body = claims.bodies[rnd.choice(names)]
            asked = dict(body["spec"])
            move = rnd.choice(["dispatch", "cancel", "usage", "final", "delete", "touch"])
            if move == "dispatch":
                asked["dispatch"] = True
            elif move == "cancel":
                asked["cancel"] = True
            elif move == "usage" and not asked.get("final"):
                asked["usage"] = {"tokens": str(rnd.randint(0, 60))}
            elif move == "final" and not asked.get("final"):
                asked.update(final=True, outcome=rnd.choice(["Succeeded", "Failed"]))
            elif move == "delete":
                body["metadata"]["deletionTimestamp"] = stamp(now)
            if asked != body["spec"]:
                body["spec"] = asked
                body["metadata"]["generation"] += 1
            claims.moved(body)
        elif roll < 0.7:
            now += timedelta(seconds=rnd.choice([1, 10, 40, 100, 400]))
        elif roll < 0.75:  # a replica starts (and maybe another stops): its memory is empty
            writers.append(writer(claims))
            if rnd.random() < 0.5:
                writers.pop(0)
        elif roll < 0.8:
            claims.refusing = rnd.choice([0.0, 0.3])
        # A pass, by one of the replicas, on the claims as listed or on a stale copy.
        listed = [copy.deepcopy(body) for body in claims.bodies.values()]
        stale = seen is not None and rnd.random() < 0.3
        if stale:
            assert seen is not None
            listed = [copy.deepcopy(seen.get(c["metadata"]["name"], c)) for c in listed]
        seen = {c["metadata"]["name"]: copy.deepcopy(c) for c in claims.bodies.values()}
        facts = [read.claim_facts(c, None, []) for c in listed]
        valid = [f for f in facts if not isinstance(f, read.InvalidClaim)]
        try:
            result = reconcile(envelope, status, valid, now, {}, {}, not stale, None)
        except (ClaimViewBehindError, EnvelopeBehindError):
            continue
        status = result.status  # the envelope's write lands
        asyncio.run(rnd.choice(writers)._mirror("ns", "env", listed, result, now, {}))
        for name, body in list(claims.bodies.items()):  # finalizers of settled claims go
            uid = body["metadata"]["uid"]
            if not body["metadata"].get("deletionTimestamp"):
                continue
            line = result.entry(uid)
            if line is not None and (not line.phase.terminal or counts(line)):
                continue
            if uid not in result.status.entries:
                del claims.bodies[name]


def test_every_claim_the_mirror_passes_by_already_says_what_the_ledger_says(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    CheckedWriter.unwritten = 0
    for seed in range(40):
        history(seed, monkeypatch)
    assert CheckedWriter.unwritten > 1000, "the histories must reach the pass-by often"
