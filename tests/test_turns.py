"""The chat turn end to end through the API: offline model, the fake OpenAI server, failures."""

import pytest

from conversations.models import Chat, Message
from memory_worker.coordination.dispatch import RequestReason
from memory_worker.folding.execute import fold_once

pytestmark = pytest.mark.django_db


def new_chat(api, **body):  # type: ignore[no-untyped-def]
    response = api.post("/api/v1/chats/", body, format="json")
    assert response.status_code == 201, response.content
    return response.json()["id"]


def turn(api, chat_id, content):  # type: ignore[no-untyped-def]
    return api.post(f"/api/v1/chats/{chat_id}/turns/", {"content": content}, format="json")


def test_three_turns_offline(api) -> None:  # type: ignore[no-untyped-def]
    chat_id = new_chat(api, title="offline")
    for number in range(1, 4):
        response = turn(api, chat_id, f"message number {number}")
        assert response.status_code == 201, response.content
        body = response.json()
        assert body["user_message"]["seq"] == 2 * number - 1
        assert body["user_message"]["role"] == "user"
        assert body["user_message"]["content"] == f"message number {number}"
        assert body["user_message"]["token_count"] > 0
        assert body["assistant_message"]["seq"] == 2 * number
        assert body["assistant_message"]["role"] == "assistant"
        assert body["assistant_message"]["content"].startswith("[offline model]")
        assert set(body["assistant_message"]) >= {
            "seq",
            "role",
            "content",
            "token_count",
            "created_at",
        }
    history = api.get(f"/api/v1/chats/{chat_id}/messages/").json()
    assert [m["seq"] for m in history["results"]] == [1, 2, 3, 4, 5, 6]
    assert api.get(f"/api/v1/chats/{chat_id}/messages/?after_seq=4").json()["count"] == 2
    brief = api.get(f"/api/v1/chats/{chat_id}/brief/").json()
    assert brief["unfolded"] == 6
    assert brief["last_consolidated"] == 0
    assert brief["summary"] == ""
    assert Chat.objects.get(pk=chat_id).last_seq == 6


def test_context_endpoint_is_exactly_what_the_model_receives(api, use_fake_openai) -> None:  # type: ignore[no-untyped-def]
    chat_id = new_chat(api, system_prompt="Be brief.", policy="contract")
    for number in range(8):
        context = api.get(f"/api/v1/chats/{chat_id}/context/").json()["messages"]
        response = turn(api, chat_id, f"fact {number}: the sky is color {number}")
        assert response.status_code == 201, response.content
        sent = use_fake_openai.chat_requests()[-1]["body"]["messages"]
        # Folds may run synchronously before the call; then the context is re-read.
        if not any(r["kind"] == "summarize" for r in use_fake_openai.requests[-2:]):
            assert sent == [
                *context,
                {"role": "user", "content": f"fact {number}: the sky is color {number}"},
            ]
        # Background fold (what a worker would do) between turns.
        fold_once(chat_id, RequestReason.TURN)
    context = api.get(f"/api/v1/chats/{chat_id}/context/").json()["messages"]
    assert context[0] == {"role": "system", "content": "Be brief."}
    assert context[1]["role"] == "system" and "## " in context[1]["content"]  # the summary
    response = turn(api, chat_id, "and one more")
    assert response.status_code == 201
    assert use_fake_openai.chat_requests()[-1]["body"]["messages"] == [
        *context,
        {"role": "user", "content": "and one more"},
    ]


@pytest.mark.parametrize(
    ("fault", "status", "code"),
    [
        ("500", 502, "model_error"),
        ("timeout", 504, "model_timeout"),
        ("400", 502, "model_error"),
        ("empty", 502, "model_error"),
    ],
)
def test_model_failure_stores_nothing(api, use_fake_openai, settings, fault, status, code) -> None:  # type: ignore[no-untyped-def]
    settings.LLM_TIMEOUT_SECONDS = 0.5
    use_fake_openai.timeout_sleep = 1.5
    chat_id = new_chat(api)
    assert turn(api, chat_id, "first").status_code == 201
    use_fake_openai.queue_faults("chat", [fault])
    response = turn(api, chat_id, "second")
    assert response.status_code == status, response.content
    assert response.json()["code"] == code
    assert "Nothing was stored" in response.json()["detail"]
    assert list(Message.objects.filter(chat_id=chat_id).values_list("seq", flat=True)) == [1, 2]
    chat = Chat.objects.get(pk=chat_id)
    assert chat.last_seq == 2
    assert chat.turn_token is None  # slot released: the client can simply retry
    retry = turn(api, chat_id, "second")
    assert retry.status_code == 201
    assert retry.json()["user_message"]["seq"] == 3


def test_turn_in_progress_is_409(api) -> None:  # type: ignore[no-untyped-def]
    from conversations.services.turn_slot import claim_turn_slot, release_turn_slot

    chat_id = new_chat(api)
    chat = Chat.objects.get(pk=chat_id)
    token = claim_turn_slot(chat)
    response = turn(api, chat_id, "hello")
    assert response.status_code == 409
    assert response.json()["code"] == "turn_in_progress"
    assert Message.objects.count() == 0
    release_turn_slot(chat, token)
    assert turn(api, chat_id, "hello").status_code == 201


def test_stale_turn_slot_is_reclaimed(api, settings) -> None:  # type: ignore[no-untyped-def]
    from datetime import timedelta

    from django.utils import timezone

    chat_id = new_chat(api)
    settings.TURN_SLOT_STALE_SECONDS = 60
    import uuid

    Chat.objects.filter(pk=chat_id).update(
        turn_token=uuid.uuid4(), turn_started_at=timezone.now() - timedelta(seconds=61)
    )
    assert turn(api, chat_id, "after a crash").status_code == 201


def test_model_variant_is_stored(api, settings) -> None:  # type: ignore[no-untyped-def]
    """On both messages of the turn: the user's said "" and the reply's "default"."""
    from conversations.variants import _parse_variants

    _parse_variants.cache_clear()
    settings.MODEL_VARIANTS = "deep-dive=gpt-deep:200000"
    chat_id = new_chat(api)
    response = api.post(
        f"/api/v1/chats/{chat_id}/turns/",
        {"content": "go deep", "model_variant": "deep-dive"},
        format="json",
    )
    assert response.status_code == 201
    assert response.json()["assistant_message"]["model_variant"] == "deep-dive"
    assert response.json()["user_message"]["model_variant"] == "deep-dive"
    plain = turn(api, chat_id, "normal")
    assert plain.json()["assistant_message"]["model_variant"] == "default"
    assert plain.json()["user_message"]["model_variant"] == "default"


def test_web_hosts_ten_minutes_apart_steal_no_live_slot(api, settings, monkeypatch) -> None:  # type: ignore[no-untyped-def]
    """A turn claims the slot on a host 5 minutes slow; the next request comes to a host 5
    minutes fast. Staleness is judged in database time, so the live slot is not taken."""
    from datetime import timedelta

    from django.utils import timezone

    from conversations.rows import database_now
    from conversations.services.turn_slot import claim_turn_slot

    real_now = timezone.now
    settings.TURN_SLOT_STALE_SECONDS = 60
    chat_id = new_chat(api)
    chat = Chat.objects.get(pk=chat_id)
    monkeypatch.setattr(timezone, "now", lambda: real_now() - timedelta(minutes=5))
    claim_turn_slot(chat)
    monkeypatch.setattr(timezone, "now", lambda: real_now() + timedelta(minutes=5))
    assert turn(api, chat_id, "while the first turn runs").status_code == 409
    chat.refresh_from_db()
    assert chat.turn_started_at is not None
    assert abs((chat.turn_started_at - database_now()).total_seconds()) < 5
