"""The operator's HTTP endpoints on --metrics-port: Prometheus' `/metrics` and the
readiness probe `/readyz`. (Liveness is kopf's own endpoint, `--liveness`.)

Readiness says whether this replica can do its job right now: its start-up finished and
the API server answered its latest ledger reconcile. A replica that has nothing to
reconcile, or that stands by behind a peer, is ready.
"""

from __future__ import annotations

import time
from dataclasses import dataclass

from aiohttp import web
from prometheus_client import CONTENT_TYPE_LATEST, REGISTRY, generate_latest


@dataclass
class Health:
    started: bool = False
    last_success: float = 0.0
    last_failure: float = 0.0
    failure: str = ""

    def succeeded(self) -> None:
        self.last_success = time.monotonic()

    def failed(self, why: str) -> None:
        self.last_failure, self.failure = time.monotonic(), why

    def problem(self) -> str | None:
        """Why this replica is not ready, or None."""
        if not self.started:
            return "starting"
        if self.last_failure > self.last_success:
            return f"the latest ledger reconcile failed: {self.failure}"
        return None


async def serve(port: int, health: Health) -> web.AppRunner:
    async def metrics(_: web.Request) -> web.Response:
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
    await web.TCPSite(runner, "0.0.0.0", port).start()
    return runner
