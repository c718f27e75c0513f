"""The operator's HTTP endpoints on --metrics-port: Prometheus' `/metrics` and the
readiness probe `/readyz`. (Liveness is kopf's own endpoint, `--liveness`.) With an
`auth` (see metrics_auth), /metrics answers only an authorized bearer token; /readyz,
which names no tenant's objects, answers the kubelet's probes without one.

Readiness says whether this replica can do its job right now: its start-up finished, every
watch is up (one that failed is restarted, see kopf_watch), and the API server answered
its latest request (a ledger reconcile, or the cheap read `watch_api` makes every 10 s, so
that a replica with nothing to reconcile, or standing by behind a peer, still notices an
unreachable API server).
"""

from __future__ import annotations

import asyncio
import socket
import time
from collections.abc import Awaitable, Callable
from dataclasses import dataclass, field

from aiohttp import web
from prometheus_client import CONTENT_TYPE_LATEST, REGISTRY, generate_latest

from reservoir.metrics_auth import MetricsAuth


@dataclass
class Health:
    started: bool = False
    last_success: float = 0.0
    last_failure: float = 0.0
    failure: str = ""
    # Watches that failed and are not back yet (listed again): what -> why.
    watches_down: dict[str, str] = field(default_factory=dict)

    def watch_down(self, what: str, why: str) -> None:
        self.watches_down[what] = why

    def watch_up(self, what: str) -> None:
        self.watches_down.pop(what, None)

    def succeeded(self) -> None:
        self.last_success = time.monotonic()

    def failed(self, why: str) -> None:
        self.last_failure, self.failure = time.monotonic(), why

    def problem(self) -> str | None:
        """Why this replica is not ready, or None."""
        if not self.started:
            return "starting"
        for what, why in self.watches_down.items():
            return f"the watch of {what} failed and is being restarted: {why}"
        if self.last_failure > self.last_success:
            return f"the latest ledger reconcile failed: {self.failure}"
        return None


async def watch_api(
    health: Health, check: Callable[[], Awaitable[object]], every: float = 10.0
) -> None:
    """Ask the API server something cheap every `every` seconds; record the answer."""
    while True:
        try:
            await asyncio.wait_for(check(), timeout=5)
            health.succeeded()
        except asyncio.CancelledError:
            raise
        except Exception as error:
            health.failed(f"API server: {type(error).__name__}: {error}"[:200])
        await asyncio.sleep(every)


def listen(port: int, host: str = "0.0.0.0") -> socket.socket:
    """The endpoints' listening socket, bound before the operator starts, so that a port
    already taken stops it at once with one line rather than a start-up retried every
    minute. Raises OSError."""
    listening = socket.socket(socket.AF_INET, socket.SOCK_STREAM)
    try:
        listening.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        listening.bind((host, port))
        listening.listen(128)
    except OSError:
        listening.close()
        raise
    listening.setblocking(False)
    return listening


async def serve(
    listening: socket.socket, health: Health, auth: MetricsAuth | None = None
) -> web.AppRunner:
    async def metrics(request: web.Request) -> web.Response:
        if auth is not None:
            try:
                verdict = await auth.check(request.headers.get("Authorization"))
            except Exception as error:  # the API server did not answer: no metrics, no leak
                return web.Response(status=503, text=f"cannot authorize: {type(error).__name__}\n")
            if verdict.status != 200:
                return web.Response(status=verdict.status, text=f"{verdict.why}\n")
        body = generate_latest(REGISTRY)
        return web.Response(body=body, headers={"Content-Type": CONTENT_TYPE_LATEST})

    async def readyz(_: web.Request) -> web.Response:
        problem = health.problem()
        if problem is None:
            return web.Response(text="ok\n")
        return web.Response(status=503, text=f"not ready: {problem}\n")

    app = web.Application()
    app.router.add_get("/metrics", metrics)
    app.router.add_get("/readyz", readyz)
    runner = web.AppRunner(app, access_log=None)
    await runner.setup()
    await web.SockSite(runner, listening).start()
    return runner
