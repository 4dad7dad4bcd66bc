"""The body limit under ASGI (uvicorn, docs/streaming.md): Django's ASGIHandler reads a whole
body before any middleware runs, so a client with no token could make the server take in a body
of any size before its 401 or 413. Driven through the ASGI application uvicorn serves."""

import asyncio
import json
from typing import Any

import pytest

from chatmem_project.asgi import application

MIB = 1024 * 1024


def scope(path: str, headers: list[tuple[bytes, bytes]]) -> dict[str, Any]:
    return {
        "type": "http",
        "asgi": {"version": "3.0"},
        "http_version": "1.1",
        "method": "POST",
        "scheme": "http",
        "path": path,
        "raw_path": path.encode(),
        "query_string": b"",
        "root_path": "",
        "headers": [(b"host", b"localhost"), (b"content-type", b"application/json"), *headers],
        "client": ("127.0.0.1", 1),
        "server": ("localhost", 8000),
    }


def serve(path: str, chunks: int, headers: list[tuple[bytes, bytes]]) -> tuple[int, int, Any]:
    """Offers ``chunks`` MiB of body; returns the status, the MiB the server read, the body."""
    read = 0
    sent: list[dict[str, Any]] = []

    async def receive() -> dict[str, Any]:
        nonlocal read
        if read < chunks:
            read += 1
            return {"type": "http.request", "body": b"x" * MIB, "more_body": read < chunks}
        await asyncio.sleep(3600)  # the client waits for its answer (Django cancels this wait)
        return {"type": "http.disconnect"}

    async def send(message: dict[str, Any]) -> None:
        sent.append(message)

    asyncio.run(application(scope(path, headers), receive, send))
    status = next(m["status"] for m in sent if m["type"] == "http.response.start")
    body = b"".join(m.get("body", b"") for m in sent if m["type"] == "http.response.body")
    return status, read, body


def test_a_chunked_body_is_refused_as_it_passes_the_limit(settings: Any) -> None:
    settings.CHATMEM_MAX_BODY_BYTES = MIB
    status, read, body = serve("/api/v1/chats/", chunks=50, headers=[])
    assert status == 413
    assert read == 2  # the second MiB passed the limit; the other 48 were never taken in
    assert json.loads(body)["code"] == "request_too_large"


def test_a_declared_length_over_the_limit_is_refused_before_reading(settings: Any) -> None:
    settings.CHATMEM_MAX_BODY_BYTES = MIB
    status, read, body = serve("/v1/chat/completions", 50, [(b"content-length", b"52428800")])
    assert (status, read) == (413, 0)
    assert json.loads(body)["error"]["code"] == "request_too_large"  # /v1: OpenAI's shape


@pytest.mark.django_db
def test_a_body_within_the_limit_reaches_the_application(settings: Any) -> None:
    settings.CHATMEM_MAX_BODY_BYTES = 4 * MIB
    status, read, _ = serve("/api/v1/chats/", chunks=2, headers=[])
    assert (status, read) == (401, 2)  # Django's answer: no token
