"""Streamed turns (server-sent events) through real HTTP servers, read with http.client so a test
controls exactly when it stops reading and hangs up. Every test that posts a turn runs twice:
against pytest-django's live_server (a threaded WSGI server, like gunicorn's gthread workers) and
against uvicorn serving chatmem_project.asgi (the ASGI entry point, an async iterator)."""

import http.client
import json
import logging
import socket
import struct
import threading
import time
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from typing import Any
from urllib.parse import urlsplit

import pytest
from asgiref.sync import async_to_sync
from django.test import AsyncClient
from rest_framework.authtoken.models import Token

from conversations.api.serializers import MessageSerializer
from conversations.models import Chat, Message
from tests.conftest import require
from tests.support.fake_openai import FakeOpenAI
from tests.support.http_turns import send_turn

pytestmark = pytest.mark.django_db(transaction=True)

DEADLINE = 10.0  # seconds; every wait below polls up to this and then fails


# ---------------------------------------------------------------------------------------------
# helpers


def eventually(predicate: Callable[[], Any], what: str, timeout: float = DEADLINE) -> Any:
    deadline = time.monotonic() + timeout
    while True:
        value = predicate()
        if value:
            return value
        if time.monotonic() > deadline:
            pytest.fail(f"not within {timeout} s: {what}")
        time.sleep(0.02)


@dataclass
class Event:
    name: str  # "comment" for a `: ...` line
    data: Any


class Stream:
    """One streamed turn request: the response, its events, and a way to hang up hard."""

    def __init__(self, connection: http.client.HTTPConnection) -> None:
        self.connection = connection
        self.socket = connection.sock
        self.response = connection.getresponse()

    @property
    def content_type(self) -> str:
        return self.response.getheader("Content-Type", "")

    def events(self) -> Iterator[Event]:
        name: str | None = None
        data: list[str] = []
        comment = False
        while True:
            raw = self.response.readline()
            if not raw:
                return
            line = raw.decode().rstrip("\r\n")
            if line == "":
                if name is not None:
                    yield Event(name, json.loads("\n".join(data)))
                elif comment:
                    yield Event("comment", None)
                name, data, comment = None, [], False
            elif line.startswith(":"):
                comment = True
            elif line.startswith("event:"):
                name = line.removeprefix("event:").strip()
            elif line.startswith("data:"):
                data.append(line.removeprefix("data:").removeprefix(" "))

    def all_events(self) -> list[Event]:
        return list(self.events())

    def hang_up(self) -> None:
        # Linger 0: close with a reset, so the server's next write fails at once, as when a
        # phone drops off the network, instead of after the kernel's buffers fill.
        assert self.socket is not None
        self.socket.setsockopt(socket.SOL_SOCKET, socket.SO_LINGER, struct.pack("ii", 1, 0))
        self.response.close()
        self.connection.close()
        self.socket.close()


@pytest.fixture
def token(user) -> str:  # type: ignore[no-untyped-def]
    return Token.objects.get_or_create(user=user)[0].key


@pytest.fixture
def uvicorn_url(transactional_db: None, monkeypatch: pytest.MonkeyPatch) -> Iterator[str]:
    """uvicorn on a thread, serving the Django ASGI application against the test database."""
    try:
        import uvicorn
    except ImportError:
        require("uvicorn", "the ASGI server is not installed (pip install -e '.[test]')")
    from django.db import connections

    from chatmem_project.asgi import application

    # Each ASGI request runs the sync view on its own executor thread; with persistent
    # connections those threads' connections would outlive the test (and block dropping the
    # test database). Age 0: Django closes them when each request finishes.
    monkeypatch.setitem(connections.settings["default"], "CONN_MAX_AGE", 0)
    config = uvicorn.Config(
        application, host="127.0.0.1", port=0, lifespan="off", log_level="warning"
    )
    server = uvicorn.Server(config)
    thread = threading.Thread(target=server.run, name="uvicorn-test", daemon=True)
    thread.start()
    eventually(lambda: server.started, "uvicorn starts")
    port = server.servers[0].sockets[0].getsockname()[1]
    yield f"http://127.0.0.1:{port}"
    server.should_exit = True
    thread.join(DEADLINE)


@pytest.fixture(params=["wsgi", "asgi"])
def server_url(request: pytest.FixtureRequest) -> str:
    if request.param == "wsgi":
        return str(request.getfixturevalue("live_server").url)
    return str(request.getfixturevalue("uvicorn_url"))


@pytest.fixture
def post_turn(server_url: str, token: str) -> Callable[..., Stream]:
    url = urlsplit(server_url)

    def post(chat_id: int, body: dict[str, Any], accept: str = "text/event-stream") -> Stream:
        connection = http.client.HTTPConnection(url.hostname or "", url.port, timeout=DEADLINE)
        send_turn(connection, token, chat_id, body, accept)
        return Stream(connection)

    return post


@pytest.fixture(autouse=True)
def _turn_threads_finish() -> Iterator[None]:
    """A turn thread still writing while the test database is flushed would leak into the next
    test; every test waits for its turns, and this fails the test if one is still running."""
    yield
    deadline = time.monotonic() + DEADLINE
    for thread in threading.enumerate():
        if thread.name.startswith("chatmem-turn-"):
            thread.join(max(0.0, deadline - time.monotonic()))
            assert not thread.is_alive(), f"{thread.name} did not finish"


def new_chat(api, **body) -> int:  # type: ignore[no-untyped-def]
    response = api.post("/api/v1/chats/", body, format="json")
    assert response.status_code == 201, response.content
    return int(response.json()["id"])


def stored(chat_id: int) -> list[Message]:
    return list(Message.objects.filter(chat_id=chat_id).order_by("seq"))


def slot_free(chat_id: int) -> bool:
    return Chat.objects.get(pk=chat_id).turn_token is None


def names(events: list[Event]) -> list[str]:
    return [event.name for event in events if event.name != "comment"]


# ---------------------------------------------------------------------------------------------
# the happy path


def test_events_in_order_and_deltas_join_to_the_stored_reply(  # type: ignore[no-untyped-def]
    api, post_turn, use_fake_openai: FakeOpenAI
) -> None:
    use_fake_openai.chunk_delay = 0.01
    use_fake_openai.reply_words = 12
    chat_id = new_chat(api)
    stream = post_turn(chat_id, {"content": "tell me a story", "stream": True})
    assert stream.response.status == 200
    assert stream.content_type.startswith("text/event-stream")
    assert stream.response.getheader("Cache-Control") == "no-cache"
    events = stream.all_events()

    kinds = names(events)
    assert kinds[0] == "accepted"
    assert kinds[-1] == "done"
    assert kinds[1:-1] == ["delta"] * (len(kinds) - 2)
    assert len(kinds) - 2 >= 2, "the reply should arrive in several deltas"
    accepted = events[0].data
    assert accepted["chat_id"] == chat_id
    assert accepted["user_message"]["content"] == "tell me a story"
    assert accepted["user_message"]["pending"] is True
    assert accepted["user_message"]["token_count"] > 0

    deltas = "".join(e.data["content"] for e in events if e.name == "delta")
    done = events[-1].data
    user_message, assistant_message = stored(chat_id)
    assert deltas == assistant_message.content == done["assistant_message"]["content"]
    assert len(deltas.split()) == 12
    # The same serializer as the JSON turn: seq, role, content, token_count, created_at ...
    assert done["user_message"] == MessageSerializer(user_message).data
    assert done["assistant_message"] == MessageSerializer(assistant_message).data
    assert (user_message.seq, assistant_message.seq) == (1, 2)
    assert done["user_message"]["token_count"] == accepted["user_message"]["token_count"]
    assert assistant_message.metadata["finish_reason"] == "stop"
    assert Chat.objects.get(pk=chat_id).last_seq == 2
    assert slot_free(chat_id)
    assert use_fake_openai.chat_requests()[-1]["body"]["stream"] is True


def test_accept_header_alone_streams_and_stream_false_wins(api, post_turn) -> None:  # type: ignore[no-untyped-def]
    chat_id = new_chat(api)  # the offline model streams word by word
    events = post_turn(chat_id, {"content": "hello there"}).all_events()
    assert names(events)[0] == "accepted" and names(events)[-1] == "done"
    deltas = "".join(e.data["content"] for e in events if e.name == "delta")
    assert deltas == stored(chat_id)[1].content
    assert deltas.startswith("[offline model] You said: hello there.")

    plain = post_turn(chat_id, {"content": "again", "stream": False})
    assert plain.response.status == 201
    assert plain.content_type == "application/json"
    assert json.loads(plain.response.read())["assistant_message"]["seq"] == 4


def test_json_clients_are_unaffected(api, post_turn) -> None:  # type: ignore[no-untyped-def]
    chat_id = new_chat(api)
    response = post_turn(chat_id, {"content": "plain json"}, accept="application/json")
    assert response.response.status == 201
    assert json.loads(response.response.read())["user_message"]["seq"] == 1


def test_done_is_sent_before_the_memory_hooks_run(  # type: ignore[no-untyped-def]
    api, post_turn, monkeypatch
) -> None:
    """The consolidation check runs after commit, and `done` does not wait for it: here the
    check blocks until the client has read `done`, so `done` arriving at all proves the order
    (sent later, it would arrive only after the check gave up waiting)."""
    from conversations.services import turn_store

    client_has_done = threading.Event()
    checked: list[tuple[int, list[int], bool]] = []

    def slow_check(chat, snapshot) -> None:  # type: ignore[no-untyped-def]
        stored_now = Message.objects.filter(chat_id=chat.pk).count() == 2  # after commit
        waited = client_has_done.wait(DEADLINE)
        checked.append((chat.pk, [m.seq for m in snapshot.unfolded], stored_now and waited))

    monkeypatch.setattr(turn_store, "queue_fold_if_due", slow_check)
    chat_id = new_chat(api)
    started = time.monotonic()
    stream = post_turn(chat_id, {"content": "hi", "stream": True})
    kinds = []
    for event in stream.events():
        kinds.append(event.name)
        if event.name == "done":
            assert time.monotonic() - started < DEADLINE / 2, "done waited for the memory hook"
            client_has_done.set()
    assert kinds[-1] == "done"
    eventually(lambda: checked, "the consolidation check ran")
    assert checked == [(chat_id, [1, 2], True)]


def test_keep_alive_comments_while_waiting_for_the_first_token(  # type: ignore[no-untyped-def]
    api, post_turn, use_fake_openai: FakeOpenAI, settings
) -> None:
    settings.TURN_STREAM_HEARTBEAT_SECONDS = 0.05
    use_fake_openai.latency = 0.5
    chat_id = new_chat(api)
    events = post_turn(chat_id, {"content": "slow start", "stream": True}).all_events()
    kinds = [event.name for event in events]
    assert kinds[0] == "accepted"
    assert "comment" in kinds[1 : kinds.index("delta")]
    assert kinds[-1] == "done"


# ---------------------------------------------------------------------------------------------
# failures


@pytest.mark.parametrize(
    ("fault", "status", "code", "min_deltas"),
    [
        ("stream_cut", 502, "model_error", 1),  # the model's stream breaks after two chunks
        ("500", 502, "model_error", 0),
        ("timeout", 504, "model_timeout", 0),
    ],
)
def test_model_failure_is_an_error_event_and_stores_nothing(  # type: ignore[no-untyped-def]
    api, post_turn, use_fake_openai: FakeOpenAI, settings, fault, status, code, min_deltas
) -> None:
    settings.LLM_TIMEOUT_SECONDS = 0.5
    use_fake_openai.timeout_sleep = 1.5
    chat_id = new_chat(api)
    use_fake_openai.queue_faults("chat", [fault])
    events = post_turn(chat_id, {"content": "one two three four", "stream": True}).all_events()

    kinds = names(events)
    assert kinds[0] == "accepted"
    assert kinds[-1] == "error"
    assert "done" not in kinds
    assert kinds.count("delta") >= min_deltas
    error = events[-1].data
    assert error["code"] == code
    assert error["status"] == status
    assert error["retry"] is True
    assert "Nothing was stored" in error["detail"]
    assert stored(chat_id) == []
    assert Chat.objects.get(pk=chat_id).last_seq == 0
    eventually(lambda: slot_free(chat_id), "the turn slot is released")
    retry = post_turn(chat_id, {"content": "one two three four", "stream": True}).all_events()
    assert names(retry)[-1] == "done"
    assert [m.seq for m in stored(chat_id)] == [1, 2]


def test_a_prompt_the_model_refuses_as_over_its_window_says_not_to_retry(  # type: ignore[no-untyped-def]
    api, post_turn, use_fake_openai: FakeOpenAI
) -> None:
    """llama.cpp's server starts the stream, then sends its context-size error as an event:
    the same turn would be refused again, so the error event says not to send it again."""
    chat_id = new_chat(api)
    use_fake_openai.queue_faults("chat", ["context_exceeded"])
    events = post_turn(chat_id, {"content": "one two three four", "stream": True}).all_events()
    assert names(events)[-1] == "error"
    error = events[-1].data
    assert (error["code"], error["status"], error["retry"]) == ("model_error", 502, False)
    assert "longer than its context window; sending it again cannot help" in error["detail"]
    assert "exceeds the available context size" in error["detail"]
    assert "retry the turn" not in error["detail"]
    assert stored(chat_id) == []


def test_a_reply_trickling_past_the_model_deadline_times_out(  # type: ignore[no-untyped-def]
    api, post_turn, use_fake_openai: FakeOpenAI, settings
) -> None:
    # Each chunk arrives well within the read timeout, but the whole reply would not: the turn
    # slot must not outlive the model deadline (TURN_SLOT_STALE_SECONDS is based on it).
    settings.LLM_TIMEOUT_SECONDS = 0.6
    use_fake_openai.chunk_delay = 0.1
    use_fake_openai.reply_words = 40
    chat_id = new_chat(api)
    events = post_turn(chat_id, {"content": "long story", "stream": True}).all_events()
    kinds = names(events)
    assert kinds[-1] == "error"
    assert "delta" in kinds
    assert events[-1].data["code"] == "model_timeout"
    assert stored(chat_id) == []
    eventually(lambda: slot_free(chat_id), "the turn slot is released")


def test_refusals_before_the_stream_are_plain_json(api, post_turn, user) -> None:  # type: ignore[no-untyped-def]
    from conversations.services.turn_slot import claim_turn_slot

    chat_id = new_chat(api)
    cases: list[tuple[int, dict[str, Any], int]] = [
        (chat_id, {"content": "   ", "stream": True}, 400),
        (chat_id, {"content": "hi", "stream": "sometimes"}, 400),
        (chat_id, {"content": "hi", "stream": True, "model_variant": "nope"}, 400),
        (chat_id + 1000, {"content": "hi", "stream": True}, 404),
    ]
    for target, body, status in cases:
        response = post_turn(target, body)
        assert response.response.status == status, body
        assert response.content_type == "application/json", body
        json.loads(response.response.read())

    claim_turn_slot(Chat.objects.get(pk=chat_id))
    busy = post_turn(chat_id, {"content": "hi", "stream": True})
    assert busy.response.status == 409
    assert busy.content_type == "application/json"
    assert json.loads(busy.response.read())["code"] == "turn_in_progress"
    assert stored(chat_id) == []


# ---------------------------------------------------------------------------------------------
# the client goes away


def test_a_client_that_disconnects_mid_stream_still_gets_its_turn_stored(  # type: ignore[no-untyped-def]
    api, post_turn, use_fake_openai: FakeOpenAI, caplog
) -> None:
    caplog.set_level(logging.INFO, logger="chatmem.turn")
    use_fake_openai.chunk_delay = 0.05
    use_fake_openai.reply_words = 40  # 20 chunks: about a second of streaming
    chat_id = new_chat(api)
    stream = post_turn(chat_id, {"content": "a long answer please", "stream": True})
    events = stream.events()
    assert next(events).name == "accepted"
    assert next(events).name == "delta"
    stream.hang_up()

    # The server noticed mid-stream (its next write failed) and stopped sending...
    disconnect = eventually(
        lambda: [r for r in caplog.records if getattr(r, "event", "") == "stream_disconnect"],
        "the server notices the disconnect",
    )[0]
    assert disconnect.chat_id == chat_id
    assert disconnect.events_written < 20
    # ...but the turn went on: the whole reply is stored and the slot is free.
    messages = eventually(lambda: stored(chat_id), "the turn is stored")
    assert [(m.seq, m.role) for m in messages] == [(1, "user"), (2, "assistant")]
    assert messages[0].content == "a long answer please"
    assert len(messages[1].content.split()) == 40
    assert messages[1].metadata["finish_reason"] == "stop"
    assert messages[1].content == use_fake_openai_reply(use_fake_openai)
    # The response was closed before the reply was complete, and the reply was stored anyway.
    assert disconnect.created < messages[1].created_at.timestamp()
    eventually(lambda: slot_free(chat_id), "the turn slot is released")
    # And the chat takes the next turn.
    assert names(post_turn(chat_id, {"content": "next", "stream": True}).all_events())[-1] == (
        "done"
    )


def use_fake_openai_reply(server: FakeOpenAI) -> str:
    """The reply the fake streamed to its first chat request (its replies are deterministic)."""
    from tests.support.fake_openai import chat_reply_text

    return chat_reply_text(1, server.chat_requests()[0]["body"], server.reply_words)


# ---------------------------------------------------------------------------------------------
# ASGI: the same events from an async iterator


def test_streaming_under_asgi_uses_an_async_iterator(api, token: str) -> None:  # type: ignore[no-untyped-def]
    chat_id = new_chat(api)

    async def run() -> tuple[bool, list[bytes]]:
        response: Any = await AsyncClient().post(
            f"/api/v1/chats/{chat_id}/turns/",
            {"content": "async hello", "stream": True},
            content_type="application/json",
            headers={"Authorization": f"Token {token}"},
        )
        assert response.status_code == 200
        chunks = [chunk async for chunk in response.streaming_content]
        return response.is_async, chunks

    # async_to_sync, not asyncio.run: the sync view then runs on this thread, with this test's
    # database connection, instead of on an executor thread whose connection would leak.
    is_async, chunks = async_to_sync(run)()
    assert is_async, "a sync iterator would be buffered whole under ASGI"
    text = b"".join(chunks).decode()
    blocks = [block for block in text.split("\n\n") if block]
    kinds = [block.split("\n")[0].removeprefix("event: ") for block in blocks]
    assert kinds[0] == "accepted" and kinds[-1] == "done"
    deltas = "".join(
        json.loads(block.split("data: ", 1)[1])["content"]
        for block in blocks
        if block.startswith("event: delta")
    )
    assert deltas == stored(chat_id)[1].content
