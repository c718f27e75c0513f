"""metrics_auth's decisions and its cache, over a client that answers the two reviews as
the API server would (the real API server: tests/integration/test_metrics.py)."""

from __future__ import annotations

import asyncio
from typing import Any

from lightkube.models.authentication_v1 import TokenReviewStatus, UserInfo
from lightkube.models.authorization_v1 import SubjectAccessReviewStatus
from lightkube.resources.authentication_v1 import TokenReview
from lightkube.resources.authorization_v1 import SubjectAccessReview

from reservoir.metrics_auth import MetricsAuth


class Reviews:
    """Tokens "reader" (allowed) and "tenant" (authenticated, not allowed)."""

    def __init__(self) -> None:
        self.asked: list[str] = []

    async def create(self, obj: Any) -> Any:
        if isinstance(obj, TokenReview):
            self.asked.append("token")
            token = obj.spec.token
            known = token in ("reader", "tenant")
            user = UserInfo(username=f"system:serviceaccount:ns:{token}") if known else None
            return TokenReview(
                spec=obj.spec, status=TokenReviewStatus(authenticated=known, user=user)
            )
        assert isinstance(obj, SubjectAccessReview)
        self.asked.append("access")
        attributes = obj.spec.nonResourceAttributes
        assert attributes is not None and attributes.path == "/metrics"
        allowed = str(obj.spec.user).endswith(":reader")
        return SubjectAccessReview(spec=obj.spec, status=SubjectAccessReviewStatus(allowed=allowed))


def check(auth: MetricsAuth, header: str | None) -> int:
    return asyncio.run(auth.check(header)).status


def test_only_an_authenticated_and_authorized_token_reads_the_metrics() -> None:
    auth = MetricsAuth(Reviews())
    assert check(auth, None) == 401
    assert check(auth, "Basic dXNlcjpwYXNz") == 401
    assert check(auth, "Bearer ") == 401
    assert check(auth, "Bearer forged") == 401
    assert check(auth, "Bearer tenant") == 403
    assert check(auth, "Bearer reader") == 200


def test_answers_are_kept_per_token_so_scrapes_do_not_load_the_api_server() -> None:
    reviews = Reviews()
    auth = MetricsAuth(reviews)
    for _ in range(5):
        assert check(auth, "Bearer reader") == 200
    assert reviews.asked == ["token", "access"]
