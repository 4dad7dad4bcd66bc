"""What gunicorn hands chatmem, and what it answers itself, under a real gunicorn process on the
test database: a chunked request body (Transfer-Encoding: chunked, no Content-Length) is read,
within CHATMEM_MAX_BODY_BYTES, not taken for an empty body; what gunicorn refuses before the
application (a request line over its limit: 414) is JSON like every other error. Under a WSGI
server that does not end the body's stream (wsgiref: runserver, serve_demo) a chunked body is a
JSON 411."""

from __future__ import annotations

import io
import json
import os
import socket
import subprocess
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest
from django.db import connection
from rest_framework.authtoken.models import Token

from bench.throughput import free_port, gunicorn_command
from conversations.middleware import WsgiChunkedBody
from conversations.models import Chat

ROOT = Path(__file__).resolve().parent.parent
DEADLINE = 30.0  # seconds; the server's start is polled up to this
BODY_LIMIT = 2000


def database_url() -> str:
    db = connection.settings_dict
    user, host, port = db["USER"] or "postgres", db["HOST"] or "127.0.0.1", db["PORT"] or 5432
    return f"postgres://{user}@{host}:{port}/{db['NAME']}"


def exchange(port: int, raw: bytes) -> tuple[int, dict[str, str], bytes]:
    """Sends ``raw`` as it is; the status, headers (lower-case names) and body of the answer."""
    with socket.create_connection(("127.0.0.1", port), timeout=DEADLINE) as sock:
        sock.sendall(raw)
        answer = b""
        while chunk := sock.recv(65536):
            answer += chunk
    head, _, body = answer.partition(b"\r\n\r\n")
    lines = head.decode("latin-1").split("\r\n")
    headers = dict(line.split(": ", 1) for line in lines[1:])
    return int(lines[0].split()[1]), {k.lower(): v for k, v in headers.items()}, body


@pytest.fixture
def server(require_postgres: None) -> Iterator[int]:
    port = free_port()
    env = {
        **os.environ,
        "DJANGO_SETTINGS_MODULE": "chatmem_project.settings",
        "DATABASE_URL": database_url(),
        "CHAT_BACKEND": "offline",
        "REDIS_URL": "",
        "CHATMEM_MAX_BODY_BYTES": str(BODY_LIMIT),
    }
    command = gunicorn_command(port, workers=1, threads=2, worker_class="gthread")
    process = subprocess.Popen(
        command, cwd=ROOT, env=env, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True
    )
    try:
        deadline = time.monotonic() + DEADLINE
        while True:
            try:
                if (
                    exchange(
                        port, b"GET /healthz HTTP/1.1\r\nHost: x\r\nConnection: close\r\n\r\n"
                    )[0]
                    == 200
                ):
                    break
            except OSError:
                pass
            if process.poll() is not None:
                pytest.fail(f"gunicorn exited: {process.stdout.read()}")  # type: ignore[union-attr]
            assert time.monotonic() < deadline, "gunicorn did not answer /healthz"
            time.sleep(0.1)  # still booting: poll until the deadline
        yield port
    finally:
        process.terminate()
        process.communicate(timeout=DEADLINE)


def chunked_post(path: str, token: str, body: bytes, piece: int = 7) -> bytes:
    chunks = b"".join(
        b"%x\r\n%s\r\n" % (len(body[i : i + piece]), body[i : i + piece])
        for i in range(0, len(body), piece)
    )
    return (
        (
            f"POST {path} HTTP/1.1\r\nHost: 127.0.0.1\r\nAuthorization: Token {token}\r\n"
            "Content-Type: application/json\r\nTransfer-Encoding: chunked\r\n"
            "Connection: close\r\n\r\n"
        ).encode()
        + chunks
        + b"0\r\n\r\n"
    )


def test_a_chunked_body_is_read(server: int, user: Any) -> None:
    token = Token.objects.create(user=user).key
    body = json.dumps({"title": "sent in chunks"}).encode()
    status, _, answer = exchange(server, chunked_post("/api/v1/chats/", token, body))
    assert status == 201, answer
    assert json.loads(answer)["title"] == "sent in chunks"
    assert Chat.objects.get(owner=user).title == "sent in chunks"


def test_a_chunked_body_over_the_limit_is_a_json_413(server: int, user: Any) -> None:
    token = Token.objects.create(user=user).key
    body = json.dumps({"title": "x", "system_prompt": "y" * BODY_LIMIT}).encode()
    status, headers, answer = exchange(server, chunked_post("/api/v1/chats/", token, body, 500))
    assert status == 413, answer
    assert json.loads(answer)["code"] == "request_too_large"
    assert headers["x-should-retry"] == "false"
    assert not Chat.objects.exists()


def test_a_request_line_over_gunicorns_limit_is_a_json_414(server: int) -> None:
    raw = f"GET /api/v1/chats/?q={'a' * 5000} HTTP/1.1\r\nHost: 127.0.0.1\r\n\r\n".encode()
    status, headers, answer = exchange(server, raw)
    assert status == 414, answer
    assert headers["content-type"] == "application/json"
    assert headers["x-should-retry"] == "false"
    assert json.loads(answer)["code"] == "uri_too_long"


def test_a_server_that_does_not_end_the_body_refuses_a_chunked_one_with_a_json_411() -> None:
    answered: list[Any] = []

    def start_response(status: str, headers: list[tuple[str, str]]) -> None:
        answered.extend([status, dict(headers)])

    def never_called(environ: Any, start_response: Any) -> Any:
        raise AssertionError("the application must not see the request")

    environ = {
        "PATH_INFO": "/api/v1/chats/",
        "HTTP_TRANSFER_ENCODING": "chunked",
        "wsgi.input": io.BytesIO(b"5\r\nhello\r\n0\r\n\r\n"),
    }
    body = b"".join(WsgiChunkedBody(never_called)(environ, start_response))
    assert answered[0] == "411 Length Required"
    assert answered[1]["x-should-retry"] == "false"
    assert json.loads(body)["code"] == "length_required"
