"""The aiohttp transport under lightkube's httpx client (reservoir.k8s.transport), against
a real local HTTP server: what reaches the server is what httpx built, responses stream,
and aiohttp's failures surface as the httpx errors callers handle."""

from __future__ import annotations

import asyncio
import contextlib
import gzip
import socket
from collections.abc import AsyncIterator

import httpx2 as httpx
import pytest
from aiohttp import web

from reservoir.k8s import transport
from reservoir.k8s.transport import AiohttpTransport

pytestmark = pytest.mark.asyncio


@contextlib.asynccontextmanager
async def serving() -> AsyncIterator[tuple[str, list[web.Request], dict[str, bytes]]]:
    """A local HTTP server on this test's event loop."""
    seen: list[web.Request] = []
    bodies: dict[str, bytes] = {}

    async def echo(request: web.Request) -> web.StreamResponse:
        seen.append(request)
        bodies[request.path_qs] = await request.read()
        if request.path == "/slow":
            await asyncio.sleep(1)
        if request.path == "/gzip":
            return web.Response(
                body=gzip.compress(b'{"kind": "Status"}'),
                headers={"Content-Encoding": "gzip", "Content-Type": "application/json"},
            )
        if request.path == "/cookie":
            response = web.json_response({}, status=200)
            response.set_cookie("AWSALB", "sticky1")
            return response
        if request.path == "/stall":  # headers at once, then a body that never comes
            response = web.StreamResponse()
            await response.prepare(request)
            await response.write(b'{"items": [')
            await asyncio.sleep(1)
            return response
        if request.path == "/watch":
            response = web.StreamResponse()
            await response.prepare(request)
            await response.write(b'{"type": "ADDED"}\n')
            await asyncio.sleep(0.5)  # the first line must be readable before the second
            await response.write(b'{"type": "DELETED"}\n')
            await response.write_eof()
            return response
        return web.json_response({"path": request.raw_path}, status=201)

    app = web.Application()
    app.router.add_route("*", "/{tail:.*}", echo)
    runner = web.AppRunner(app)
    await runner.setup()
    site = web.TCPSite(runner, "127.0.0.1", 0)
    await site.start()
    port = runner.addresses[0][1]
    yield f"http://127.0.0.1:{port}", seen, bodies
    await runner.cleanup()


def client(base: str, read: float | None = 5.0) -> httpx.AsyncClient:
    return httpx.AsyncClient(
        base_url=base,
        transport=AiohttpTransport(None),
        timeout=httpx.Timeout(5.0, read=read),
    )


async def test_the_request_arrives_as_httpx_built_it() -> None:
    async with serving() as (base, seen, bodies):
        async with client(base) as http:
            response = await http.patch(
                "/apis/x/v1/namespaces/a/things",
                params={"fieldSelector": "metadata.name=a%b", "limit": "50"},
                content=b'{"spec": {}}',
                headers={"Content-Type": "application/merge-patch+json", "X-Test": "1"},
            )
        assert response.status_code == 201
        request = seen[-1]
        assert request.method == "PATCH"
        assert request.raw_path == (
            "/apis/x/v1/namespaces/a/things?fieldSelector=metadata.name%3Da%25b&limit=50"
        )
        assert request.headers.getall("Content-Length") == ["12"]
        assert request.headers["Content-Type"] == "application/merge-patch+json"
        assert request.headers["X-Test"] == "1"
        assert bodies[request.path_qs] == b'{"spec": {}}'
        assert response.json() == {"path": request.raw_path}


async def test_an_encoded_response_is_decoded_once() -> None:
    async with serving() as (base, _, _):
        async with client(base) as http:
            response = await http.get("/gzip")
        assert response.json() == {"kind": "Status"}


async def test_a_response_streams_line_by_line() -> None:
    async with (
        serving() as (base, _, _),
        client(base, read=None) as http,
        http.stream("GET", "/watch") as response,
    ):
        lines = response.aiter_lines()
        first = await asyncio.wait_for(lines.__anext__(), timeout=0.4)
        rest = [line async for line in lines]
        assert first == '{"type": "ADDED"}'
        assert rest == ['{"type": "DELETED"}']


async def test_a_refused_connection_is_httpx_connect_error() -> None:
    with socket.socket() as probe:  # a port nothing listens on
        probe.bind(("127.0.0.1", 0))
        port = probe.getsockname()[1]
    async with client(f"http://127.0.0.1:{port}") as http:
        with pytest.raises(httpx.ConnectError):
            await http.get("/")


async def test_a_slow_answer_is_httpx_read_timeout() -> None:
    async with serving() as (base, _, _), client(base, read=0.3) as http:
        with pytest.raises(httpx.ReadTimeout):
            await http.get("/slow")


async def test_cookies_are_httpxs_alone() -> None:
    """The transport keeps no cookie jar of its own: a request carries only what httpx put
    in it (found by review: a load balancer's sticky cookie was sent after httpx cleared
    its jar)."""
    async with serving() as (base, seen, _), client(base) as http:
        await http.get("/cookie")
        http.cookies.clear()
        await http.get("/next")
    assert "Cookie" not in seen[-1].headers


async def test_a_body_that_stalls_is_httpx_read_timeout() -> None:
    async with serving() as (base, _, _), client(base, read=0.3) as http:
        with pytest.raises(httpx.ReadTimeout):
            await http.get("/stall")


async def test_a_delete_carries_its_body() -> None:
    """DeleteOptions (preconditions) travel in a DELETE's body."""
    options = b'{"kind":"DeleteOptions","preconditions":{"uid":"u"}}'
    async with serving() as (base, seen, bodies), client(base) as http:
        await http.request("DELETE", "/things/a", content=options)
    assert bodies[seen[-1].path_qs] == options


async def test_credentials_in_the_server_url_leave_httpxs_header_as_it_is() -> None:
    async with serving() as (base, seen, _):
        with_user = base.replace("http://", "http://user:pass@")
        async with client(with_user) as http:
            response = await http.get("/", headers={"Authorization": "Bearer t"})
    assert response.status_code == 201, "sent (aiohttp refuses a URL's credentials and a header)"
    assert seen[-1].headers.getall("Authorization") == [response.request.headers["Authorization"]]


@pytest.mark.parametrize(
    ("environment", "proxied"),
    [
        ({}, False),
        ({"NO_PROXY": ".svc,10.0.0.0/8"}, False),  # no proxy at all
        ({"HTTPS_PROXY": "http://proxy:3128", "NO_PROXY": "kube.example"}, False),
        ({"HTTPS_PROXY": "http://proxy:3128"}, True),
        ({"HTTPS_PROXY": "http://proxy:3128", "NO_PROXY": "other.example"}, True),
    ],
)
async def test_a_proxy_keeps_lightkubes_transport_only_where_it_applies(
    monkeypatch: pytest.MonkeyPatch, environment: dict[str, str], proxied: bool
) -> None:
    for name in ("HTTPS_PROXY", "HTTP_PROXY", "NO_PROXY", "https_proxy", "http_proxy", "no_proxy"):
        monkeypatch.delenv(name, raising=False)
    for name, value in environment.items():
        monkeypatch.setenv(name, value)
    assert transport._proxied("https://kube.example:6443") is proxied
