"""`get_object` reads with a LIST by name and falls back to a GET when the LIST is refused.
A reader allowed only `get` is refused every LIST: after the first 403 it reads with GETs
alone (found by review: two requests per read, on every read)."""

from __future__ import annotations

import asyncio
from collections.abc import AsyncIterator
from typing import Any

from lightkube import ApiError
from lightkube.models.meta_v1 import Status

from reservoir.k8s.resources import BranchClaim, ReservationEnvelope, get_object


def refusal(code: int) -> ApiError:
    return ApiError(status=Status(code=code, reason="Refused", message="refused (fake)"))


class GetOnlyClient:
    """A client whose LISTs answer `list_code` while `refusing`, and whose GETs work."""

    def __init__(self, list_code: int) -> None:
        self.list_code = list_code
        self.refusing = True
        self.calls: list[tuple[str, str]] = []

    def list(self, kind: Any, namespace: str, fields: Any) -> AsyncIterator[dict[str, Any]]:
        self.calls.append(("list", kind.__name__))

        async def listing() -> AsyncIterator[dict[str, Any]]:
            if self.refusing:
                raise refusal(self.list_code)
            yield {"metadata": {"name": fields["metadata.name"]}}

        return listing()

    async def get(self, kind: Any, name: str, namespace: str) -> dict[str, Any]:
        self.calls.append(("get", kind.__name__))
        return {"metadata": {"name": name}}


def reads(client: GetOnlyClient, kinds: list[Any]) -> list[dict[str, Any] | None]:
    async def run() -> list[dict[str, Any] | None]:
        return [await get_object(client, kind, "x", "ns") for kind in kinds]  # type: ignore[arg-type]

    return asyncio.run(run())


def test_after_a_403_the_client_reads_that_kind_with_gets_only() -> None:
    client = GetOnlyClient(403)
    found = reads(client, [BranchClaim, BranchClaim, BranchClaim])
    assert found == [{"metadata": {"name": "x"}}] * 3
    assert client.calls == [
        ("list", "BranchClaim"),
        ("get", "BranchClaim"),
        ("get", "BranchClaim"),
        ("get", "BranchClaim"),
    ]


def test_a_403_for_one_kind_leaves_the_others_read_by_list() -> None:
    client = GetOnlyClient(403)
    reads(client, [BranchClaim])
    client.refusing = False
    reads(client, [ReservationEnvelope])
    assert client.calls[-1] == ("list", "ReservationEnvelope")


def test_a_429_is_not_remembered() -> None:
    # 429: the watch cache is (re)initializing; LISTs work again once it has.
    client = GetOnlyClient(429)
    reads(client, [BranchClaim])
    client.refusing = False
    reads(client, [BranchClaim])
    assert client.calls == [
        ("list", "BranchClaim"),
        ("get", "BranchClaim"),
        ("list", "BranchClaim"),
    ]
