"""HTTP providers against hostile tenants (issue 21): the administrator's allow-list,
loopback and metadata never called, DNS rebinding, no redirects, no cookies shared between
tenants, resolution that never blocks another tenant, caps and a rate per namespace, and
errors that tell a tenant nothing about what listens where.

The servers are local aiohttp servers on this machine's own address (host_address():
loopback is never called), plus "loopback listeners" on 127.0.0.1 that must never receive
anything."""

from __future__ import annotations

import asyncio
import ipaddress
import socket
from collections.abc import AsyncIterator, Awaitable, Callable
from contextlib import asynccontextmanager
from typing import Any

import pytest
from aiohttp import web
from aiohttp.abc import AbstractResolver, ResolveResult

from reservoir.core.model import BranchClaimSpec, EnvelopePolicy, ProviderState, UpstreamCancel
from reservoir.k8s.provider_gate import CallGate, RateLimitedError
from reservoir.k8s.provider_http import ProviderHttp, ProviderSettings
from reservoir.k8s.provider_policy import (
    AllowList,
    RefusedByPolicyError,
    always_refused,
    check_url,
)
from reservoir.k8s.providers import ProviderClient
from tests.integration.provider_server import host_address

HOST = host_address()
TENANT_ERRORS = {"refused by policy", "unreachable"}


# --- servers ---------------------------------------------------------------------------------


class Recorder:
    """A provider that records what reached it (headers included) and how many calls were
    in flight at once."""

    def __init__(self, delay: float = 0.0) -> None:
        self.delay = delay
        self.requests: list[web.Request] = []
        self.in_flight = 0
        self.most_in_flight = 0
        self.set_cookies: dict[str, list[str]] = {}  # operation -> Set-Cookie values
        self.redirect_to: str | None = None

    async def handle(self, request: web.Request) -> web.StreamResponse:
        self.requests.append(request)
        self.in_flight += 1
        self.most_in_flight = max(self.most_in_flight, self.in_flight)
        try:
            if self.delay:
                await asyncio.sleep(self.delay)
            operation = request.match_info.get("op", "")
            if self.redirect_to is not None:
                raise web.HTTPFound(self.redirect_to)
            response = web.json_response({"operationId": operation, "state": "Running"})
            for cookie in self.set_cookies.get(operation, []):
                response.headers.add("Set-Cookie", cookie)
            return response
        finally:
            self.in_flight -= 1

    def cookies_sent(self) -> list[str]:
        return [r.headers["Cookie"] for r in self.requests if "Cookie" in r.headers]


@asynccontextmanager
async def serve(
    handler: Callable[[web.Request], Awaitable[web.StreamResponse]],
    host: str = HOST,
    port: int = 0,
) -> AsyncIterator[int]:
    """An aiohttp server on host:port (0: a free one); yields its port."""
    app = web.Application()
    app.router.add_route("*", "/operations/{op}", handler)
    app.router.add_route("*", "/{tail:.*}", handler)
    runner = web.AppRunner(app, access_log=None)
    await runner.setup()
    site = web.TCPSite(runner, host, port)
    await site.start()
    try:
        bound = site._server.sockets[0].getsockname()[1]  # type: ignore[union-attr]
        yield int(bound)
    finally:
        await runner.cleanup()


class Listener:
    """A loopback listener: counts the connections it accepts (there must be none)."""

    def __init__(self) -> None:
        self.connections = 0

    def __call__(self, reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        self.connections += 1
        writer.close()


@asynccontextmanager
async def loopback_listener(port: int = 0, host: str = "127.0.0.1") -> AsyncIterator[Listener]:
    listener = Listener()
    server = await asyncio.start_server(listener, host, port)
    listener.port = server.sockets[0].getsockname()[1]  # type: ignore[attr-defined]
    try:
        yield listener
    finally:
        server.close()
        await server.wait_closed()


class ScriptedResolver(AbstractResolver):
    """Answers by host name: a list of addresses per lookup (the last one repeating), or
    a delay first. Counts lookups."""

    def __init__(self, answers: dict[str, list[list[str]]], delays: dict[str, float]) -> None:
        self.answers, self.delays = answers, delays
        self.lookups: list[str] = []

    async def resolve(
        self, host: str, port: int = 0, family: socket.AddressFamily = socket.AF_INET
    ) -> list[ResolveResult]:
        self.lookups.append(host)
        await asyncio.sleep(self.delays.get(host, 0))
        script = self.answers[host]
        addresses = script.pop(0) if len(script) > 1 else script[0]
        return [
            {
                "hostname": host,
                "host": a,
                "port": port,
                "family": socket.AF_INET6 if ":" in a else socket.AF_INET,
                "proto": 0,
                "flags": socket.AI_NUMERICHOST,
            }
            for a in addresses
        ]

    async def close(self) -> None:
        pass


# --- claims and clients ----------------------------------------------------------------------


def claim(operation: str = "op-1") -> BranchClaimSpec:
    return BranchClaimSpec.model_validate(
        {
            "envelope": "wf",
            "branch": "b",
            "requests": {"tokens": "1"},
            "upstream": {"operationId": operation, "supportsStatus": True, "supportsCancel": True},
        }
    )


def policy(base: str) -> EnvelopePolicy:
    return EnvelopePolicy.model_validate(
        {
            "provider": {
                "statusURL": f"{base}/operations/{{operationId}}",
                "cancelURL": f"{base}/operations/{{operationId}}/cancel",
            }
        }
    )


def client(
    allow: list[str], resolver: AbstractResolver | None = None, **settings: Any
) -> ProviderClient:
    http = ProviderHttp(ProviderSettings(allow=AllowList.parse(allow), **settings), resolver)
    return ProviderClient(None, http)  # type: ignore[arg-type]  # no Kubernetes call made


async def look_up(c: ProviderClient, namespace: str, base: str, op: str = "op-1") -> Any:
    return await c.look_up(namespace, claim(op), policy(base))


async def cancel(c: ProviderClient, namespace: str, base: str) -> tuple[bool, str]:
    return await c.forward_cancel(namespace, claim(), policy(base), UpstreamCancel.SUSPEND)


# --- the allow-list --------------------------------------------------------------------------


async def test_nothing_is_called_without_an_allow_list_or_off_it() -> None:
    provider = Recorder()
    async with serve(provider.handle) as port:
        base = f"http://{HOST}:{port}"
        empty = client([])
        got = await look_up(empty, "ns", base)
        assert got.state is ProviderState.UNKNOWN and got.error == "refused by policy"
        assert await cancel(empty, "ns", base) == (False, "not forwarded: refused by policy")
        other = client(["10.99.0.0/16", "inference.example.com"])
        assert (await look_up(other, "ns", base)).error == "refused by policy"
        assert provider.requests == []
        allowed = client([f"{HOST}/32"])
        assert (await look_up(allowed, "ns", base)).state is ProviderState.RUNNING
        assert len(provider.requests) == 1


@pytest.mark.parametrize(
    ("allowed", "url_host"),
    [
        ("127.0.0.0/8", "127.0.0.1"),
        ("127.0.0.0/8", "127.1.2.3"),
        ("0.0.0.0/0", "127.0.0.1"),
        ("::/0", "[::1]"),
        ("::/0", "[::ffff:127.0.0.1]"),
        ("0.0.0.0/8", "0.0.0.0"),
        ("localhost", "localhost"),
        ("*.localhost", "x.localhost"),
    ],
)
async def test_loopback_is_refused_even_when_allow_listed(allowed: str, url_host: str) -> None:
    async with loopback_listener() as listener:
        port = listener.port  # type: ignore[attr-defined]
        resolver = ScriptedResolver({"localhost": [["127.0.0.1"]], "x.localhost": [["::1"]]}, {})
        c = client([allowed], resolver)
        base = f"http://{url_host}:{port}"
        got = await look_up(c, "ns", base)
        assert got.error == "refused by policy"
        assert await cancel(c, "ns", base) == (False, "not forwarded: refused by policy")
        assert listener.connections == 0


@pytest.mark.parametrize(
    "address",
    [
        "169.254.169.254",
        "169.254.0.1",
        "100.100.100.200",
        "fe80::1",
        "fd00:ec2::254",
        "::ffff:169.254.169.254",
        "64:ff9b::a9fe:a9fe",
        "224.0.0.1",
        "255.255.255.255",
    ],
)
def test_link_local_and_metadata_are_refused_even_when_allow_listed(address: str) -> None:
    assert always_refused(ipaddress.ip_address(address))
    allow = AllowList.parse(["0.0.0.0/0", "::/0"])
    host = f"[{address}]" if ":" in address else address
    with pytest.raises(RefusedByPolicyError):
        check_url(allow, f"http://{host}/latest/meta-data/{{operationId}}")


def test_the_allow_list_matches_names_wildcards_and_cidrs() -> None:
    allow = AllowList.parse(["inference.example.com", "*.corp.example", "10.20.0.0/16, "[:-2]])
    assert check_url(allow, "https://inference.example.com/x").port == 443
    assert check_url(allow, "http://a.b.corp.example:8080/x").port == 8080
    assert check_url(allow, "http://10.20.3.4/x").address == ipaddress.ip_address("10.20.3.4")
    for refused in (
        "http://corp.example/x",  # the wildcard is for names under the domain
        "http://evilinference.example.com/x",
        "http://10.21.0.1/x",
        "ftp://inference.example.com/x",
        "http://user@inference.example.com/x",  # credentials (and parser tricks)
        "http://{operationId}.corp.example/x",  # a tenant's operation id picks no host
        "http://inference.example.com\\@10.20.0.1/x",
    ):
        with pytest.raises(RefusedByPolicyError):
            check_url(allow, refused)
    for bad in ("*", "*.", "http://x", "10.0.0.0/33", "a..b", "-a.example"):
        with pytest.raises(ValueError, match="is not"):
            AllowList.parse([bad])
    assert not AllowList.parse([])


async def test_an_operation_id_cannot_choose_the_host() -> None:
    provider = Recorder()
    async with serve(provider.handle) as port:
        c = client(["*.example.com", HOST])
        for template in ("http://{operationId}/status", f"http://{HOST}:{{operationId}}/s"):
            chosen = EnvelopePolicy.model_validate(
                {"provider": {"statusURL": template, "cancelURL": template}}
            )
            for operation in ("a.example.com", str(port), f"{HOST}:{port}"):
                got = await c.look_up("ns", claim(operation), chosen)
                assert got.error == "refused by policy"
                done, text = await c.forward_cancel(
                    "ns", claim(operation), chosen, UpstreamCancel.SUSPEND
                )
                assert (done, text) == (False, "not forwarded: refused by policy")
        assert provider.requests == []


# --- DNS: rebinding, resolution in its own time ------------------------------------------------


async def test_a_name_that_rebinds_to_loopback_is_refused_and_nothing_reaches_loopback() -> None:
    provider = Recorder()
    async with serve(provider.handle) as port, loopback_listener(port) as listener:
        resolver = ScriptedResolver(
            {
                "rebind.example": [[HOST], ["127.0.0.1"]],  # allowed, then loopback
                "mixed.example": [[HOST, "127.0.0.1"]],  # one bad answer spoils the name
                "metadata.example": [["169.254.169.254"]],
            },
            {},
        )
        c = client(["*.example"], resolver)
        first = await look_up(c, "ns", f"http://rebind.example:{port}")
        assert first.state is ProviderState.RUNNING
        second = await look_up(c, "ns", f"http://rebind.example:{port}")
        assert second.error == "refused by policy"
        assert (await look_up(c, "ns", f"http://mixed.example:{port}")).error == "refused by policy"
        done, text = await cancel(c, "ns", f"http://metadata.example:{port}")
        assert (done, text) == (False, "not forwarded: refused by policy")
        # One lookup per call: the connection goes to the address checked, not to a second
        # answer of the resolver.
        names = ["rebind.example", "rebind.example", "mixed.example", "metadata.example"]
        assert resolver.lookups == names
        assert len(provider.requests) == 1 and listener.connections == 0


async def test_name_resolution_never_blocks_a_thread(monkeypatch: pytest.MonkeyPatch) -> None:
    """The default resolver is asynchronous (c-ares): the default thread pool's few threads,
    which one tenant's slow DNS would fill for every tenant, are never used."""
    blocking: list[str] = []

    def getaddrinfo(host: Any, *args: Any, **kwargs: Any) -> Any:
        blocking.append(str(host))
        raise socket.gaierror(socket.EAI_NONAME, "not known")

    monkeypatch.setattr(socket, "getaddrinfo", getaddrinfo)
    c = client(["*.invalid"], deadline_seconds=3.0)
    got = await look_up(c, "ns", "http://provider.invalid:8080")
    assert blocking == [], "resolved by socket.getaddrinfo, in a thread"
    assert got.error == "unreachable"
    await c.aclose()


async def test_a_slow_resolver_for_one_namespace_does_not_fail_another() -> None:
    provider = Recorder()
    async with serve(provider.handle) as port:
        resolver = ScriptedResolver(
            {"slow.example": [[HOST]], "fast.example": [[HOST]]}, {"slow.example": 60.0}
        )
        c = client(["*.example"], resolver, deadline_seconds=1.0, burst_per_namespace=50)
        slow = [look_up(c, "tenant-a", f"http://slow.example:{port}") for _ in range(40)]
        fast = look_up(c, "tenant-b", f"http://fast.example:{port}")
        *a, b = await asyncio.gather(*slow, fast)
        assert b.state is ProviderState.RUNNING and b.error is None
        busy = "not called: too many provider calls in flight"
        assert {x.error for x in a} <= {"unreachable", busy}
        assert c.http.gate.in_flight() == 0, "a call past its deadline holds no slot"


# --- no cookies, no redirects, bounded answers -------------------------------------------------


async def test_no_cookie_is_carried_from_one_namespace_to_another() -> None:
    provider = Recorder()
    provider.set_cookies["op-b"] = [f"session=tenant-b-secret; Path=/; Domain={HOST}"]
    async with serve(provider.handle) as port:
        c = client([HOST])
        base = f"http://{HOST}:{port}"
        assert (await look_up(c, "tenant-b", base, "op-b")).state is ProviderState.RUNNING
        assert (await look_up(c, "tenant-a", base, "op-a")).state is ProviderState.RUNNING
        assert (await look_up(c, "tenant-b", base, "op-b")).state is ProviderState.RUNNING
        assert len(provider.requests) == 3 and provider.cookies_sent() == []


async def test_a_cookie_flood_is_kept_nowhere() -> None:
    provider = Recorder()
    async with serve(provider.handle) as port:
        c = client([HOST], burst_per_namespace=100)
        base = f"http://{HOST}:{port}"
        for n in range(40):
            provider.set_cookies[f"op-{n}"] = [f"c{n}-{i}={'x' * 200}; Path=/" for i in range(50)]
            assert (await look_up(c, "ns", base, f"op-{n}")).state is ProviderState.RUNNING
        # 2,000 cookies set, none sent back (none kept).
        assert provider.cookies_sent() == []
        # An answer with more headers than the bound is no answer at all.
        provider.set_cookies["op-x"] = [f"x{i}=1" for i in range(500)]
        assert (await look_up(c, "ns", base, "op-x")).error == "unreachable"


async def test_redirects_are_not_followed() -> None:
    provider = Recorder()
    async with serve(provider.handle) as port, loopback_listener() as listener:
        provider.redirect_to = f"http://127.0.0.1:{listener.port}/latest/meta-data"  # type: ignore[attr-defined]
        c = client([HOST])
        got = await look_up(c, "ns", f"http://{HOST}:{port}")
        assert got.error == "HTTP 302"
        assert await cancel(c, "ns", f"http://{HOST}:{port}") == (False, "refused (HTTP 302)")
        assert listener.connections == 0


# --- what a tenant learns --------------------------------------------------------------------


async def test_a_tenant_learns_only_refused_or_unreachable() -> None:
    """A closed port, a port that accepts and hangs up, one that never answers, a name that
    does not resolve, a host off the list: the recorded error is one of two texts."""

    async def hang_up(reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        writer.write(b"SSH-2.0-OpenSSH_9.6\r\n")
        await writer.drain()
        writer.close()

    async def silent(reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        await asyncio.sleep(5)
        writer.close()

    closed = socket.socket()
    closed.bind((HOST, 0))
    closed_port = closed.getsockname()[1]
    closed.close()
    talker = await asyncio.start_server(hang_up, HOST, 0)
    quiet = await asyncio.start_server(silent, HOST, 0)
    resolver = ScriptedResolver({"gone.example": [[]]}, {})
    c = client([HOST, "*.example"], resolver, deadline_seconds=0.5)
    try:
        bases = [
            f"http://{HOST}:{closed_port}",
            f"http://{HOST}:{talker.sockets[0].getsockname()[1]}",
            f"http://{HOST}:{quiet.sockets[0].getsockname()[1]}",
            "http://gone.example:80",
            "http://10.0.0.1:10250",
            "http://169.254.169.254:80",
        ]
        errors = {(await look_up(c, "ns", base)).error for base in bases}
        cancels = {(await cancel(c, "ns", base))[1] for base in bases}
    finally:
        talker.close()
        quiet.close()
    assert errors == TENANT_ERRORS
    assert cancels == {f"not forwarded: {e}" for e in TENANT_ERRORS}


# --- caps and rate -----------------------------------------------------------------------------


async def test_calls_in_flight_are_capped_per_namespace_and_in_all() -> None:
    provider = Recorder(delay=0.3)
    async with serve(provider.handle) as port:
        base = f"http://{HOST}:{port}"
        c = client(
            [HOST],
            max_in_flight=3,
            max_in_flight_per_namespace=2,
            burst_per_namespace=20,
            deadline_seconds=10.0,
        )
        one = await asyncio.gather(*(look_up(c, "a", base) for _ in range(6)))
        assert all(x.state is ProviderState.RUNNING for x in one)
        assert provider.most_in_flight == 2, "one namespace: its own cap"
        provider.most_in_flight = 0
        spread = [look_up(c, ns, base) for ns in ("b", "c", "d") for _ in range(3)]
        assert all(x.state is ProviderState.RUNNING for x in await asyncio.gather(*spread))
        assert provider.most_in_flight == 3, "several namespaces: the global cap"


async def test_calls_are_rate_limited_per_namespace() -> None:
    provider = Recorder()
    async with serve(provider.handle) as port:
        base = f"http://{HOST}:{port}"
        c = client([HOST], burst_per_namespace=3, calls_per_second_per_namespace=0.01)
        got = [await look_up(c, "a", base) for _ in range(5)]
        assert [x.error for x in got[:3]] == [None, None, None]
        limited = "not called: too many provider calls from this namespace lately"
        assert [x.error for x in got[3:]] == [limited, limited]
        assert (await cancel(c, "a", base)) == (False, f"not forwarded: {limited}")
        assert (await look_up(c, "b", base)).state is ProviderState.RUNNING, "b has its own"
        assert len(provider.requests) == 4


async def test_the_token_bucket_refills_at_its_rate() -> None:
    now = [0.0]
    gate = CallGate(calls_per_second_per_namespace=2.0, burst_per_namespace=2, clock=lambda: now[0])
    for _ in range(2):
        async with gate.call("a"):
            pass
    with pytest.raises(RateLimitedError):
        async with gate.call("a"):
            pass
    now[0] += 0.5  # one token back
    async with gate.call("a"):
        pass
    with pytest.raises(RateLimitedError):
        async with gate.call("a"):
            pass
    now[0] += 100  # never more than the burst
    for _ in range(2):
        async with gate.call("a"):
            pass
    with pytest.raises(RateLimitedError):
        async with gate.call("a"):
            pass


def test_the_socket_factory_refuses_loopback_whatever_resolved_it() -> None:
    """The last line: the address about to be connected to is checked once more."""
    from reservoir.k8s.provider_http import _checked_socket

    for family, sockaddr in (
        (socket.AF_INET, ("127.0.0.1", 80)),
        (socket.AF_INET, ("169.254.169.254", 80)),
        (socket.AF_INET6, ("::1", 80, 0, 0)),
        (socket.AF_INET6, ("::ffff:127.0.0.1", 80, 0, 0)),
        (socket.AF_INET6, ("fe80::1%eth0", 80, 0, 2)),
    ):
        with pytest.raises(OSError, match="refused to connect"):
            _checked_socket((family, socket.SOCK_STREAM, 0, "", sockaddr))
    sock = _checked_socket((socket.AF_INET, socket.SOCK_STREAM, 0, "", (HOST, 80)))
    sock.close()
