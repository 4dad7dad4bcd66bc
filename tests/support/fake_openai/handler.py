"""The HTTP side: the threading server and the handler that answers each endpoint."""

from __future__ import annotations

import contextlib
import json
import socket
import sys
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from typing import TYPE_CHECKING, Any

from tests.support.fake_openai.bodies import error_body

if TYPE_CHECKING:
    from tests.support.fake_openai.server import FakeOpenAI

# --------------------------------------------------------------------------------------------
# HTTP
# --------------------------------------------------------------------------------------------


class FakeHTTPServer(ThreadingHTTPServer):
    daemon_threads = True
    allow_reuse_address = True
    # Benchmarks open hundreds of connections at once; a small backlog would refuse some.
    request_queue_size = 1024

    def __init__(self, address: tuple[str, int], fake: FakeOpenAI) -> None:
        self.fake = fake
        super().__init__(address, Handler)

    def handle_error(self, request: Any, client_address: Any) -> None:
        # Clients that give up (timeouts, stream cuts) are expected; anything else is a bug.
        if not isinstance(sys.exc_info()[1], ConnectionError | TimeoutError):
            super().handle_error(request, client_address)


class Handler(BaseHTTPRequestHandler):
    # HTTP/1.1 keep-alive: every JSON answer has a Content-Length and streams are chunked, so
    # the SDK's connection pool can reuse connections.
    protocol_version = "HTTP/1.1"
    server_version = "FakeOpenAI/1.0"
    timeout = 60  # idle keep-alive connections are dropped after this many seconds
    # Headers and body go out in separate writes; with Nagle on, the client's delayed ACK
    # adds ~40 ms to every response.
    disable_nagle_algorithm = True
    server: FakeHTTPServer

    def setup(self) -> None:
        super().setup()
        self.server.fake._track_connection(self.connection)

    def finish(self) -> None:
        self.server.fake._untrack_connection(self.connection)
        super().finish()

    def log_message(self, format: str, *args: Any) -> None:
        pass  # keep test output clean

    # -- routing -----------------------------------------------------------------------------

    def do_GET(self) -> None:
        path = self._route()
        fake = self.server.fake
        if not self._authorized():
            self._send_unauthorized()
        elif path == "/models":
            self._send_json(200, {"object": "list", "data": [model_body(m) for m in fake.models]})
        elif path.startswith("/models/") and path[len("/models/") :] in fake.models:
            self._send_json(200, model_body(path[len("/models/") :]))
        else:
            self._send_error(404, "invalid_request_error", f"Unknown path {self.path}", None)

    def do_POST(self) -> None:
        body_bytes = self.rfile.read(int(self.headers.get("Content-Length") or 0))
        path = self._route()
        if path not in ("/chat/completions", "/responses"):
            self._send_error(404, "invalid_request_error", f"Unknown path {self.path}", None)
            return
        try:
            body = json.loads(body_bytes or b"{}")
        except ValueError:
            self._send_error(400, "invalid_request_error", "Body is not valid JSON.", None)
            return
        if not isinstance(body, dict):
            self._send_error(400, "invalid_request_error", "Body must be a JSON object.", None)
            return
        try:
            self.server.fake._serve_model_request(self, path, body)
        except OSError:
            self.close_connection = True  # the client went away (timeout, cut); nothing to say

    def _route(self) -> str:
        path = self.path.split("?", 1)[0].rstrip("/")
        return path.removeprefix("/v1")

    def _authorized(self) -> bool:
        key = self.server.fake.api_key
        return key is None or self.headers.get("Authorization") == f"Bearer {key}"

    # -- writing -----------------------------------------------------------------------------

    def _send_json(self, status: int, payload: Any, headers: dict[str, str] | None = None) -> None:
        data = json.dumps(payload).encode()
        self.send_response(status)
        self.send_header("Content-Type", "application/json")
        self.send_header("Content-Length", str(len(data)))
        for name, value in (headers or {}).items():
            self.send_header(name, value)
        self.end_headers()
        self.wfile.write(data)

    def _send_error(
        self,
        status: int,
        error_type: str,
        message: str,
        code: str | None,
        headers: dict[str, str] | None = None,
    ) -> None:
        self._send_json(status, error_body(message, error_type, code), headers)

    def _send_unauthorized(self) -> None:
        self._send_error(
            401,
            "invalid_request_error",
            "Incorrect API key provided (fake).",
            "invalid_api_key",
            {"WWW-Authenticate": 'Bearer realm="fake-openai"'},
        )

    def _send_cut_json(self, payload: Any) -> None:
        """Promise the whole body, send half, hang up: the client sees a broken connection."""
        data = json.dumps(payload).encode()
        self.send_response(200)
        self.send_header("Content-Type", "application/json")
        self.send_header("Content-Length", str(len(data)))
        self.end_headers()
        self.wfile.write(data[: len(data) // 2])
        self._hang_up()

    def _start_sse(self) -> None:
        # Chunked rather than Connection: close, so a cut stream (no terminating chunk) is a
        # protocol error the SDK raises, instead of a clean end of body.
        self.send_response(200)
        self.send_header("Content-Type", "text/event-stream; charset=utf-8")
        self.send_header("Cache-Control", "no-cache")
        self.send_header("Transfer-Encoding", "chunked")
        self.end_headers()

    def _send_sse(self, data: str) -> None:
        event = f"data: {data}\n\n".encode()
        self.wfile.write(b"%x\r\n%s\r\n" % (len(event), event))

    def _end_sse(self) -> None:
        self._send_sse("[DONE]")
        self.wfile.write(b"0\r\n\r\n")

    def _hang_up(self) -> None:
        self.close_connection = True
        with contextlib.suppress(OSError):  # the client may have hung up first
            self.connection.shutdown(socket.SHUT_RDWR)


def model_body(model_id: str) -> dict[str, Any]:
    return {"id": model_id, "object": "model", "created": 0, "owned_by": "fake-openai"}
