"""The API server's own count of each client's requests, from its audit log.

The benchmark cluster runs with ``LocalCluster(..., audit="all")``: every request is logged
once, at Metadata level, when its response completes (JSON lines, written before the
response in blocking mode). A scenario notes the log's size before and after it runs
(`mark`) and reads the slice in between, filtered by user (each client has a certificate
of its own: see identities.py) and, optionally, by namespace and by the time the request
was received.
"""

from __future__ import annotations

import json
from collections import Counter
from collections.abc import Iterable, Iterator
from dataclasses import dataclass
from datetime import datetime
from pathlib import Path
from typing import Any

READS = frozenset({"get", "list", "watch"})
WRITES = frozenset({"create", "update", "patch", "delete", "deletecollection"})


@dataclass(frozen=True)
class Request:
    user: str
    verb: str
    resource: str  # "branchclaims", "reservationenvelopes/status", "leases", ...
    namespace: str
    code: int  # 0 when the response never completed (a watch still open)
    received: float  # the API server's clock, seconds since the epoch

    @property
    def kind(self) -> str:
        return "read" if self.verb in READS else "write" if self.verb in WRITES else "other"


def mark(path: Path) -> int:
    """Where the log ends now: the start (or end) of a scenario's slice."""
    try:
        return path.stat().st_size
    except FileNotFoundError:
        return 0


def _timestamp(value: str | None) -> float:
    if not value:
        return 0.0
    return datetime.fromisoformat(value.replace("Z", "+00:00")).timestamp()


def requests(
    path: Path,
    users: Iterable[str] | None,
    start: int = 0,
    end: int | None = None,
    namespace: str | None = None,
    window: tuple[float, float] | None = None,
) -> list[Request]:
    """The requests of `users` (None: everyone's) logged between byte offsets `start` and
    `end`, once each (by audit ID), in `namespace` (None: any, cluster-scoped ones
    included) and received within `window` (epoch seconds, inclusive) if given."""
    wanted = None if users is None else set(users)
    needles = [f'"username":"{user}"'.encode() for user in wanted or ()]
    found: dict[str, Request] = {}
    for line in _lines(path, start, end):
        if needles and not any(needle in line for needle in needles):
            continue  # cheap: most lines are other clients'
        event = json.loads(line)
        user = event.get("user", {}).get("username", "")
        if wanted is not None and user not in wanted:
            continue
        ref = event.get("objectRef") or {}
        if namespace is not None and ref.get("namespace") != namespace:
            continue
        received = _timestamp(event.get("requestReceivedTimestamp"))
        if window is not None and not window[0] <= received <= window[1]:
            continue
        resource = ref.get("resource") or _nonresource(event)
        if ref.get("subresource"):
            resource = f"{resource}/{ref['subresource']}"
        code = int((event.get("responseStatus") or {}).get("code") or 0)
        previous = found.get(event["auditID"])
        if previous is not None and (previous.code or not code):
            continue
        found[event["auditID"]] = Request(
            user, event.get("verb", ""), resource, ref.get("namespace", ""), code, received
        )
    return list(found.values())


def _nonresource(event: dict[str, Any]) -> str:
    uri = str(event.get("requestURI", ""))
    return uri.split("?", 1)[0] or "?"


def _lines(path: Path, start: int, end: int | None) -> Iterator[bytes]:
    if not path.exists():
        return
    with path.open("rb") as log:
        log.seek(start)
        remaining = None if end is None else max(0, end - start)
        while remaining is None or remaining > 0:
            line = log.readline() if remaining is None else log.readline(remaining)
            if not line:
                return
            if remaining is not None:
                remaining -= len(line)
            if line.endswith(b"\n"):
                yield line


def tally(found: list[Request], per: int | float | None = None) -> dict[str, Any]:
    """Totals by kind, verb and resource, and by response code; with `per` (claims,
    workloads), each also divided by it."""
    by_request = Counter(f"{r.verb} {r.resource}" for r in found)
    by_kind = Counter(r.kind for r in found)
    codes = Counter(str(r.code) for r in found)
    result: dict[str, Any] = {
        "total": len(found),
        "reads": by_kind["read"],
        "writes": by_kind["write"],
        "by_verb_resource": dict(sorted(by_request.items(), key=lambda kv: -kv[1])),
        "codes": dict(sorted(codes.items())),
        "failures_by_request": dict(
            sorted(
                Counter(f"{r.code} {r.verb} {r.resource}" for r in found if r.code >= 400).items(),
                key=lambda kv: -kv[1],
            )
        ),
        "conflicts_409": codes.get("409", 0),
        # The claims' writers' compare-and-swaps are JSON patches with `test` operations:
        # a failed test (the object moved) answers 422, as a refusal by validation does.
        "failed_tests_422": sum(1 for r in found if r.code == 422 and r.verb == "patch"),
        "throttled_429": codes.get("429", 0),
    }
    if per:
        result["per"] = per
        result["per_unit"] = {
            "total": len(found) / per,
            "reads": by_kind["read"] / per,
            "writes": by_kind["write"] / per,
            "conflicts_409": codes.get("409", 0) / per,
            "failed_tests_422": result["failed_tests_422"] / per,
            "by_verb_resource": {k: v / per for k, v in result["by_verb_resource"].items()},
        }
    return result


def count(found: list[Request], verbs: Iterable[str], resource: str) -> int:
    verbs = set(verbs)
    return sum(1 for r in found if r.verb in verbs and r.resource == resource)
