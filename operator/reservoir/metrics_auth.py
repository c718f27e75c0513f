"""Who may read /metrics: authenticated and authorized by the API server, as
controller-runtime's secure metrics and kube-rbac-proxy do.

The metrics name every tenant's namespaces and envelopes. With `--metrics-auth=kubernetes`
(the chart's default) a scrape must carry a bearer token; the API server says whose it is
(a TokenReview) and whether that user may `get` the non-resource URL `/metrics` (a
SubjectAccessReview). The chart's ClusterRole `<release>-metrics-reader` grants that
(bind it to Prometheus' ServiceAccount), and grants the operator the two `create`s.
Answers are kept for `CACHE_SECONDS` per token (by its SHA-256), so that a scrape every
15 s costs the API server two requests a minute at most.
"""

from __future__ import annotations

import hashlib
import logging
import time
from dataclasses import dataclass, field
from typing import Protocol

from lightkube.models.authentication_v1 import TokenReviewSpec
from lightkube.models.authorization_v1 import NonResourceAttributes, SubjectAccessReviewSpec
from lightkube.resources.authentication_v1 import TokenReview
from lightkube.resources.authorization_v1 import SubjectAccessReview

logger = logging.getLogger(__name__)

CACHE_SECONDS = 60.0
MAX_CACHED = 256
PATH = "/metrics"


class Creates(Protocol):
    async def create(self, obj: TokenReview | SubjectAccessReview) -> object: ...


@dataclass
class Verdict:
    status: int  # 200, 401 or 403
    why: str
    at: float


@dataclass
class MetricsAuth:
    """Decides a request's access to /metrics from its Authorization header."""

    client: Creates
    _cache: dict[str, Verdict] = field(default_factory=dict)

    async def check(self, authorization: str | None) -> Verdict:
        scheme, _, token = (authorization or "").partition(" ")
        token = token.strip()
        if scheme.lower() != "bearer" or not token:
            return Verdict(401, "a bearer token is required", time.monotonic())
        key = hashlib.sha256(token.encode()).hexdigest()
        now = time.monotonic()
        cached = self._cache.get(key)
        if cached is not None and now - cached.at < CACHE_SECONDS:
            return cached
        verdict = await self._review(token, now)
        if len(self._cache) >= MAX_CACHED:
            self._cache = {k: v for k, v in self._cache.items() if now - v.at < CACHE_SECONDS}
            if len(self._cache) >= MAX_CACHED:
                self._cache.clear()
        self._cache[key] = verdict
        return verdict

    async def _review(self, token: str, now: float) -> Verdict:
        review = await self.client.create(TokenReview(spec=TokenReviewSpec(token=token)))
        status = getattr(review, "status", None)
        user = getattr(status, "user", None) if status is not None else None
        if status is None or not status.authenticated or user is None:
            return Verdict(401, "the token is not valid", now)
        access = await self.client.create(
            SubjectAccessReview(
                spec=SubjectAccessReviewSpec(
                    user=user.username,
                    uid=user.uid,
                    groups=user.groups,
                    extra=user.extra,
                    nonResourceAttributes=NonResourceAttributes(path=PATH, verb="get"),
                )
            )
        )
        allowed = getattr(access, "status", None)
        if allowed is None or not allowed.allowed:
            return Verdict(403, f"{user.username} may not get {PATH}", now)
        return Verdict(200, "", now)
