"""chatmem under gunicorn's gevent workers (docs/operations.md, Serving): turns in flight are
greenlets, not threads. A real ``gunicorn -k gevent`` process serves the test database with a
small connection pool, against the fake OpenAI-compatible server: many turns wait on the model at
once while the pool holds a few connections, JSON and streamed turns store what they answered,
and a gevent server without a pool refuses to start (chatmem.E005)."""

import http.client
import json
import os
import socket
import struct
import subprocess
import threading
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest
from django.contrib.auth import get_user_model
from django.db import connection
from rest_framework.authtoken.models import Token

from bench.throughput import free_port, gunicorn_command
from conversations.models import Chat, Message
from conversations.services.chats import create_chat
from tests.conftest import require
from tests.support.fake_openai import FakeOpenAI
from tests.support.http_turns import send_turn, serving_gunicorn

ROOT = Path(__file__).resolve().parent.parent
DEADLINE = 30.0  # seconds; every wait below polls up to this and then fails
POOL_SIZE = 3
CLIENTS = 12
GREENLETS = 100  # requests in flight per process (--worker-connections)


def url_of_the_test_database() -> str:
    settings = connection.settings_dict
    user = settings["USER"] or "postgres"
    host = settings["HOST"] or "127.0.0.1"
    port = settings["PORT"] or 5432
    return f"postgres://{user}@{host}:{port}/{settings['NAME']}"


def server_env(model_url: str, pool_size: int | None) -> dict[str, str]:
    env = {
        **os.environ,
        "DJANGO_SETTINGS_MODULE": "chatmem_project.settings",
        "DATABASE_URL": url_of_the_test_database(),
        "CHAT_BACKEND": "openai",
        "OPENAI_BASE_URL": model_url,
        "OPENAI_API_KEY": "test-key",
        "CHAT_MODEL": "fake-chat",
        "MEMORY_SUMMARIZER_BACKEND": "offline",
        "REDIS_URL": "",
        "TURN_RATE_LIMIT": "",
        "ALLOWED_HOSTS": "127.0.0.1,localhost",
        "LOG_LEVEL": "WARNING",
    }
    env.pop("DB_POOL_MAX_SIZE", None)
    if pool_size is not None:
        env["DB_POOL_MAX_SIZE"] = str(pool_size)
    return env


def gunicorn(port: int, env: dict[str, str]) -> subprocess.Popen:
    command = gunicorn_command(port, workers=1, threads=GREENLETS, worker_class="gevent")
    return subprocess.Popen(
        command, cwd=ROOT, env=env, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True
    )


@pytest.fixture
def gevent_url(require_postgres: None, fake_openai: FakeOpenAI) -> Iterator[tuple[str, int]]:
    try:
        import gevent  # noqa: F401
    except ImportError:
        require("gevent", "not installed (pip install -e '.[test]')")
    env = server_env(fake_openai.base_url, POOL_SIZE)
    with serving_gunicorn(env, "gevent", GREENLETS, DEADLINE) as port:
        yield "127.0.0.1", port


@pytest.fixture
def token() -> str:
    user = get_user_model().objects.create_user(username="gevent")
    return Token.objects.create(user=user).key


def new_chats(token: str, count: int) -> list[int]:
    user = Token.objects.get(key=token).user
    return [create_chat(user, title=f"gevent {n}").pk for n in range(count)]


def post(
    address: tuple[str, int], token: str, chat_id: int, body: dict[str, Any], accept: str
) -> tuple[int, bytes]:
    client = http.client.HTTPConnection(*address, timeout=DEADLINE)
    send_turn(client, token, chat_id, body, accept)
    response = client.getresponse()
    return response.status, response.read()


def test_turns_wait_on_the_model_together_while_the_pool_holds_a_few_connections(
    gevent_url: tuple[str, int], token: str, fake_openai: FakeOpenAI
) -> None:
    # Each reply takes 1.5 s: twelve turns sent at once are all at the model at the same time
    # only if the worker serves them concurrently and each hands its connection back while the
    # model answers (the pool has 3).
    fake_openai.latency = 1.5
    chats = new_chats(token, CLIENTS)
    results: dict[int, tuple[int, bytes]] = {}

    def send(chat_id: int) -> None:
        results[chat_id] = post(gevent_url, token, chat_id, {"content": "hello"}, "*/*")

    threads = [threading.Thread(target=send, args=(chat,)) for chat in chats]
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join(DEADLINE)

    assert sorted(status for status, _ in results.values()) == [201] * CLIENTS
    assert fake_openai.counters()["max_in_flight"] == CLIENTS
    for chat_id in chats:
        stored = list(Message.objects.filter(chat_id=chat_id).order_by("seq"))
        assert [(m.seq, m.role) for m in stored] == [(1, "user"), (2, "assistant")]
        answer = json.loads(results[chat_id][1])
        assert answer["assistant_message"]["content"] == stored[1].content
        assert Chat.objects.get(pk=chat_id).turn_token is None


def test_a_streamed_turn_is_served_and_stored(
    gevent_url: tuple[str, int], token: str, fake_openai: FakeOpenAI
) -> None:
    fake_openai.reply_words = 12
    fake_openai.chunk_delay = 0.01
    (chat_id,) = new_chats(token, 1)
    status, body = post(
        gevent_url, token, chat_id, {"content": "tell me", "stream": True}, "text/event-stream"
    )

    assert status == 200
    events = [
        (block.split("\n")[0].removeprefix("event: "), block)
        for block in body.decode().split("\n\n")
        if block.startswith("event:")
    ]
    kinds = [kind for kind, _ in events]
    assert kinds[0] == "accepted" and kinds[-1] == "done"
    assert kinds.count("delta") >= 2
    done = json.loads(events[-1][1].split("data: ", 1)[1])
    stored = list(Message.objects.filter(chat_id=chat_id).order_by("seq"))
    assert [m.role for m in stored] == ["user", "assistant"]
    assert done["assistant_message"]["content"] == stored[1].content
    assert len(stored[1].content.split()) == 12


def test_a_client_that_hangs_up_mid_stream_still_gets_its_turn_stored(
    gevent_url: tuple[str, int], token: str, fake_openai: FakeOpenAI
) -> None:
    # The turn runs in its own greenlet (a patched thread): the request's greenlet ending when
    # its write fails must not end the turn.
    fake_openai.reply_words = 40
    fake_openai.chunk_delay = 0.05  # 20 chunks: about a second of streaming
    (chat_id,) = new_chats(token, 1)
    client = http.client.HTTPConnection(*gevent_url, timeout=DEADLINE)
    body = {"content": "a long answer please", "stream": True}
    send_turn(client, token, chat_id, body, "text/event-stream")
    response = client.getresponse()
    assert response.status == 200
    while not response.readline().startswith(b"event: delta"):
        pass
    # Linger 0: a reset, so the server's next write fails at once.
    assert client.sock is not None
    client.sock.setsockopt(socket.SOL_SOCKET, socket.SO_LINGER, struct.pack("ii", 1, 0))
    client.sock.close()
    response.close()

    deadline = time.monotonic() + DEADLINE
    while Chat.objects.get(pk=chat_id).turn_token is not None:
        assert time.monotonic() < deadline, "the turn did not finish"
        time.sleep(0.1)  # the turn streams on in the server: poll until the deadline
    stored = list(Message.objects.filter(chat_id=chat_id).order_by("seq"))
    assert [(m.seq, m.role) for m in stored] == [(1, "user"), (2, "assistant")]
    assert len(stored[1].content.split()) == 40
    assert stored[1].metadata["finish_reason"] == "stop"


def test_a_gevent_server_without_a_pool_refuses_to_start(
    require_postgres: None, fake_openai: FakeOpenAI
) -> None:
    try:
        import gevent  # noqa: F401
    except ImportError:
        require("gevent", "not installed (pip install -e '.[test]')")
    server = gunicorn(free_port(), server_env(fake_openai.base_url, pool_size=None))
    try:
        output, _ = server.communicate(timeout=DEADLINE)
    finally:
        server.kill()
        server.wait(DEADLINE)  # reaped, also after a timeout above
    assert server.returncode != 0
    assert "chatmem.E005" in output
    assert "Worker failed to boot" in output
