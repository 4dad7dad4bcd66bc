"""On PostgreSQL the turn's claim also reads the chat's memory snapshot, in the same statement
(turn_slot.claim_owned_chat). It must be the snapshot a separate read would give, and a claim that
waited for the previous turn to store its messages must not hand out a snapshot without them."""

import threading
import time
from datetime import timedelta
from typing import Any

import pytest
from django.conf import settings
from django.db import connections, transaction
from django.utils import timezone

from conversations.models import Chat, Message, Role
from conversations.services import turn_slot, turn_store
from memory_worker.folding.snapshot import MemorySnapshot, load_snapshot

pytestmark = pytest.mark.django_db(transaction=True)


@pytest.fixture(autouse=True)
def postgresql_only(require_postgres: None) -> None:
    """The claim reads the snapshot in its statement on PostgreSQL only: a loud skip elsewhere,
    a failure under CI=true (conftest's require_postgres)."""


def as_values(snapshot: MemorySnapshot) -> dict[str, Any]:
    values = dict(snapshot.__dict__)
    values["unfolded"] = [
        (m.pk, m.seq, m.role, m.content, m.token_count, m.metadata) for m in snapshot.unfolded
    ]
    return values


def new_chat(api, turns_before: int) -> Chat:  # type: ignore[no-untyped-def]
    chat_id = api.post("/api/v1/chats/", {"title": "claim"}, format="json").json()["id"]
    for number in range(turns_before):
        body = {"content": f"message {number}", "agent": {"decision": "plan_direct"}}
        assert api.post(f"/api/v1/chats/{chat_id}/turns/", body, format="json").status_code == 201
    return Chat.objects.get(pk=chat_id)


def test_the_claim_reads_the_snapshot_a_separate_read_gives(api) -> None:  # type: ignore[no-untyped-def]
    chat = new_chat(api, 3)
    claimed = turn_slot.claim_owned_chat(chat.owner_id, chat.pk)
    try:
        assert claimed.snapshot is not None  # read with the claim: no extra round trip
        assert as_values(claimed.snapshot) == as_values(load_snapshot(chat.pk))
        assert claimed.snapshot.last_seq == claimed.chat.last_seq == 6
    finally:
        turn_slot.release_turn_slot(claimed.chat, claimed.token)


def wait_for_lock_wait(deadline_seconds: float = 10.0) -> None:
    """Until some backend waits on a lock in the claim's statement."""
    deadline = time.monotonic() + deadline_seconds
    while time.monotonic() < deadline:
        with connections["default"].cursor() as cursor:
            cursor.execute(
                "SELECT count(*) FROM pg_stat_activity WHERE wait_event_type = 'Lock' "
                "AND query LIKE 'WITH claimed AS%%'"
            )
            if cursor.fetchone()[0]:
                return
        time.sleep(0.02)  # polling pg_stat_activity, bounded by the deadline
    raise AssertionError("the claim never waited on the chat row's lock")


def test_a_claim_that_waited_for_the_previous_turn_sees_its_messages(api) -> None:  # type: ignore[no-untyped-def]
    """A turn that outlived TURN_SLOT_STALE_SECONDS stores its messages and frees the slot in
    one statement. A claim that starts before that commits finds the slot stale, so it waits on
    the row lock, then claims the freed slot; its statement's snapshot predates the stored
    messages and must not be used."""
    chat = new_chat(api, 1)
    previous = turn_slot.claim_owned_chat(chat.owner_id, chat.pk)  # the turn still being stored
    Chat.objects.filter(pk=chat.pk).update(
        turn_started_at=timezone.now() - timedelta(seconds=settings.TURN_SLOT_STALE_SECONDS + 60)
    )
    appended = threading.Event()
    commit = threading.Event()
    results: dict[str, Any] = {}

    def store_previous_turn() -> None:
        try:
            with transaction.atomic():
                turn_store.append_messages(
                    previous.chat,
                    previous.token,
                    [
                        Message(chat_id=chat.pk, role=Role.USER, content="second", token_count=1),
                        Message(chat_id=chat.pk, role=Role.ASSISTANT, content="re", token_count=1),
                    ],
                )
                appended.set()
                assert commit.wait(10)
        finally:
            connections.close_all()

    def claim_next_turn() -> None:
        try:
            results["claimed"] = turn_slot.claim_owned_chat(chat.owner_id, chat.pk)
        except Exception as error:
            results["error"] = error
        finally:
            connections.close_all()

    storer = threading.Thread(target=store_previous_turn)
    storer.start()
    assert appended.wait(10)
    claimer = threading.Thread(target=claim_next_turn)
    claimer.start()
    try:
        wait_for_lock_wait()
    finally:
        commit.set()
        storer.join(10)
        claimer.join(10)
    assert "error" not in results, results
    claimed = results["claimed"]
    assert claimed.chat.last_seq == 4  # the claim saw the advanced counter...
    # ...so a snapshot without seq 3 and 4 would be a context missing the previous turn.
    snapshot = claimed.snapshot or load_snapshot(chat.pk)
    assert [m.content for m in snapshot.unfolded][-2:] == ["second", "re"]
    assert claimed.snapshot is None  # detected as older than the claim, to be read again
    turn_slot.release_turn_slot(claimed.chat, claimed.token)
