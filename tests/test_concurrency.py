"""Concurrent turns against real PostgreSQL: one turn at a time per chat, chats in parallel."""

import threading
import uuid
from concurrent.futures import ThreadPoolExecutor

import pytest
from django.db import connection

from conversations.models import Chat, Message
from tests.conftest import client_for

pytestmark = pytest.mark.postgres


def fire_turns(user, chat_ids: list[int], barrier: threading.Barrier) -> list[int]:  # type: ignore[no-untyped-def]
    def one(index: int) -> int:
        client = client_for(user)
        barrier.wait()
        try:
            response = client.post(
                f"/api/v1/chats/{chat_ids[index]}/turns/",
                {"content": f"turn {index}"},
                format="json",
            )
            return response.status_code
        finally:
            connection.close()

    with ThreadPoolExecutor(max_workers=len(chat_ids)) as pool:
        return list(pool.map(one, range(len(chat_ids))))


def assert_turn_aligned(chat_id: int) -> int:
    rows = list(Message.objects.filter(chat_id=chat_id).order_by("seq").values_list("seq", "role"))
    assert [seq for seq, _ in rows] == list(range(1, len(rows) + 1))
    assert [role for _, role in rows] == ["user", "assistant"] * (len(rows) // 2)
    assert Chat.objects.get(pk=chat_id).last_seq == len(rows)
    return len(rows)


def test_twenty_concurrent_turns_on_one_chat(require_postgres, user, use_fake_openai) -> None:  # type: ignore[no-untyped-def]
    use_fake_openai.latency = 0.5  # every turn overlaps the first one
    chat = client_for(user).post("/api/v1/chats/", {}, format="json").json()
    statuses = fire_turns(user, [chat["id"]] * 20, threading.Barrier(20))
    assert sorted(set(statuses)) <= [201, 409]
    assert statuses.count(201) >= 1
    assert statuses.count(201) + statuses.count(409) == 20
    # One turn at a time: the turns that got through called the model one after the other (the
    # append stores even a turn whose slot was taken over, so the rows alone would not show it).
    assert use_fake_openai.counters()["max_in_flight"] == 1
    stored = assert_turn_aligned(chat["id"])
    assert stored == 2 * statuses.count(201)
    assert Chat.objects.get(pk=chat["id"]).turn_token is None


def test_twenty_concurrent_turns_on_twenty_chats(require_postgres, user, use_fake_openai) -> None:  # type: ignore[no-untyped-def]
    use_fake_openai.latency = 1.0
    client = client_for(user)
    chat_ids = [client.post("/api/v1/chats/", {}, format="json").json()["id"] for _ in range(20)]
    statuses = fire_turns(user, chat_ids, threading.Barrier(20))
    assert statuses == [201] * 20
    for chat_id in chat_ids:
        assert assert_turn_aligned(chat_id) == 2
    # They ran in parallel: the model had many of them in flight at once (serialised turns
    # would never have more than one).
    assert use_fake_openai.counters()["max_in_flight"] >= 10


@pytest.mark.parametrize("append", ["append_in_one_statement", "append_in_transaction"])
def test_concurrent_appends_number_messages_without_gaps(require_postgres, user, append) -> None:  # type: ignore[no-untyped-def]
    """Below the turn slot (a stale slot lets two turns overlap): 20 appends of a message pair
    at once on one chat. The counter row's lock must give every pair two adjacent seqs, no gap,
    no duplicate, whichever way the rows are stored."""
    from conversations.services import turn_store

    store = getattr(turn_store, append)
    chat_id = client_for(user).post("/api/v1/chats/", {}, format="json").json()["id"]
    barrier = threading.Barrier(20)

    def one(index: int) -> list[int]:
        rows = [
            Message(chat_id=chat_id, role=role, content=f"{role} {index}", token_count=2)
            for role in ("user", "assistant")
        ]
        barrier.wait()
        try:
            return [row.seq for row in store(chat_id, uuid.uuid4(), rows)]
        finally:
            connection.close()

    with ThreadPoolExecutor(max_workers=20) as pool:
        pairs = list(pool.map(one, range(20)))
    assert all(second == first + 1 for first, second in pairs)
    assert sorted(seq for pair in pairs for seq in pair) == list(range(1, 41))
    assert assert_turn_aligned(chat_id) == 40
    stored = dict(Message.objects.filter(chat_id=chat_id).values_list("seq", "content"))
    for index, (first, second) in enumerate(pairs):  # each caller got its own rows' seqs back
        assert stored[first] == f"user {index}" and stored[second] == f"assistant {index}"
