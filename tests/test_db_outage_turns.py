"""A database that fails under a turn (PostgreSQL, real connections killed with
pg_terminate_backend): the client gets a 503 to retry, not a bug's 500; the turn's slot is freed
on a new connection, not left claimed until it goes stale; a stream always gets its last event."""

from __future__ import annotations

import sqlite3
from typing import Any

import httpx
import psycopg
import pytest
from django.db import OperationalError, connection
from rest_framework.authtoken.models import Token

from conversations.api import views
from conversations.chat_model.offline_backend import OfflineChatModel
from conversations.models import Chat, Message
from conversations.rows import database_unreachable
from conversations.services import exchanges

TURN = {"content": "hello"}


def kill_own_connection() -> None:
    """Terminates this thread's PostgreSQL backend from another connection, as a database
    restart or a network cut would: its next statement fails."""
    with connection.cursor() as cursor:
        cursor.execute("SELECT pg_backend_pid()")
        pid = cursor.fetchone()[0]
    params = connection.get_connection_params()
    params.pop("cursor_factory", None)
    params.pop("context", None)
    with psycopg.connect(**params, autocommit=True) as other:
        other.execute("SELECT pg_terminate_backend(%s)", [pid])


def test_an_outage_is_a_503_to_retry(api: Any, monkeypatch: Any) -> None:
    """It was Django's 500 "Internal server error", which says: a bug, do not retry."""

    def unreachable(*args: Any) -> Any:
        raise OperationalError("connection to server failed: Connection refused")

    monkeypatch.setattr(views.ChatViewSet, "get_queryset", unreachable)
    response = api.get("/api/v1/chats/")
    assert response.status_code == 503
    assert response.json()["code"] == "database_unavailable"
    assert response["Retry-After"] == "5"


def test_a_turn_whose_connection_dies_frees_its_slot(
    require_postgres: None, api: Any, monkeypatch: Any
) -> None:
    """The connection died during the model call: the turn's release of its slot ran on the
    same dead connection and failed too, so the slot stayed claimed and every retry was a 409
    for TURN_SLOT_STALE_SECONDS (90 s), although the database was back at once."""
    chat_id = api.post("/api/v1/chats/", {}, format="json").json()["id"]
    real = OfflineChatModel.complete

    def dying(self: Any, *args: Any, **kwargs: Any) -> Any:
        kill_own_connection()
        return real(self, *args, **kwargs)

    monkeypatch.setattr(OfflineChatModel, "complete", dying)
    api.raise_request_exception = False
    failed = api.post(f"/api/v1/chats/{chat_id}/turns/", TURN, format="json")
    assert failed.status_code == 503
    assert failed.json()["code"] == "database_unavailable"
    monkeypatch.setattr(OfflineChatModel, "complete", real)
    assert Chat.objects.get(pk=chat_id).turn_token is None
    retried = api.post(f"/api/v1/chats/{chat_id}/turns/", TURN, format="json")
    assert retried.status_code == 201
    assert Message.objects.filter(chat_id=chat_id).count() == 2


@pytest.mark.parametrize("path", ["/v1/chat/completions", "rest"])
def test_a_stream_whose_store_fails_ends_with_an_error(
    require_postgres: None, live_server: Any, user: Any, monkeypatch: Any, path: str
) -> None:
    """The /v1 stream's thread failed to release the slot on its dead connection and never sent
    its last event: the client got keep-alives for ever."""
    from conversations.services import turns

    monkeypatch.setattr(exchanges, "HEARTBEAT_SECONDS", 0.05)
    monkeypatch.setattr(turns, "HEARTBEAT_SECONDS", 0.05, raising=False)
    real_store: Any = {"/v1/chat/completions": exchanges.store_exchange, "rest": turns.store_turn}[
        path
    ]

    def dying(*args: Any, **kwargs: Any) -> Any:
        kill_own_connection()
        return real_store(*args, **kwargs)

    if path == "rest":
        monkeypatch.setattr(turns, "store_turn", dying)
    else:
        monkeypatch.setattr(exchanges, "store_exchange", dying)
    token = Token.objects.create(user=user).key
    if path == "rest":
        chat_id = httpx.post(
            f"{live_server.url}/api/v1/chats/",
            json={},
            headers={"Authorization": f"Token {token}"},
        ).json()["id"]
        url, body = f"{live_server.url}/api/v1/chats/{chat_id}/turns/", {**TURN, "stream": True}
        headers = {"Authorization": f"Token {token}"}
    else:
        url = f"{live_server.url}{path}"
        body = {"model": "default", "messages": [{"role": "user", "content": "hi"}]}
        body |= {"stream": True, "user": "dying"}
        headers = {"Authorization": f"Bearer {token}"}
    keep_alives, lines = 0, []
    with httpx.stream("POST", url, json=body, headers=headers, timeout=30) as response:
        for line in response.iter_lines():
            lines.append(line)
            keep_alives += line.startswith(":")
            if keep_alives > 200:  # 10 s of nothing but keep-alives: the hang
                break
    assert keep_alives <= 200, "the stream never ended"
    last = [line for line in lines if line.startswith("data: ")][-1]
    assert "database_unavailable" in last
    assert not Chat.objects.filter(turn_token__isnull=False).exists()  # the slot is free


def caused_by(cause: BaseException) -> OperationalError:
    """A Django database error as Django raises it: the driver's error as its cause."""
    error = OperationalError(str(cause))
    error.__cause__ = cause
    return error


@pytest.mark.parametrize(
    ("cause", "unreachable"),
    [
        (psycopg.OperationalError("connection to server failed: Connection refused"), True),
        (psycopg.errors.AdminShutdown("terminating connection due to administrator command"), True),
        (psycopg.errors.CannotConnectNow("the database system is starting up"), True),
        (psycopg.errors.DeadlockDetected("deadlock detected"), False),
        (psycopg.errors.QueryCanceled("canceling statement due to statement timeout"), False),
        (sqlite3.OperationalError("database is locked"), True),
        (sqlite3.OperationalError("no such table: authtoken_token"), False),
    ],
)
def test_only_an_unreachable_database_is_an_outage(cause: BaseException, unreachable: bool) -> None:
    """Only an unreachable database is a 503 "retry shortly": a deadlock, a statement timeout or
    an unmigrated database is a bug a retry would hide."""
    assert database_unreachable(caused_by(cause)) is unreachable


def test_a_database_error_that_is_no_outage_and_no_conflict_stays_a_500(
    api: Any, monkeypatch: Any
) -> None:
    def out_of_memory(*args: Any) -> Any:
        raise caused_by(psycopg.errors.OutOfMemory("out of memory"))

    monkeypatch.setattr(views.ChatViewSet, "get_queryset", out_of_memory)
    api.raise_request_exception = False
    response = api.get("/api/v1/chats/")
    assert response.status_code == 500


def test_a_deadlock_on_the_request_path_is_a_503_to_retry(api: Any, monkeypatch: Any) -> None:
    def deadlocked(*args: Any) -> Any:
        raise caused_by(psycopg.errors.DeadlockDetected("deadlock detected"))

    monkeypatch.setattr(views.ChatViewSet, "get_queryset", deadlocked)
    api.raise_request_exception = False
    response = api.get("/api/v1/chats/")
    assert response.status_code == 503
    assert response.json()["code"] == "database_conflict"
    assert response["Retry-After"]


def test_a_turn_lost_after_its_store_is_not_to_be_resent(api: Any, monkeypatch: Any) -> None:
    """The store committed, then the connection broke before its answer: a 503 that invites a
    retry would store the turn twice (the OpenAI SDKs retry by themselves). The store frees the
    slot, so a release that finds it not held says the turn may have been stored."""
    from conversations.services import turns

    chat_id = api.post("/api/v1/chats/", {}, format="json").json()["id"]
    real = turns.store_turn

    def stored_then_lost(*args: Any, **kwargs: Any) -> Any:
        real(*args, **kwargs)
        raise OperationalError("server closed the connection unexpectedly")

    monkeypatch.setattr(turns, "store_turn", stored_then_lost)
    response = api.post(f"/api/v1/chats/{chat_id}/turns/", TURN, format="json")
    assert response.status_code == 503
    assert response["x-should-retry"] == "false"
    assert "may have been stored" in response.json()["detail"]
    assert "Retry-After" not in response
    assert Message.objects.filter(chat_id=chat_id).count() == 2
