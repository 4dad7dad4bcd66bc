"""A turn and a fold issue the same number of SQL queries whatever the history length: the turn
reads only the unfolded tail with stored token counts, never the whole history."""

import pytest
from django.db import connection
from django.test.utils import CaptureQueriesContext

from conversations.models import Brief, Message
from memory_worker.coordination.dispatch import RequestReason
from memory_worker.folding.execute import fold_once
from tests.conftest import require

pytestmark = pytest.mark.django_db


def turn_queries(api, chat_id: int, content: str) -> int:  # type: ignore[no-untyped-def]
    with CaptureQueriesContext(connection) as captured:
        response = api.post(f"/api/v1/chats/{chat_id}/turns/", {"content": content}, format="json")
    assert response.status_code == 201
    return len(captured.captured_queries)


def grow(chat_id: int, turns: int) -> None:
    """Append history directly (fast), folded up to all but the last 40 messages, as a worker
    keeping up with sliding-window would leave it."""
    last = Message.objects.filter(chat_id=chat_id).count()
    Message.objects.bulk_create(
        Message(
            chat_id=chat_id,
            seq=last + i + 1,
            role="user" if (last + i) % 2 == 0 else "assistant",
            content=f"old {last + i}",
            token_count=3,
        )
        for i in range(2 * turns)
    )
    total = last + 2 * turns
    from conversations.models import Chat

    Chat.objects.filter(pk=chat_id).update(last_seq=total)
    Brief.objects.filter(chat_id=chat_id).update(
        last_consolidated=max(total - 40, 0),
        summary="## Facts / Constraints\n- old",
        summary_tokens=8,
    )


def test_turn_query_count_is_constant_in_history_length(api) -> None:  # type: ignore[no-untyped-def]
    chat_id = api.post("/api/v1/chats/", {}, format="json").json()["id"]
    grow(chat_id, 5)
    short = turn_queries(api, chat_id, "at ten messages")
    grow(chat_id, 5000)
    long = turn_queries(api, chat_id, "at ten thousand messages")
    assert short == long


def test_fold_query_count_is_constant_in_history_length(api) -> None:  # type: ignore[no-untyped-def]
    counts = []
    for history_turns in (30, 3000):
        chat_id = api.post("/api/v1/chats/", {}, format="json").json()["id"]
        grow(chat_id, history_turns)
        api.post(f"/api/v1/chats/{chat_id}/turns/", {"content": "x"}, format="json")
        for _ in range(6):  # a 12-message backlog beyond the tail
            api.post(f"/api/v1/chats/{chat_id}/turns/", {"content": "more"}, format="json")
        with CaptureQueriesContext(connection) as captured:
            assert fold_once(chat_id, RequestReason.TURN).status == "succeeded"
        counts.append(len(captured.captured_queries))
    assert counts[0] == counts[1]


def test_a_turn_makes_four_queries_on_postgresql(api) -> None:  # type: ignore[no-untyped-def]
    """The budget of a turn's round trips (docs/benchmarks.md): the token, the chat read with its
    turn slot claimed, the brief with the agent state and the unfolded tail (one statement), and
    the append (seqs, both messages and the slot's release in one statement). SQLite reads the
    brief and the tail apart and appends in a transaction."""
    if connection.vendor != "postgresql":
        require("PostgreSQL", "the one-statement append is PostgreSQL's")
    chat_id = api.post("/api/v1/chats/", {}, format="json").json()["id"]
    with CaptureQueriesContext(connection) as captured:
        response = api.post(f"/api/v1/chats/{chat_id}/turns/", {"content": "hi"}, format="json")
    assert response.status_code == 201
    statements = [query["sql"].split()[0] for query in captured.captured_queries]
    assert len(statements) == 3, statements


def test_a_fold_makes_four_queries_on_postgresql(api) -> None:  # type: ignore[no-untyped-def]
    """A fold's round trips: the chat with its memory snapshot (one statement), the database's
    clock (the policy's now: backoff and cooldowns were stamped by other hosts), the ledger row,
    and the commit (the brief's conditional UPDATE and the ledger's outcome in one statement).
    SQLite reads the chat, the brief and the tail apart and commits in a transaction."""
    if connection.vendor != "postgresql":
        require("PostgreSQL", "the one-statement reads and commit are PostgreSQL's")
    chat_id = api.post("/api/v1/chats/", {}, format="json").json()["id"]
    for _ in range(26):  # sliding-window: a 12-message backlog beyond the 40-message tail
        api.post(f"/api/v1/chats/{chat_id}/turns/", {"content": "more"}, format="json")
    with CaptureQueriesContext(connection) as captured:
        assert fold_once(chat_id, RequestReason.TURN).status == "succeeded"
    statements = [query["sql"].split()[0] for query in captured.captured_queries]
    assert statements == ["SELECT", "SELECT", "INSERT", "WITH"], statements
