"""The HTTP plumbing the cloud fakes share: a threaded server on 127.0.0.1 that records every
request and can be told to fail the next few with a status.

A fake subclasses `FakeHTTPServer` and implements `handle(request) -> Response`.
"""

from __future__ import annotations

import abc
import dataclasses
import json
import sys
import threading
import urllib.parse
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from typing import Any


@dataclasses.dataclass(frozen=True)
class Request:
    method: str
    path: str
    query: dict[str, str]
    headers: dict[str, str]
    body: Any  # parsed JSON, raw text, or None when empty


@dataclasses.dataclass
class Response:
    status: int
    body: bytes = b""
    headers: dict[str, str] = dataclasses.field(default_factory=dict)

    @classmethod
    def json(cls, status: int, payload: Any, headers: dict[str, str] | None = None) -> "Response":
        return cls(status, json.dumps(payload).encode(), {"Content-Type": "application/json", **(headers or {})})


@dataclasses.dataclass
class _Failure:
    remaining: int
    status: int
    method: str | None
    path_contains: str | None


class _Handler(BaseHTTPRequestHandler):
    protocol_version = "HTTP/1.1"
    server: "_Server"

    def log_message(self, format: str, *args: Any) -> None:  # noqa: A002 (stdlib signature)
        pass

    def _dispatch(self) -> None:
        parts = urllib.parse.urlsplit(self.path)
        raw = self.rfile.read(int(self.headers.get("Content-Length") or 0))
        try:
            body: Any = json.loads(raw) if raw.strip() else None
        except ValueError:
            body = raw.decode(errors="replace")
        request = Request(
            method=self.command,
            path=urllib.parse.unquote(parts.path),
            query=dict(urllib.parse.parse_qsl(parts.query, keep_blank_values=True)),
            headers={k.lower(): v for k, v in self.headers.items()},
            body=body,
        )
        fake = self.server.fake
        self.server.served += 1
        response = fake._injected_failure(request) or fake.handle(request)
        try:
            self.send_response(response.status)
            for key, value in response.headers.items():
                self.send_header(key, value)
            self.send_header("Content-Length", str(len(response.body)))
            self.end_headers()
            self.wfile.write(response.body)
        except (BrokenPipeError, ConnectionResetError):
            # The client left first: a long poll abandoned by a process that exited. Nothing to answer.
            self.close_connection = True

    do_GET = do_POST = do_PUT = do_PATCH = do_DELETE = _dispatch


class _Server(ThreadingHTTPServer):
    daemon_threads = True

    def __init__(self, fake: "FakeHTTPServer", address: tuple[str, int]):
        self.fake = fake
        self.served = 0  # requests this listener answered (a fleet rehearsal counts them per machine)
        super().__init__(address, _Handler)

    def handle_error(self, request: Any, client_address: Any) -> None:
        # A client that leaves mid-request (curl's --max-time, a process killed) is no fault of the fake.
        if not isinstance(sys.exc_info()[1], ConnectionError):
            super().handle_error(request, client_address)


class FakeHTTPServer(abc.ABC):
    def __init__(self) -> None:
        self.lock = threading.RLock()
        self.requests: list[Request] = []
        self._failures: list[_Failure] = []
        self._main: Listener | None = None
        self._listeners: list[Listener] = []

    @abc.abstractmethod
    def handle(self, request: Request) -> Response:
        """Answer one request; each fake defines its own API."""

    def start(self, address: tuple[str, int] = ("127.0.0.1", 0)):
        """Serve on `address` (default: a free port on 127.0.0.1; the boot rehearsal's metadata
        server takes the metadata server's own, 169.254.169.254:80)."""
        self._main = self.listen(address)
        return self

    def listen(self, address: tuple[str, int] = ("127.0.0.1", 0)) -> "Listener":
        """A socket answering for this fake (its state, its `requests`); `start` opens the first, and
        more may follow, e.g. inside a rehearsal machine's own network namespace (open it from a
        thread in that namespace)."""
        listener = Listener(_Server(self, address))
        with self.lock:
            self._listeners.append(listener)
        return listener.start()

    def stop(self) -> None:
        with self.lock:
            listeners, self._listeners, self._main = self._listeners, [], None
        for listener in listeners:
            listener.stop()

    @property
    def host(self) -> str:
        return self._main.host

    @property
    def url(self) -> str:
        return f"http://{self.host}"

    def fail_next(self, n: int, status: int = 503, method: str | None = None, path_contains: str | None = None) -> None:
        """Answer the next `n` matching requests with `status` (recorded, not applied)."""
        with self.lock:
            self._failures.append(_Failure(n, status, method, path_contains))

    def _injected_failure(self, request: Request) -> Response | None:
        with self.lock:
            self.requests.append(request)
            for failure in self._failures:
                if failure.remaining and (failure.method in (None, request.method)) and (
                    failure.path_contains is None or failure.path_contains in request.path
                ):
                    failure.remaining -= 1
                    return self.failure_response(failure.status)
        return None

    def failure_response(self, status: int) -> Response:
        return Response.json(status, {"error": {"code": status, "message": f"injected failure {status}"}})


class Listener:
    """One socket of a fake (FakeHTTPServer.listen): its URL, and how many requests it answered."""

    def __init__(self, server: _Server):
        self._server = server
        self._thread = threading.Thread(target=server.serve_forever, kwargs={"poll_interval": 0.05}, daemon=True)

    def start(self) -> "Listener":
        self._thread.start()
        return self

    @property
    def host(self) -> str:
        host, port = self._server.server_address[:2]
        return f"{host}:{port}"

    @property
    def url(self) -> str:
        return f"http://{self.host}"

    @property
    def served(self) -> int:
        return self._server.served

    def stop(self) -> None:
        if self._thread.is_alive():
            self._server.shutdown()
            self._server.server_close()
            self._thread.join()
