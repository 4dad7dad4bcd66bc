"""A request id on every log line of a request, of the stream it answers with, and of the tasks
it enqueued."""

from __future__ import annotations

import http.client
import json
import logging
from types import SimpleNamespace
from typing import Any
from urllib.parse import urlsplit

import pytest

from chatmem_project.logs import JsonFormatter
from chatmem_project.request_id import (
    TASK_HEADER,
    carry_request_id,
    clear_request_id,
    current_request_id,
    restore_request_id,
)
from conversations.models import Brief
from tests.conftest import client_for
from tests.support.fake_openai import FakeOpenAI
from tests.support.workers import Worker, wait_until
from tests.test_streaming_turns import (  # noqa: F401  (fixtures)
    DEADLINE,
    Stream,
    _turn_threads_finish,
    eventually,
    new_chat,
    server_url,
    slot_free,
    token,
    uvicorn_url,
)
from tests.test_worker import celery_broker  # noqa: F401  (fixture)


class Lines(logging.Handler):
    def __init__(self) -> None:
        super().__init__()
        self.setFormatter(JsonFormatter())
        self.lines: list[dict[str, Any]] = []

    def emit(self, record: logging.LogRecord) -> None:
        self.lines.append(json.loads(self.format(record)))


@pytest.mark.django_db
def test_the_id_is_echoed_and_on_the_requests_log_lines(api: Any) -> None:
    handler = Lines()
    logging.getLogger("chatmem").addHandler(handler)
    try:
        chat_id = api.post("/api/v1/chats/", {"policy": "contract"}, format="json").json()["id"]
        for number in range(8):  # contract folds synchronously on the request path: a log line
            response = api.post(
                f"/api/v1/chats/{chat_id}/turns/",
                {"content": f"message {number}"},
                format="json",
                HTTP_X_REQUEST_ID=f"req-{number}",
            )
            assert response["X-Request-ID"] == f"req-{number}"
    finally:
        logging.getLogger("chatmem").removeHandler(handler)
    sync_folds = [line for line in handler.lines if line.get("event") == "sync_fold"]
    assert sync_folds and all(line["request_id"].startswith("req-") for line in sync_folds)
    assert current_request_id.get() is None  # reset after the request


@pytest.mark.django_db
def test_a_bad_offered_id_is_replaced(api: Any) -> None:
    response = api.get("/api/v1/chats/", HTTP_X_REQUEST_ID="not ok\n" + "x" * 100)
    assert len(response["X-Request-ID"]) == 32 and "\n" not in response["X-Request-ID"]


def test_celery_carries_the_id_in_a_header() -> None:
    set_token = current_request_id.set("req-celery")
    headers: dict[str, Any] = {}
    try:
        carry_request_id(headers=headers)
    finally:
        current_request_id.reset(set_token)
    assert headers == {TASK_HEADER: "req-celery"}
    restore_request_id(task=SimpleNamespace(request=SimpleNamespace(**headers)))
    assert current_request_id.get() == "req-celery"
    clear_request_id()
    assert current_request_id.get() is None


def test_a_worker_logs_the_id_of_the_turn_that_queued_its_fold(
    require_postgres: None,
    celery_broker: str,  # noqa: F811
    user: Any,
) -> None:
    worker = Worker(celery_broker, "request-id")
    try:
        worker.wait_ready()
        api = client_for(user)
        body = {"policy": "sliding-window", "policy_overrides": {"tail_messages": 2}}
        chat_id = api.post("/api/v1/chats/", body, format="json").json()["id"]
        for number in range(6):  # backlog 10 < window 12: no fold is queued by the turns
            api.post(
                f"/api/v1/chats/{chat_id}/turns/", {"content": f"fact {number}"}, format="json"
            )
        queued = api.post(
            f"/api/v1/chats/{chat_id}/consolidate/", HTTP_X_REQUEST_ID="manual-fold-1"
        )
        assert queued.status_code == 202

        def fold_lines() -> list[dict[str, Any]]:
            return [
                json.loads(line)
                for line in worker.log().splitlines()
                if line.startswith("{") and '"event": "fold"' in line
            ]

        assert wait_until(lambda: bool(fold_lines()), timeout=30), worker.log()
        assert [fold["request_id"] for fold in fold_lines()] == ["manual-fold-1"]
        assert Brief.objects.get(chat_id=chat_id).last_consolidated == 10
    finally:
        worker.stop()


def test_the_embedded_runner_logs_the_id_of_the_request_that_queued_its_fold(
    settings: Any, user: Any, transactional_db: None
) -> None:
    """The in-process runner's thread starts with an empty context: its fold lines had none."""
    from memory_worker.coordination.dispatch import drain_inline

    settings.MEMORY_DISPATCH = "inline"
    settings.MEMORY_DAILY_NOTES = False  # no hook task left running into the flush
    handler = Lines()
    logging.getLogger("chatmem").addHandler(handler)
    try:
        api = client_for(user)
        body = {"policy": "sliding-window", "policy_overrides": {"tail_messages": 2}}
        chat_id = api.post("/api/v1/chats/", body, format="json").json()["id"]
        for number in range(6):  # backlog 10 < window 12: the turns queue no fold
            api.post(
                f"/api/v1/chats/{chat_id}/turns/", {"content": f"fact {number}"}, format="json"
            )
        queued = api.post(
            f"/api/v1/chats/{chat_id}/consolidate/", HTTP_X_REQUEST_ID="inline-fold-1"
        )
        assert queued.status_code == 202
        drain_inline()  # and what the fold queued after it (its flush hooks)
    finally:
        logging.getLogger("chatmem").removeHandler(handler)
    folds = [line for line in handler.lines if line.get("event") == "fold"]
    assert [fold.get("request_id") for fold in folds] == ["inline-fold-1"]
    assert Brief.objects.get(chat_id=chat_id).last_consolidated == 10


# A streamed turn is written after the response left RequestIdMiddleware, which resets the id:
# its stream_disconnect line carries the request's id all the same.


def streamed_turn(url_of: str, key: str, chat_id: int, request_id: str) -> Stream:
    url = urlsplit(url_of)
    connection = http.client.HTTPConnection(url.hostname or "", url.port, timeout=DEADLINE)
    connection.request(
        "POST",
        f"/api/v1/chats/{chat_id}/turns/",
        body=json.dumps({"content": "a long answer please", "stream": True}),
        headers={
            "Authorization": f"Token {key}",
            "Content-Type": "application/json",
            "Accept": "text/event-stream",
            "X-Request-ID": request_id,
        },
    )
    return Stream(connection)


@pytest.mark.django_db(transaction=True)
def test_the_disconnect_line_has_the_request_id(
    api: Any,
    server_url: str,  # noqa: F811  (the fixture, imported above)
    token: str,  # noqa: F811
    use_fake_openai: FakeOpenAI,
) -> None:
    use_fake_openai.chunk_delay = 0.05
    use_fake_openai.reply_words = 40  # about a second of streaming
    lines = Lines()  # formats each record as it is logged, on the server's thread
    logger = logging.getLogger("chatmem.turn")
    logger.addHandler(lines)
    try:
        chat_id = new_chat(api)
        stream = streamed_turn(server_url, token, chat_id, "stream-req-7")
        assert stream.response.getheader("X-Request-ID") == "stream-req-7"
        events = stream.events()
        assert next(events).name == "accepted"
        stream.hang_up()
        disconnect = eventually(
            lambda: [line for line in lines.lines if line.get("event") == "stream_disconnect"],
            "the server notices the disconnect",
        )[0]
        eventually(lambda: slot_free(chat_id), "the turn is stored and its slot released")
    finally:
        logger.removeHandler(lines)
    assert disconnect["chat_id"] == chat_id
    assert disconnect.get("request_id") == "stream-req-7", disconnect
