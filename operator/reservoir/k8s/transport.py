"""lightkube's requests carried by aiohttp (kopf's own HTTP client) instead of httpcore.

Why: the operator's CPU per claim is mostly its requests' client-side cost. Profiled on
the admission benchmark, httpcore's connection pool and anyio's TLS streams took about a
third of the operator's CPU (2 ms and more per request on this machine), where aiohttp's C
parser and asyncio's native TLS do the same work in a fraction of it. lightkube keeps
everything else (requests, auth, errors); only the transport under httpx changes.

The transport streams each response (watches stay open), maps aiohttp's errors onto
httpx's (lightkube and the callers retry on those), never follows redirects (httpx
decides) and never decompresses (httpx decodes what the server encoded)."""

from __future__ import annotations

import asyncio
import ssl
import urllib.request
from collections.abc import AsyncIterator
from typing import Any

import aiohttp
import httpx2 as httpx
from lightkube import AsyncClient
from lightkube.config.client_adapter import verify_cluster
from lightkube.config.kubeconfig import KubeConfig, SingleConfig
from yarl import URL

# Headers aiohttp writes itself from the body and the URL (passing them too would send
# them twice).
_OWN_HEADERS = frozenset({b"host", b"content-length", b"transfer-encoding"})


class _Body(httpx.AsyncByteStream):
    """A response body as aiohttp reads it; closing it returns the connection."""

    def __init__(self, response: aiohttp.ClientResponse, request: httpx.Request) -> None:
        self._response = response
        self._request = request

    async def __aiter__(self) -> AsyncIterator[bytes]:
        try:
            async for chunk in self._response.content.iter_any():
                yield chunk
        except (aiohttp.ServerTimeoutError, TimeoutError) as error:
            raise httpx.ReadTimeout(
                str(error) or "read timed out", request=self._request
            ) from error
        except (aiohttp.ClientPayloadError, aiohttp.ClientConnectionError) as error:
            raise httpx.ReadError(str(error), request=self._request) from error

    async def aclose(self) -> None:
        self._response.release()


class AiohttpTransport(httpx.AsyncBaseTransport):
    """One aiohttp session per event loop (a session belongs to the loop that made it; as
    with lightkube's own transport, a client is meant for one loop: a session left behind
    by a loop that ended is left to the garbage collector). `ssl_context` None checks
    certificates against the system's authorities, as httpx does."""

    def __init__(self, ssl_context: ssl.SSLContext | None, connections: int = 100) -> None:
        self._ssl = ssl_context
        self._connections = connections
        self._session: aiohttp.ClientSession | None = None
        self._loop: asyncio.AbstractEventLoop | None = None

    def _session_here(self) -> aiohttp.ClientSession:
        loop = asyncio.get_running_loop()
        if self._session is None or self._session.closed or self._loop is not loop:
            connector = aiohttp.TCPConnector(
                limit=self._connections, ssl=self._ssl if self._ssl is not None else True
            )
            self._session = aiohttp.ClientSession(
                connector=connector,
                auto_decompress=False,  # httpx decodes what the server encoded
                cookie_jar=aiohttp.DummyCookieJar(),  # httpx keeps the cookies, if any
                skip_auto_headers=("User-Agent",),
            )
            self._loop = loop
        return self._session

    async def handle_async_request(self, request: httpx.Request) -> httpx.Response:
        timeouts: dict[str, float | None] = request.extensions.get("timeout") or {}
        timeout = aiohttp.ClientTimeout(
            total=None,
            connect=timeouts.get("pool"),
            sock_connect=timeouts.get("connect"),
            sock_read=timeouts.get("read"),
        )
        headers = [
            (name.decode("latin-1"), value.decode("latin-1"))
            for name, value in request.headers.raw
            if name.lower() not in _OWN_HEADERS
        ]
        url = URL(str(request.url), encoded=True)  # already escaped by httpx: keep it so
        if url.user is not None or url.password is not None:
            url = url.with_user(None)  # httpx made them its Authorization header already
        try:
            response = await self._session_here().request(
                request.method,
                url,
                headers=headers,
                data=await request.aread() or None,
                allow_redirects=False,
                timeout=timeout,
            )
        except aiohttp.ConnectionTimeoutError as error:  # never sent: no connection in time
            raise httpx.ConnectTimeout(str(error), request=request) from error
        except aiohttp.ClientConnectorError as error:
            raise httpx.ConnectError(str(error), request=request) from error
        except aiohttp.ServerTimeoutError as error:
            raise httpx.ReadTimeout(str(error), request=request) from error
        except TimeoutError as error:
            raise httpx.TimeoutException(str(error) or "timed out", request=request) from error
        except aiohttp.ClientError as error:
            raise httpx.RemoteProtocolError(str(error), request=request) from error
        return httpx.Response(
            status_code=response.status,
            headers=[(k.decode("latin-1"), v.decode("latin-1")) for k, v in response.raw_headers],
            stream=_Body(response, request),
            request=request,
            extensions={
                "http_version": b"HTTP/1.1",
                "reason_phrase": (response.reason or "").encode("latin-1"),
            },
        )

    async def aclose(self) -> None:
        if self._session is not None and not self._session.closed:
            await self._session.close()


def fast_client(
    config: SingleConfig | KubeConfig | None = None, connections: int = 100, **options: Any
) -> AsyncClient:
    """A lightkube AsyncClient whose requests aiohttp carries (see the module); the same
    configuration lightkube would load (the kubeconfig, or the in-cluster account), with
    its certificate checks. A proxy that applies to the API server keeps lightkube's own
    transport, and so does a configuration lightkube would refuse (it then says why).
    `connections`: the most kept open at once (beyond them a request waits for one)."""
    single = config if isinstance(config, SingleConfig) else (config or KubeConfig.from_env()).get()
    if single is None or single.user is None or _proxied(single.cluster.server):
        return AsyncClient(config=single or config, **options)
    context = verify_cluster(single.cluster, single.user, single.abs_file)
    transport = AiohttpTransport(context, connections)
    return AsyncClient(config=single, transport=transport, **options)


def _proxied(server: str) -> bool:
    """Whether the environment sends requests to `server` through a proxy (NO_PROXY alone,
    or naming the server, sends none)."""
    proxies = urllib.request.getproxies_environment()
    if not {scheme for scheme in proxies if scheme != "no"}:
        return False
    host = URL(server).host or ""
    return not urllib.request.proxy_bypass_environment(host, proxies)  # type: ignore[attr-defined]
