"""A tiny HTTP provider for tests: the status/cancel contract of reservoir.k8s.providers.

    with provider_server(token="s3cret") as provider:
        provider.script("op-1", (500, None), answer("op-1", "Running"), answer("op-1", "Succeeded",
                        usage={"tokens": "12"}))
        policy = {"provider": {"statusURL": provider.status_url, "cancelURL": provider.cancel_url,
                               "tokenSecret": {...}}}
        ...
        assert provider.lookups("op-1") >= 3 and provider.cancels("op-1") == 1

GET /operations/<id> answers the operation's script, one entry per GET, the last one
repeating (an operation with no script: 404). POST /operations/<id>/cancel answers the
operation's cancel answer (default 202). Every request is recorded (method, path,
operation, Authorization header). It listens on a free port of this machine's own address
(`host_address()`, not loopback: the operator never calls loopback, whatever its
allow-list says); the operator in the integration tests is a local process, so it reaches
it there, once allowed (`--provider-allow` with that address). A server on 127.0.0.1
(`host="127.0.0.1"`) is one the operator must never reach.
"""

from __future__ import annotations

import json
import socket
import threading
import time
import urllib.parse
from collections.abc import Iterator, Mapping
from contextlib import contextmanager
from dataclasses import dataclass
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from typing import Any

Body = Mapping[str, Any] | str | bytes | None


def host_address() -> str:
    """This machine's IPv4 address on its default route (no packet is sent: a UDP socket's
    connect only picks the route). Raises if the machine has none but loopback."""
    with socket.socket(socket.AF_INET, socket.SOCK_DGRAM) as probe:
        try:
            probe.connect(("203.0.113.1", 9))  # TEST-NET-3: any routed address will do
        except OSError as error:
            raise RuntimeError(f"no non-loopback address for the test provider: {error}") from None
        address = str(probe.getsockname()[0])
    if address.startswith("127.") or address == "0.0.0.0":
        raise RuntimeError(f"no non-loopback address to serve the test provider on ({address})")
    return address


@dataclass(frozen=True)
class Answer:
    status: int
    body: Body = None
    delay: float = 0.0  # seconds to wait before answering (a slow provider; > 5: a timeout)


def answer(
    operation: str,
    state: str,
    usage: Mapping[str, str] | None = None,
    result: str | None = None,
    status: int = 200,
) -> Answer:
    """A contract answer: {"operationId", "state", "usage"?, "result"?}."""
    body: dict[str, Any] = {"operationId": operation, "state": state}
    if usage is not None:
        body["usage"] = dict(usage)
    if result is not None:
        body["result"] = result
    return Answer(status, body)


@dataclass(frozen=True)
class Request:
    method: str
    path: str
    operation: str | None
    authorization: str | None
    at: float  # time.monotonic()


class ProviderServer:
    def __init__(self, token: str | None = None, host: str | None = None) -> None:
        """token: when set, a request without "Authorization: Bearer <token>" gets 401.
        host: where to listen (default: host_address())."""
        self.token = token
        self.host = host or host_address()
        self._lock = threading.Lock()
        self._scripts: dict[str, list[Answer]] = {}
        self._cancel: dict[str, Answer] = {}
        self._requests: list[Request] = []
        self._server: ThreadingHTTPServer | None = None
        self._thread: threading.Thread | None = None

    # --- scripting -------------------------------------------------------------------------

    def script(self, operation: str, *answers: Answer | tuple[int, Body]) -> None:
        """GET answers for `operation`, one per GET, the last one repeating (replaces any
        earlier script)."""
        if not answers:
            raise ValueError("a script needs at least one answer")
        with self._lock:
            self._scripts[operation] = [a if isinstance(a, Answer) else Answer(*a) for a in answers]

    def then(self, operation: str, *answers: Answer | tuple[int, Body]) -> None:
        """Answers after the ones still to come (the current last one stops repeating)."""
        with self._lock:
            self._scripts.setdefault(operation, []).extend(
                a if isinstance(a, Answer) else Answer(*a) for a in answers
            )

    def on_cancel(self, operation: str, status: int = 202, body: Body = None) -> None:
        with self._lock:
            self._cancel[operation] = Answer(status, body)

    # --- what was asked --------------------------------------------------------------------

    @property
    def requests(self) -> list[Request]:
        with self._lock:
            return list(self._requests)

    def lookups(self, operation: str) -> int:
        return sum(1 for r in self.requests if r.method == "GET" and r.operation == operation)

    def cancels(self, operation: str) -> int:
        return sum(1 for r in self.requests if r.method == "POST" and r.operation == operation)

    # --- where -----------------------------------------------------------------------------

    @property
    def url(self) -> str:
        if self._server is None:
            raise RuntimeError("the provider server is not running")
        host, port = self._server.server_address[:2]
        return f"http://{host!s}:{port}"

    @property
    def status_url(self) -> str:
        return f"{self.url}/operations/{{operationId}}"

    @property
    def cancel_url(self) -> str:
        return f"{self.url}/operations/{{operationId}}/cancel"

    # --- life ------------------------------------------------------------------------------

    def start(self) -> ProviderServer:
        if self._server is not None:
            return self
        server = ThreadingHTTPServer((self.host, 0), _handler(self))
        server.daemon_threads = True  # a slow answer never holds up stop()
        self._server = server
        self._thread = threading.Thread(
            target=server.serve_forever, name="provider-server", daemon=True
        )
        self._thread.start()
        return self

    def stop(self) -> None:
        server, thread = self._server, self._thread
        self._server = self._thread = None
        if server is not None:
            server.shutdown()
            server.server_close()
        if thread is not None:
            thread.join(timeout=5)

    def __enter__(self) -> ProviderServer:
        return self.start()

    def __exit__(self, *_: object) -> None:
        self.stop()

    # --- answering (the handler's thread) --------------------------------------------------

    def _respond(
        self, method: str, path: str, authorization: str | None
    ) -> tuple[Answer, str | None]:
        parts = urllib.parse.urlsplit(path).path.strip("/").split("/")
        operation = None
        if len(parts) >= 2 and parts[0] == "operations":
            operation = urllib.parse.unquote(parts[1])
        with self._lock:
            self._requests.append(Request(method, path, operation, authorization, time.monotonic()))
            if self.token is not None and authorization != f"Bearer {self.token}":
                return Answer(401, {"error": "unauthorized"}), operation
            if operation is None:
                return Answer(404, {"error": "no such path"}), operation
            if method == "POST" and parts[2:] == ["cancel"]:
                return self._cancel.get(operation, Answer(202, {})), operation
            if method == "GET" and len(parts) == 2:
                script = self._scripts.get(operation)
                if not script:
                    return Answer(404, {"error": "operation not found"}), operation
                return (script.pop(0) if len(script) > 1 else script[0]), operation
            return Answer(405, {"error": "method not allowed"}), operation


def _handler(provider: ProviderServer) -> type[BaseHTTPRequestHandler]:
    class Handler(BaseHTTPRequestHandler):
        protocol_version = "HTTP/1.1"

        def _serve(self) -> None:
            length = int(self.headers.get("Content-Length") or 0)
            if length:
                self.rfile.read(length)
            reply, _ = provider._respond(self.command, self.path, self.headers.get("Authorization"))
            self.close_connection = True
            if reply.delay:
                time.sleep(reply.delay)
            body = reply.body
            if body is None:
                data = b""
            elif isinstance(body, bytes):
                data = body
            elif isinstance(body, str):
                data = body.encode()
            else:
                data = json.dumps(body).encode()
            try:
                self.send_response(reply.status)
                self.send_header("Content-Type", "application/json")
                self.send_header("Content-Length", str(len(data)))
                # One request per connection: a stopped server is down for every client
                # (a kept-alive connection would still be answered by its thread).
                self.send_header("Connection", "close")
                self.end_headers()
                self.wfile.write(data)
            except (BrokenPipeError, ConnectionResetError):
                pass  # the client gave up (a timeout): nothing to answer

        def do_GET(self) -> None:
            self._serve()

        def do_POST(self) -> None:
            self._serve()

        def log_message(self, format: str, *args: Any) -> None:
            pass  # quiet: the requests are recorded

    return Handler


@contextmanager
def provider_server(token: str | None = None, host: str | None = None) -> Iterator[ProviderServer]:
    """A running provider server for the `with` block (a pytest fixture can yield from it)."""
    server = ProviderServer(token, host)
    with server:
        yield server
