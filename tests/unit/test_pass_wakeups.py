"""When a pass asks for the next without news (`Reconciliation.wake_at`). Since an
envelope's daemon makes a pass without news only every few minutes (handlers/envelopes.
PassSchedule), whatever the ledger waits for that no event announces must name its moment,
and no moment already past may be named (the daemon would pass again at once, forever)."""

from __future__ import annotations

import asyncio
import copy
import random
from datetime import timedelta
from decimal import Decimal
from types import SimpleNamespace
from typing import Any

import pytest
from lightkube import ApiError
from lightkube.models.meta_v1 import Status

from reservoir.core.model import (
    ClaimPhase,
    ProviderState,
    ReservationEnvelopeSpec,
    ReservationEnvelopeStatus,
)
from reservoir.core.provider import OBJECT_LOOKUP_SECONDS, ProviderAnswer
from reservoir.core.reconcile import EnvelopeFacts, Reconciliation, reconcile
from reservoir.k8s import devices, ledger_writer
from reservoir.k8s import facts as read
from reservoir.k8s.ledger_writer import RETRY_REFUSED_SECONDS
from tests.unit import test_mirror_skips
from tests.unit.sim import T0, Sim
from tests.unit.test_mirror_skips import stamp


class Claims(test_mirror_skips.Claims):
    """The in-memory claims of test_mirror_skips, refusing every status write with a code."""

    refuse_with: int | None = None

    async def patch(self, kind: Any, name: str, ops: list[dict[str, Any]], **_: Any) -> Any:
        if self.refuse_with is not None:
            raise ApiError(status=Status(code=self.refuse_with, message="try again later"))
        return await super().patch(kind, name, ops)


def test_a_lapsed_lease_waiting_for_a_pod_that_may_still_start_names_no_moment() -> None:
    sim = Sim(default_lease_seconds=30)
    sim.create("a", commitPoint="PodRunning").reconcile()
    sim.pod("a", scheduled=False).reconcile()
    sim.tick(31).reconcile()
    assert sim.phase("a") is ClaimPhase.TENTATIVE  # the pod may still start: R stays held
    for _ in range(3):
        wake_at = sim.last.wake_at
        assert wake_at is None or wake_at > sim.now, "a moment already past: a pass at once"
        sim.tick(0.05).reconcile()


def test_a_lease_that_has_not_ended_is_still_a_moment() -> None:
    sim = Sim(default_lease_seconds=30)
    sim.create("a").reconcile()
    assert sim.last.wake_at == sim.entry("a").expires_at


def gaps_between_lookups(sim: Sim, lookups: int = 12) -> list[timedelta]:
    """The provider says Running each time; the next pass comes at the moment asked."""
    gaps = []
    for _ in range(lookups):
        sim.provider("a", ProviderAnswer(ProviderState.RUNNING)).reconcile()
        assert sim.last.wake_at is not None
        gaps.append(sim.last.wake_at - sim.now)
        sim.now = sim.last.wake_at
    return gaps


def test_an_object_named_by_upstream_ref_is_looked_at_again_within_half_a_minute() -> None:
    """Nothing watches a Pod or Job named by `upstream.ref`: the backoff for HTTP providers
    (up to providerLookupMaxSeconds) must not make its end wait minutes."""
    sim = Sim(default_lease_seconds=30, ambiguity_deadline_seconds=3600)
    sim.create("a", upstream={"ref": {"kind": "Pod", "name": "train-7"}}, dispatch=True)
    sim.reconcile().tick(31).reconcile()
    assert sim.phase("a") is ClaimPhase.DETACHED
    assert max(gaps_between_lookups(sim)) <= timedelta(seconds=OBJECT_LOOKUP_SECONDS)
    done = ProviderAnswer(ProviderState.SUCCEEDED, usage={"tokens": Decimal(7)})
    sim.provider("a", done).tick(1).reconcile()
    assert sim.phase("a") is ClaimPhase.CONSUMED


def test_an_http_provider_keeps_its_own_backoff() -> None:
    sim = Sim(
        default_lease_seconds=30,
        ambiguity_deadline_seconds=3600,
        provider={"statusURL": "https://provider.example/ops/{operationId}"},
    )
    sim.create("a", upstream={"operationId": "op-1", "supportsStatus": True}, dispatch=True)
    sim.reconcile().tick(31).reconcile()
    assert sim.phase("a") is ClaimPhase.DETACHED
    assert max(gaps_between_lookups(sim)) > timedelta(seconds=OBJECT_LOOKUP_SECONDS)


def test_a_claim_status_write_the_api_server_refuses_is_tried_again_within_half_a_minute(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """A 429 (or any refusal that does not say the copy was stale) is no news: nothing
    would bring the next pass before the daemon's quiet one, minutes later."""
    claims = Claims(random.Random(0))
    writer = ledger_writer.LedgerWriter(claims, lambda *_: None)  # type: ignore[arg-type]
    spec = ReservationEnvelopeSpec.model_validate({"capacity": {"tokens": "100"}})
    envelope = EnvelopeFacts(spec=spec, created_at=T0, name="env", uid="env-uid")
    now = T0
    body = {
        "metadata": {
            "name": "a",
            "namespace": "ns",
            "uid": "u-a",
            "resourceVersion": "1",
            "generation": 1,
            "creationTimestamp": stamp(now),
        },
        "spec": {"envelope": "env", "requests": {"tokens": "10"}},
    }
    claims.bodies["a"] = body

    def one_pass(status: ReservationEnvelopeStatus) -> Reconciliation:
        listed = [copy.deepcopy(b) for b in claims.bodies.values()]
        facts = [read.claim_facts(c, None, []) for c in listed]
        result = reconcile(envelope, status, facts, now, {}, {}, True, None)  # type: ignore[arg-type]
        asyncio.run(writer._mirror("ns", "env", listed, result, now, {}))
        return result

    admitted = one_pass(ReservationEnvelopeStatus())
    assert claims.bodies["a"]["status"]["phase"] == "Tentative"
    now += timedelta(seconds=5)
    body["spec"]["cancel"] = True
    claims.moved(body)
    claims.refuse_with = 429
    released = one_pass(admitted.status)
    assert released.entry("u-a").phase is ClaimPhase.RELEASED
    assert claims.bodies["a"]["status"]["phase"] == "Tentative"  # refused
    assert released.wake_at is not None
    assert released.wake_at <= now + timedelta(seconds=RETRY_REFUSED_SECONDS)


class RefusingDevices(Claims):
    """An API server whose quota refuses every hold object, and whose deletes time out."""

    async def create(self, obj: Any, namespace: str | None = None) -> Any:
        raise ApiError(status=Status(code=403, message="exceeded quota: pods"))

    async def delete(self, kind: Any, name: str, namespace: str | None = None) -> Any:
        raise ApiError(status=Status(code=503, message="etcdserver: request timed out"))


def test_device_holds_refused_and_deletes_failed_are_tried_again_within_half_a_minute(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """A quota freed elsewhere, or an API server back, is no news to the envelope."""
    api = RefusingDevices(random.Random(0))

    async def get_object(client: Any, kind: Any, name: str, namespace: str | None) -> Any:
        body = api.bodies.get(name)
        return copy.deepcopy(body) if body else None

    monkeypatch.setattr(devices, "get_object", get_object)
    holder = devices.DeviceHolder(api, None)  # type: ignore[arg-type]
    writer = ledger_writer.LedgerWriter(api, lambda *_: None, devices=holder)  # type: ignore[arg-type]
    spec = ReservationEnvelopeSpec.model_validate({"capacity": {"nvidia.com/gpu": "2"}})
    envelope = EnvelopeFacts(spec=spec, created_at=T0, name="env", uid="env-uid")
    api.bodies["g1"] = {
        "metadata": {
            "name": "g1",
            "namespace": "ns",
            "uid": "u-g1",
            "resourceVersion": "1",
            "generation": 1,
            "creationTimestamp": stamp(T0),
        },
        "spec": {"envelope": "env", "requests": {"nvidia.com/gpu": "1"}},
    }
    status, now = ReservationEnvelopeStatus(), T0
    for _ in range(3):  # refused the first time (news: its reason), then the same again
        listed = [copy.deepcopy(b) for b in api.bodies.values()]
        facts = [read.claim_facts(c, None, []) for c in listed]
        result = reconcile(envelope, status, facts, now, holder.facts({}, {}), {}, True, None)  # type: ignore[arg-type]
        status = result.status
        fetched = SimpleNamespace(
            resource_claims={}, placeholders={}, pods={}, now=now,
            by_uid={c["metadata"]["uid"]: c for c in listed},
        )  # fmt: skip
        asyncio.run(writer._hold_devices(fetched, result))  # type: ignore[arg-type]
        assert result.wake_at is not None
        assert result.wake_at <= now + timedelta(seconds=RETRY_REFUSED_SECONDS)
        now += timedelta(seconds=1)
    # A settled claim's ResourceClaim that could not be deleted, by a writer that knows of
    # no refused hold (so only the failed delete can bring the next pass).
    writer = ledger_writer.LedgerWriter(
        api,  # type: ignore[arg-type]
        lambda *_: None,
        devices=devices.DeviceHolder(api, None),  # type: ignore[arg-type]
    )
    held = {"metadata": {"name": "reservoir-u-g1", "namespace": "ns", "labels": {}}, "status": {}}
    gone = Reconciliation(status=ReservationEnvelopeStatus(), now=now)
    fetched = SimpleNamespace(
        resource_claims={"u-g1": held}, placeholders={}, pods={}, now=now, by_uid={}
    )
    asyncio.run(writer._hold_devices(fetched, gone))  # type: ignore[arg-type]
    assert gone.wake_at is not None
    assert gone.wake_at <= now + timedelta(seconds=RETRY_REFUSED_SECONDS)
