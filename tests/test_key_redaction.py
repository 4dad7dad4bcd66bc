"""An upstream (or a gateway in front of it) that echoes the operator's key and its own address
in its error bodies, before a stream or in the middle of one: neither reaches a chat's owner (a
REST turn, its stream, /v1 and its stream, the brief, the ledger, their rows as stored) nor a
log line at INFO or above, whatever the key's format."""

from __future__ import annotations

import json
import logging
import secrets
import threading
from collections.abc import Iterator
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from typing import Any

import pytest
from rest_framework.authtoken.models import Token

from conversations.chat_model.http import MAX_LOGGED_BODY, DirectStatusError
from conversations.chat_model.transport import redact, register_secrets
from conversations.models import Brief, Consolidation
from memory_worker.coordination.dispatch import RequestReason
from memory_worker.folding import execute as folds
from tests.test_fold_errors import chat_with_a_fold_due

pytestmark = pytest.mark.django_db

# Not a format any pattern knows: only the configured value can find it.
KEY = "pplx-" + secrets.token_hex(12)
STATUSES = [400, 401, 404, 413, 422, 500, 503]


class EchoingUpstream(BaseHTTPRequestHandler):
    """Answers every request with the configured status and a body that repeats the request's
    Authorization header, its key and the Host it was sent to."""

    status = 400  # 200: a streamed request gets a first delta, then the error as an event

    def do_POST(self) -> None:
        request = json.loads(self.rfile.read(int(self.headers.get("Content-Length") or 0)))
        authorization = self.headers.get("Authorization", "")
        host = self.headers.get("Host", "")
        message = (
            f"Incorrect API key provided: {authorization}. Key {authorization[7:]} is not "
            f"valid for http://{host}/v1 ({host.split(':')[0]})."
        )
        body = json.dumps({"error": {"message": message, "type": "invalid_request_error"}})
        if self.status == 200 and request.get("stream"):
            self.send_mid_stream_error(body)
            return
        self.send_response(self.status)
        self.send_header("Content-Type", "application/json")
        self.send_header("Content-Length", str(len(body)))
        self.end_headers()
        self.wfile.write(body.encode())

    def send_mid_stream_error(self, error: str) -> None:
        delta = {
            "index": 0,
            "delta": {"role": "assistant", "content": "Hel"},
            "finish_reason": None,
        }
        first = {"id": "c1", "object": "chat.completion.chunk", "model": "echo", "choices": [delta]}
        events = f"data: {json.dumps(first)}\n\ndata: {error}\n\n".encode()
        self.send_response(200)
        self.send_header("Content-Type", "text/event-stream")
        self.send_header("Content-Length", str(len(events)))
        self.end_headers()
        self.wfile.write(events)

    def log_message(self, format: str, *args: Any) -> None:
        pass


@pytest.fixture
def upstream(settings: Any) -> Iterator[tuple[type[EchoingUpstream], str]]:
    handler = type("Echo", (EchoingUpstream,), {})
    server = ThreadingHTTPServer(("127.0.0.1", 0), handler)
    threading.Thread(target=server.serve_forever, daemon=True).start()
    # A name, not the address the test server also uses: "localhost" is the host to hide.
    host = f"localhost:{server.server_address[1]}"
    settings.OPENAI_BASE_URL = f"http://{host}/v1"
    settings.OPENAI_API_KEY = KEY
    settings.CHAT_BACKEND, settings.MEMORY_SUMMARIZER_BACKEND = "openai", "chat"
    settings.CHAT_MODEL = settings.MEMORY_SUMMARIZER_MODEL = "echo"
    settings.LLM_TIMEOUT_SECONDS = settings.MEMORY_LLM_TIMEOUT_SECONDS = 5.0
    yield handler, host
    server.shutdown()
    server.server_close()


def leaks(text: str, host: str) -> list[str]:
    return [secret for secret in (KEY, host, "localhost") if secret in text]


def logged(caplog: pytest.LogCaptureFixture) -> str:
    lines = []
    for record in caplog.records:
        if record.levelno >= logging.INFO:
            lines.append(record.getMessage())
            lines.append(json.dumps(record.__dict__, default=str))
            if record.exc_info:
                lines.append(logging.Formatter().formatException(record.exc_info))
    return "\n".join(lines)


def v1_completion(api: Any, user: Any, **body: Any) -> Any:
    return api.post(
        "/v1/chat/completions",
        {"model": "default", "messages": [{"role": "user", "content": "hi"}], **body},
        format="json",
        HTTP_AUTHORIZATION=f"Bearer {Token.objects.get(user=user).key}",
    )


def text_of(response: Any) -> str:
    if getattr(response, "streaming", False):
        return b"".join(response.streaming_content).decode()
    return str(response.content.decode())


@pytest.mark.parametrize("status", [*STATUSES, 200])
def test_no_turn_shows_or_logs_the_key_or_the_endpoint(
    api: Any, user: Any, upstream: Any, status: int, caplog: pytest.LogCaptureFixture
) -> None:
    """Every status before the reply starts; 200: an error event in the middle of the model's
    stream (the JSON requests then get no reply at all: 502)."""
    handler, host = upstream
    handler.status = status
    chat_id = int(api.post("/api/v1/chats/", {}, format="json").json()["id"])
    url = f"/api/v1/chats/{chat_id}/turns/"
    with caplog.at_level(logging.INFO):
        plain = api.post(url, {"content": "hi"}, format="json")
        streamed = text_of(api.post(url, {"content": "hi", "stream": True}, format="json"))
        v1 = v1_completion(api, user)
        v1_streamed = v1_completion(api, user, stream=True)
        v1_stream_text = text_of(v1_streamed)
    assert plain.status_code >= 500 and v1.status_code >= 400
    assert "event: error" in streamed  # the stream told its client what went wrong
    if v1_streamed.status_code == 200:  # the error came as the stream's last event
        assert '"error"' in v1_stream_text, v1_stream_text
    else:
        assert v1_streamed.status_code >= 400
    shown = (plain.content.decode(), streamed, v1.content.decode(), v1_stream_text)
    for text in (*shown, logged(caplog)):
        assert leaks(text, host) == [], text[-1500:]


@pytest.mark.parametrize("status", STATUSES)
def test_no_fold_error_shows_or_logs_the_key_or_the_endpoint(
    api: Any, upstream: Any, settings: Any, status: int, caplog: pytest.LogCaptureFixture
) -> None:
    handler, host = upstream
    settings.CHAT_BACKEND = "offline"  # the turns answer; the summarizer meets the upstream
    chat_id = chat_with_a_fold_due(api)
    handler.status = status
    with caplog.at_level(logging.INFO):
        assert folds.fold_once(chat_id, RequestReason.TURN).status == "failed"
    brief = api.get(f"/api/v1/chats/{chat_id}/brief/").content.decode()
    ledger = api.get(f"/api/v1/chats/{chat_id}/consolidations/").content.decode()
    # The rows themselves (the admin shows them), every column.
    rows = json.dumps(
        [
            *Brief.objects.filter(chat_id=chat_id).values(),
            *Consolidation.objects.filter(chat_id=chat_id).values(),
        ],
        default=str,
    )
    assert Consolidation.objects.filter(chat_id=chat_id, status="failed").exists()
    for shown in (brief, ledger, rows, logged(caplog)):
        assert leaks(shown, host) == [], shown[-1500:]


def test_a_bearer_credential_of_any_shape_and_the_configured_endpoint_are_redacted() -> None:
    register_secrets("http://user:hunter2hunter2@gateway.internal:8443/v1", "opaque-key-123456")
    text = (
        "401 Bearer eyJhbGciOi.J9.x at gateway.internal:8443 (gateway.internal), "
        "key opaque-key-123456, password hunter2hunter2"
    )
    assert redact(text) == (
        "401 Bearer [redacted] at [redacted] ([redacted]), key [redacted], password [redacted]"
    )
    assert redact("an ordinary sentence") == "an ordinary sentence"


@pytest.mark.parametrize("cut", range(1, 20))
def test_a_key_at_the_edge_of_the_logged_error_body_leaves_no_fragment(cut: int) -> None:
    """The body is redacted whole, then cut: cut first, a key straddling the edge would be too
    short for its pattern, and its start would reach the log."""
    key = "sk-proj-" + "A1b2C3d4E5f6G7h8J9k0" * 2
    body = ("x" * (MAX_LOGGED_BODY - cut - 1) + " " + key + " was rejected").encode()
    logged = str(DirectStatusError(401, body))
    assert key[:cut] not in logged.removeprefix("HTTP 401: ").lstrip("x ")
