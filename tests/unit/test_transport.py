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
