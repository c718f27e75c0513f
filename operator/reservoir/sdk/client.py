"""The Reservoir SDK for orchestrators and workers.

Every write is fenced by the resourceVersion the caller last read: the API server answers
409 if the claim moved since. A 409 alone does not mean "fenced", because the operator's
status writes bump resourceVersion too, so the SDK re-reads, re-checks what the action
requires (not settled, same attempt, lease still valid) and retries; only when that no
longer holds does the caller get `StaleClaimError`.

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
import os
from collections.abc import Callable, Coroutine, Mapping
from datetime import UTC, datetime, timedelta
from types import TracebackType
from typing import Any, TypeVar

from lightkube import ApiError, AsyncClient, KubeConfig
from lightkube.models.meta_v1 import ObjectMeta, OwnerReference
from lightkube.resources.coordination_v1 import Lease
from lightkube.types import PatchType

from reservoir.core.model import (
    API_GROUP,
    API_VERSION,
    TERMINAL_PHASES,
    BranchClaimSpec,
    ClaimPhase,
    ReservationEnvelopeStatus,
)
from reservoir.core.quantity import format_quantity, parse_resources
from reservoir.k8s.facts import as_dict
from reservoir.k8s.resources import CLAIM_LABEL, ENVELOPE_LABEL, BranchClaim, ReservationEnvelope
from reservoir.sdk.errors import (
    ClaimNotFoundError,
    LeaseUncertainError,
    ReservoirError,
    StaleClaimError,
)
from reservoir.sdk.views import ClaimView, EnvelopeView

FENCED_RETRIES = 5
# A worker stops starting irreversible work this long before its lease's expiry.
LEASE_SAFETY_MARGIN = timedelta(seconds=2)

Check = Callable[[ClaimView], str | None]  # a reason the action is no longer valid, or None


def _not_settled(view: ClaimView) -> str | None:
    if view.phase in TERMINAL_PHASES:
        return f"the claim already settled as {view.phase.value}"
    return None


class AsyncReservoir:
    def __init__(
        self,
        namespace: str | None = None,
        kubeconfig: str | None = None,
        holder: str | None = None,
        client: AsyncClient | None = None,
    ) -> None:
        config = KubeConfig.from_file(kubeconfig) if kubeconfig else None
        self.client = client or AsyncClient(config=config, field_manager="reservoir-sdk")
        self.namespace = namespace or self.client.namespace
        self.holder = holder or f"{os.uname().nodename}/{os.getpid()}"

    async def __aenter__(self) -> AsyncReservoir:
        return self

    async def __aexit__(self, *exc: object) -> None:
        await self.close()

    async def close(self) -> None:
        await self.client.close()

    # --- reading ------------------------------------------------------------------------

    async def get(self, claim: ClaimView | str) -> ClaimView:
        name = claim.name if isinstance(claim, ClaimView) else claim
        try:
            obj = await self.client.get(BranchClaim, name, namespace=self.namespace)
        except ApiError as error:
            if error.status.code == 404:
                raise ClaimNotFoundError(f"branchclaim/{name} not found") from None
            raise
        return ClaimView.from_api(as_dict(obj))

    async def ledger(self, envelope: str) -> EnvelopeView:
        obj = await self.client.get(ReservationEnvelope, envelope, namespace=self.namespace)
        body = as_dict(obj)
        status = ReservationEnvelopeStatus.model_validate(body.get("status") or {})
        return EnvelopeView(name=envelope, namespace=self.namespace, status=status)

    async def wait(
        self,
        claim: ClaimView | str,
        phase: str | ClaimPhase | None = None,
        condition: str | None = None,
        within: float = 60.0,
        interval: float = 0.2,
    ) -> ClaimView:
        """Until the claim reaches `phase` or `condition` is True; TimeoutError otherwise."""
        loop = asyncio.get_running_loop()
        deadline = loop.time() + within
        while True:
            view = await self.get(claim)
            if (phase is None or view.phase == phase) and (
                condition is None or view.condition(condition)
            ):
                return view
            if loop.time() > deadline:
                raise TimeoutError(
                    f"branchclaim/{view.name} is {view.phase.value}, "
                    f"not {phase or condition}, after {within:.0f}s"
                )
            await asyncio.sleep(interval)

    # --- the verbs ----------------------------------------------------------------------

    async def hold(
        self,
        envelope: str,
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
    ) -> ClaimView:
        """Create a claim on `envelope` (dispatch=True: reserve and commit in one step)."""
        spec = BranchClaimSpec(
            envelope=envelope,
            branch=branch,
            attempt=attempt,
            requests=parse_resources(requests),
            priority=priority,
            commit_point=commit_point,
            intent="Dispatch" if dispatch else "Hold",
            lease={"duration_seconds": lease_seconds, "holder": self.holder},
            upstream=upstream or {},
        )
        metadata = ObjectMeta(
            name=name,
            generateName=None if name else f"{envelope}-{branch}-"[:58],
            namespace=self.namespace,
            labels={ENVELOPE_LABEL: envelope},
        )
        created = await self.client.create(BranchClaim(metadata=metadata, spec=spec.to_api()))
        return ClaimView.from_api(as_dict(created))

    async def dispatch(self, claim: ClaimView) -> ClaimView:
        """Cross the commit point. Refused if the lease cannot be confirmed: a worker that
        is unsure of its lease must not start irreversible work."""

        def may_dispatch(view: ClaimView) -> str | None:
            if view.spec.intent == "Cancel":
                return "the branch was cancelled"
            if view.phase not in (ClaimPhase.PENDING, ClaimPhase.TENTATIVE):
                return _not_settled(view) or (
                    None if view.spec.intent == "Dispatch" else f"claim is {view.phase.value}"
                )
            return None

        problem = may_dispatch(claim)
        if problem:
            raise StaleClaimError(f"branchclaim/{claim.name}: {problem}")
        self._require_lease(claim)
        return await self._fenced(claim, {"intent": "Dispatch"}, may_dispatch)

    async def cancel(self, claim: ClaimView) -> ClaimView:
        """Prune the branch: released at once before the commit point, a cancel request
        (waiting for final usage) after it."""
        return await self._fenced(claim, {"intent": "Cancel"}, _not_settled)

    async def report_usage(self, claim: ClaimView, usage: Mapping[str, str | int]) -> ClaimView:
        """Report cumulative usage so far (never a delta)."""
        return await self._fenced(claim, {"usage": _quantities(usage)}, _not_settled)

    async def finish(
        self, claim: ClaimView, usage: Mapping[str, str | int], outcome: str = "Succeeded"
    ) -> ClaimView:
        """The final, confirmed usage and the outcome: the claim settles (commit C,
        return R − C)."""
        patch = {"usage": _quantities(usage), "final": True, "outcome": outcome}
        return await self._fenced(claim, patch, _not_settled)

    async def renew(self, claim: ClaimView, confirm_timeout: float | None = 10.0) -> ClaimView:
        """Heartbeat the claim's Lease, then (by default) wait for the operator to grant the
        renewal. A renewal that cannot be confirmed raises `LeaseUncertainError`: stop
        starting irreversible work until the claim is read again."""
        view = await self.get(claim)
        problem = _not_settled(view) or (
            "the lease already lapsed (Detached)" if view.phase == ClaimPhase.DETACHED else None
        )
        if problem:
            raise StaleClaimError(f"branchclaim/{view.name}: cannot renew: {problem}")
        before = view.renewals
        await self._beat(view)
        if confirm_timeout is None:
            return view
        loop = asyncio.get_running_loop()
        deadline = loop.time() + confirm_timeout
        while loop.time() < deadline:
            await asyncio.sleep(0.1)
            view = await self.get(claim)
            if view.renewals > before:
                return view
            if view.phase in TERMINAL_PHASES or view.phase == ClaimPhase.DETACHED:
                break
        raise LeaseUncertainError(
            f"branchclaim/{view.name}: renewal not confirmed (phase {view.phase.value}); "
            "do not start irreversible work"
        )

    # --- internals ----------------------------------------------------------------------

    def _require_lease(self, view: ClaimView) -> None:
        expires = view.expires_at
        if expires is not None and datetime.now(UTC) > expires - LEASE_SAFETY_MARGIN:
            raise LeaseUncertainError(
                f"branchclaim/{view.name}: lease expires at {expires.isoformat()}; renew and "
                "re-read before dispatching"
            )

    async def _fenced(
        self, claim: ClaimView, spec_patch: Mapping[str, Any], requires: Check
    ) -> ClaimView:
        view = claim
        for _ in range(FENCED_RETRIES):
            problem = requires(view)
            if problem:
                raise StaleClaimError(f"branchclaim/{view.name}: {problem}")
            body = {"metadata": {"resourceVersion": view.resource_version}, "spec": spec_patch}
            try:
                patched = await self.client.patch(
                    BranchClaim,
                    view.name,
                    body,
                    namespace=self.namespace,
                    patch_type=PatchType.MERGE,
                )
                return ClaimView.from_api(as_dict(patched))
            except ApiError as error:
                if error.status.code == 409:
                    fresh = await self.get(view.name)
                    if fresh.uid != view.uid or fresh.spec.attempt != view.spec.attempt:
                        raise StaleClaimError(
                            f"branchclaim/{view.name} is now a different claim"
                        ) from None
                    view = fresh
                    continue
                if error.status.code == 422:
                    message = f"refused by the API server: {error.status.message}"
                    raise ReservoirError(message) from None
                raise
        raise StaleClaimError(
            f"branchclaim/{view.name}: kept changing under {FENCED_RETRIES} tries"
        )

    async def _beat(self, view: ClaimView) -> None:
        now = datetime.now(UTC).strftime("%Y-%m-%dT%H:%M:%S.%fZ")
        try:
            lease = await self.client.get(Lease, view.name, namespace=self.namespace)
        except ApiError as error:
            if error.status.code != 404:
                raise
            lease = Lease(
                metadata=ObjectMeta(
                    name=view.name,
                    namespace=self.namespace,
                    labels={ENVELOPE_LABEL: view.spec.envelope, CLAIM_LABEL: view.name},
                    ownerReferences=[
                        OwnerReference(
                            apiVersion=f"{API_GROUP}/{API_VERSION}",
                            kind="BranchClaim",
                            name=view.name,
                            uid=view.uid,
                        )
                    ],
                ),
                spec={"holderIdentity": self.holder, "renewTime": now},  # type: ignore[arg-type]
            )
            await self.client.create(lease)
            return
        assert lease.spec is not None
        if lease.spec.holderIdentity not in (None, self.holder):
            lease.spec.leaseTransitions = (lease.spec.leaseTransitions or 0) + 1
        lease.spec.holderIdentity = self.holder
        lease.spec.renewTime = now  # type: ignore[assignment]
        try:
            await self.client.replace(lease)  # carries the resourceVersion it read
        except ApiError as error:
            if error.status.code == 409:
                raise LeaseUncertainError(
                    f"lease/{view.name} changed under us: another holder may own it"
                ) from None
            raise


def _quantities(values: Mapping[str, str | int]) -> dict[str, str]:
    return {name: format_quantity(amount) for name, amount in parse_resources(values).items()}


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

    def _run(self, coroutine: Coroutine[Any, Any, T]) -> T:
        return self._loop.run_until_complete(coroutine)

    @property
    def namespace(self) -> str:
        return self._async.namespace

    def get(self, claim: ClaimView | str) -> ClaimView:
        return self._run(self._async.get(claim))

    def ledger(self, envelope: str) -> EnvelopeView:
        return self._run(self._async.ledger(envelope))

    def wait(
        self,
        claim: ClaimView | str,
        phase: str | ClaimPhase | None = None,
        condition: str | None = None,
        within: float = 60.0,
    ) -> ClaimView:
        return self._run(self._async.wait(claim, phase, condition, within))

    def hold(
        self, envelope: str, branch: str, requests: Mapping[str, str | int], **options: Any
    ) -> ClaimView:
        return self._run(self._async.hold(envelope, branch, requests, **options))

    def dispatch(self, claim: ClaimView) -> ClaimView:
        return self._run(self._async.dispatch(claim))

    def cancel(self, claim: ClaimView) -> ClaimView:
        return self._run(self._async.cancel(claim))

    def report_usage(self, claim: ClaimView, usage: Mapping[str, str | int]) -> ClaimView:
        return self._run(self._async.report_usage(claim, usage))

    def finish(
        self, claim: ClaimView, usage: Mapping[str, str | int], outcome: str = "Succeeded"
    ) -> ClaimView:
        return self._run(self._async.finish(claim, usage, outcome))

    def renew(self, claim: ClaimView, confirm_timeout: float | None = 10.0) -> ClaimView:
        return self._run(self._async.renew(claim, confirm_timeout))

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
    # The async client must be created inside the loop that will run it.
    return AsyncReservoir(namespace=namespace, kubeconfig=kubeconfig, holder=holder)
