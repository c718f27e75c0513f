"""The operator's HTTP calls to providers: allow-listed, isolated per call, bounded.

Each call (README "Reconciling with the provider"):
- is checked against the administrator's allow-list (provider_policy), and refused before
  any I/O if its host is not on it, or is loopback, link-local or metadata;
- holds a slot of the global cap and of its namespace's cap, and a token of its
  namespace's rate (provider_gate);
- resolves the host name asynchronously (c-ares through aiodns, never the default thread
  pool, whose few threads one tenant's slow DNS would fill for everyone), within the call's
  deadline, and checks every address the name resolved to;
- connects only to the addresses it checked (the connector's resolver is pinned to them,
  and the socket factory checks the address once more: DNS rebinding cannot slip in a
  second lookup);
- has its own session: no cookie jar (a DummyCookieJar: nothing one tenant's provider sets
  reaches another's request, and a flood of cookies costs nothing), no connection kept
  for another call, no proxy from the environment, no redirect followed, no decompression,
  and a bound on the answer's size, headers included.
Errors are exceptions whose text is for the operator's log; the tenant sees only
"refused by policy" or "unreachable" (providers.py), so that a refusal or a failed
connection tells it nothing about what listens where.
"""

from __future__ import annotations

import asyncio
import logging
import os
import socket
from collections.abc import Mapping
from dataclasses import dataclass, field

import aiohttp
import yarl
from aiohttp.abc import AbstractResolver, ResolveResult
from aiohttp.resolver import AsyncResolver

from reservoir.k8s.provider_gate import CallGate, RateLimitedError
from reservoir.k8s.provider_policy import (
    AllowList,
    RefusedByPolicyError,
    Target,
    always_refused,
    check_resolved,
    check_url,
    parse_address,
)

log = logging.getLogger("reservoir.providers")

DEADLINE_SECONDS = 5.0  # for a whole call: slots, resolution, connection, answer
MAX_ANSWER_BYTES = 64 * 1024

__all__ = [
    "AnswerTooLargeError",
    "BusyError",
    "ProviderHttp",
    "ProviderSettings",
    "RateLimitedError",
    "RefusedByPolicyError",
    "UnreachableError",
]


class UnreachableError(Exception):
    """No answer: resolution, connection or exchange failed, or the deadline passed."""


class BusyError(Exception):
    """The call found no free slot within its deadline (too many calls in flight)."""


class AnswerTooLargeError(Exception):
    """The answer's body is larger than the bound."""


def _split(text: str) -> list[str]:
    return [part for part in text.replace(",", " ").split() if part]


@dataclass(frozen=True)
class ProviderSettings:
    """What the administrator configures (the operator's --provider-* flags, the chart's
    `providers` values)."""

    allow: AllowList = field(default_factory=AllowList)
    max_in_flight: int = 32
    max_in_flight_per_namespace: int = 4
    calls_per_second_per_namespace: float = 2.0
    burst_per_namespace: int = 10
    deadline_seconds: float = DEADLINE_SECONDS
    max_answer_bytes: int = MAX_ANSWER_BYTES

    @classmethod
    def from_env(cls, env: Mapping[str, str] = os.environ) -> ProviderSettings:
        """From the variables the operator's CLI sets (RESERVOIR_PROVIDER_*)."""
        defaults = cls()

        def number(name: str, default: float) -> float:
            text = env.get(f"RESERVOIR_PROVIDER_{name}")
            return float(text) if text else default

        return cls(
            allow=AllowList.parse(_split(env.get("RESERVOIR_PROVIDER_ALLOW", ""))),
            max_in_flight=int(number("MAX_IN_FLIGHT", defaults.max_in_flight)),
            max_in_flight_per_namespace=int(
                number("MAX_IN_FLIGHT_PER_NAMESPACE", defaults.max_in_flight_per_namespace)
            ),
            calls_per_second_per_namespace=number(
                "CALLS_PER_SECOND_PER_NAMESPACE", defaults.calls_per_second_per_namespace
            ),
            burst_per_namespace=int(number("BURST_PER_NAMESPACE", defaults.burst_per_namespace)),
        )


class _PinnedResolver(AbstractResolver):
    """The connector's resolver for one call: the addresses already checked, nothing else
    (the connector never asks DNS again)."""

    def __init__(self, host: str, results: list[ResolveResult]) -> None:
        self.host, self.results = host, results

    async def resolve(
        self, host: str, port: int = 0, family: socket.AddressFamily = socket.AF_INET
    ) -> list[ResolveResult]:
        if host.lower().rstrip(".") != self.host:
            raise OSError(f"no checked address for {host}")
        return [{**r, "port": port} for r in self.results]

    async def close(self) -> None:
        pass


def _checked_socket(addr_info: tuple[int, int, int, str, tuple[object, ...]]) -> socket.socket:
    """The connector's socket factory: the address about to be connected to is checked
    once more (the last line, whatever resolved it)."""
    family, type_, proto, _, sockaddr = addr_info
    address = parse_address(str(sockaddr[0]).split("%", 1)[0])
    if address is None or always_refused(address):
        raise OSError(f"refused to connect to {sockaddr[0]}")
    return socket.socket(family=family, type=type_, proto=proto)


class ProviderHttp:
    """Makes providers' HTTP calls (see the module's docstring)."""

    def __init__(
        self, settings: ProviderSettings | None = None, resolver: AbstractResolver | None = None
    ) -> None:
        self.settings = settings or ProviderSettings()
        self.gate = CallGate(
            max_in_flight=self.settings.max_in_flight,
            max_in_flight_per_namespace=self.settings.max_in_flight_per_namespace,
            calls_per_second_per_namespace=self.settings.calls_per_second_per_namespace,
            burst_per_namespace=self.settings.burst_per_namespace,
        )
        self._resolver = resolver  # default: made in the event loop, at the first call

    async def aclose(self) -> None:
        if self._resolver is not None:
            await self._resolver.close()

    async def get(self, namespace: str, url: str, headers: Mapping[str, str]) -> tuple[int, bytes]:
        """The answer's status code and body (at most max_answer_bytes, else
        AnswerTooLargeError)."""
        code, body = await self._call(namespace, "GET", url, headers, read=True)
        return code, body

    async def post(self, namespace: str, url: str, headers: Mapping[str, str]) -> int:
        """The answer's status code (its body is not read)."""
        code, _ = await self._call(namespace, "POST", url, headers, read=False)
        return code

    async def _call(
        self, namespace: str, method: str, url: str, headers: Mapping[str, str], read: bool
    ) -> tuple[int, bytes]:
        try:
            parsed = yarl.URL(url)
        except (ValueError, TypeError) as error:
            raise RefusedByPolicyError(f"unreadable URL: {error}") from None
        target = check_url(self.settings.allow, url)
        if (parsed.host or "").lower().rstrip(".") != target.host.rstrip("."):
            raise RefusedByPolicyError(f"URL parsers disagree on the host of {url!r}")
        waiting = True
        try:
            async with asyncio.timeout(self.settings.deadline_seconds):
                async with self.gate.call(namespace):
                    waiting = False
                    results = await self._resolve(target)
                    return await self._exchange(method, parsed, target, results, headers, read)
        except TimeoutError:
            if waiting:
                raise BusyError("no free slot within the deadline") from None
            deadline = self.settings.deadline_seconds
            raise UnreachableError(f"no answer within {deadline:g} s") from None
        except (aiohttp.ClientError, OSError) as error:
            raise UnreachableError(f"{type(error).__name__}: {error}") from None

    async def _resolve(self, target: Target) -> list[ResolveResult]:
        """The checked addresses to connect to (an IP literal was checked with the URL)."""
        if target.address is not None:
            return []  # aiohttp connects to a literal without its resolver
        if self._resolver is None:
            self._resolver = AsyncResolver()
        try:
            results = await self._resolver.resolve(target.host, target.port, socket.AF_UNSPEC)
        except OSError as error:
            raise UnreachableError(f"{target.host} did not resolve: {error}") from None
        check_resolved(target.host, [r["host"] for r in results])
        if not results:
            raise UnreachableError(f"{target.host} resolves to no address")
        return results

    async def _exchange(
        self,
        method: str,
        url: yarl.URL,
        target: Target,
        results: list[ResolveResult],
        headers: Mapping[str, str],
        read: bool,
    ) -> tuple[int, bytes]:
        connector = aiohttp.TCPConnector(
            resolver=_PinnedResolver(target.host.rstrip("."), results),
            use_dns_cache=False,
            force_close=True,  # no connection outlives its call, or its tenant
            limit=1,
            socket_factory=_checked_socket,
        )
        async with (
            aiohttp.ClientSession(
                connector=connector,
                cookie_jar=aiohttp.DummyCookieJar(),
                trust_env=False,  # no proxy from the environment
                auto_decompress=False,  # a compressed bomb stays small
                max_field_size=8190,
                max_line_size=8190,
                max_headers=64,
            ) as session,
            session.request(
                method,
                url,
                headers={**headers, "Accept-Encoding": "identity"},
                allow_redirects=False,
            ) as response,
        ):
            if not read:
                return response.status, b""
            body = bytearray()
            async for chunk in response.content.iter_chunked(16 * 1024):
                body += chunk
                if len(body) > self.settings.max_answer_bytes:
                    raise AnswerTooLargeError(f"more than {self.settings.max_answer_bytes} bytes")
            return response.status, bytes(body)
