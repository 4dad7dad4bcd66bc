"""The throughput benchmark's floor (bench/proxy_urls.py) does what its figure claims: a turn's
storage as docs/design.md's data model and turn ask (the slot claimed, the tail read and sent to the
model, both messages stored with adjacent seq from the counter, the slot freed), so that "what
storing a turn costs" is measured on real work, not on a view that skips it."""

import uuid

import pytest

from conversations.models import Chat, Message
from tests.conftest import require

pytestmark = pytest.mark.django_db


@pytest.fixture
def floor_api(api, settings):  # type: ignore[no-untyped-def]
    from django.db import connection

    if connection.vendor != "postgresql":
        require("PostgreSQL", "the floor's statements are PostgreSQL's")
    settings.ROOT_URLCONF = "bench.proxy_urls"
    return api


def floor_turn(api, chat_id: int, content: str):  # type: ignore[no-untyped-def]
    return api.post(f"/bench/floor/{chat_id}", {"content": content}, format="json")


def test_floor_stores_both_messages_with_adjacent_seq_and_frees_the_slot(floor_api) -> None:  # type: ignore[no-untyped-def]
    chat_id = floor_api.post("/api/v1/chats/", {}, format="json").json()["id"]
    for number in range(3):
        response = floor_turn(floor_api, chat_id, f"question {number}")
        assert response.status_code == 201, response.content
    stored = list(Message.objects.filter(chat_id=chat_id).order_by("seq"))
    assert [(m.seq, m.role) for m in stored] == [
        (seq, "user" if seq % 2 else "assistant") for seq in range(1, 7)
    ]
    assert stored[4].content == "question 2" and stored[4].token_count > 0
    # The model saw the tail: the offline model says how many messages it was sent (the system
    # prompt, the 4 stored before, the new one).
    chat = Chat.objects.get(pk=chat_id)
    assert f"Context: {4 + 1 + bool(chat.system_prompt)} messages" in stored[5].content
    assert chat.last_seq == 6 and chat.turn_token is None


def test_floor_refuses_a_chat_whose_slot_is_held(floor_api) -> None:  # type: ignore[no-untyped-def]
    chat_id = floor_api.post("/api/v1/chats/", {}, format="json").json()["id"]
    Chat.objects.filter(pk=chat_id).update(turn_token=uuid.uuid4())
    response = floor_turn(floor_api, chat_id, "question")
    assert response.status_code == 409
    assert not Message.objects.filter(chat_id=chat_id).exists()


def test_floor_refuses_another_users_chat(floor_api, other_api) -> None:  # type: ignore[no-untyped-def]
    chat_id = other_api.post("/api/v1/chats/", {}, format="json").json()["id"]
    assert floor_turn(floor_api, chat_id, "question").status_code == 409
    assert not Message.objects.filter(chat_id=chat_id).exists()
