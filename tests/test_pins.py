"""Pins (conversations.services.pins): texts and stored messages kept verbatim in every context,
after the summary, counted in the bound, never folded away. Against real PostgreSQL, Redis and a
worker subprocess folding in the background, with the fake model server as the witness of every
context the model received."""

from typing import Any

import pytest

from conversations.chat_model.tokens import count_tokens
from conversations.models import Consolidation, Message, Pin
from conversations.services.context import SUMMARY_HEADER
from memory_worker.folding.snapshot import load_snapshot
from memory_worker.pinned import PINNED_HEADER, pin_line
from memory_worker.summaries.contract import PINNED
from tests.conftest import client_for
from tests.support.workers import Worker
from tests.test_worker_faults import model_env

pytestmark = [pytest.mark.postgres, pytest.mark.redis, pytest.mark.worker]

CANARY = "The vault code is 7431-ALPHA; never change it."
FOLDS = 50


def new_chat(api: Any, **body: Any) -> int:
    response = api.post("/api/v1/chats/", body, format="json")
    assert response.status_code == 201, response.content
    return int(response.json()["id"])


def turn(api: Any, chat_id: int, content: str) -> None:
    response = api.post(f"/api/v1/chats/{chat_id}/turns/", {"content": content}, format="json")
    assert response.status_code == 201, response.content


def pin(api: Any, chat_id: int, body: dict[str, Any]) -> Any:
    return api.post(f"/api/v1/chats/{chat_id}/pins/", body, format="json")


def pinned_entries(messages: list[dict[str, Any]]) -> list[str]:
    """The pinned block's items in a context (none without the block)."""
    blocks = [
        m["content"]
        for m in messages
        if m["role"] == "system" and str(m["content"]).startswith(PINNED_HEADER)
    ]
    assert len(blocks) <= 1, blocks
    if not blocks:
        return []
    return [line[2:] for line in blocks[0][len(PINNED_HEADER) :].split("\n")]


def times_present(messages: list[dict[str, Any]], role: str, content: str) -> int:
    """How often a message is in a context: verbatim, or as its pin."""
    verbatim = sum(1 for m in messages if m["role"] == role and m["content"] == content)
    return verbatim + pinned_entries(messages).count(f"{role}: {content}")


def test_a_pin_survives_fifty_folds_verbatim_and_a_pinned_message_appears_once(
    require_postgres: None, broker: str, use_fake_openai: Any, user: Any
) -> None:
    api = client_for(user)
    # Contract with a short tail: a fold every turn or two.
    chat_id = new_chat(
        api, policy="contract", policy_overrides={"tail_messages": 2, "overflow_buffer": 2}
    )
    turn(api, chat_id, "first: my name is Ada and I live in Lisbon")
    first = Message.objects.get(chat_id=chat_id, seq=1)
    assert pin(api, chat_id, {"text": CANARY}).status_code == 201
    by_seq = pin(api, chat_id, {"seq": 1})
    assert by_seq.status_code == 201, by_seq.content
    assert by_seq.json()["text"] == f"user: {first.content}"
    use_fake_openai.reset()

    worker = Worker(broker, "pins", env=model_env(use_fake_openai))
    try:
        worker.wait_ready()
        succeeded = Consolidation.objects.filter(chat_id=chat_id, status="succeeded")
        for number in range(400):
            if succeeded.count() >= FOLDS:
                break
            turn(api, chat_id, f"turn {number}: the note of the day is {number * 7}")
        assert succeeded.count() >= FOLDS, worker.log()
    finally:
        worker.stop()

    contexts = [request.body["messages"] for request in use_fake_openai.chat_requests()]
    assert len(contexts) >= FOLDS
    for messages in contexts:
        entries = pinned_entries(messages)
        assert entries[0] == CANARY, messages  # verbatim, first pinned
        assert times_present(messages, "user", first.content) == 1, messages
        # The block sits after the system prompt and before the summary (it changes less
        # often), the recent messages after both.
        roles = [m["role"] for m in messages]
        block = next(i for i, m in enumerate(messages) if pinned_entries([m]))
        summaries = [i for i, m in enumerate(messages) if m["content"].startswith(SUMMARY_HEADER)]
        prefix = max([block, *summaries])
        assert all(role == "system" for role in roles[:prefix])
        assert "system" not in roles[prefix + 1 :]
        assert all(index > block for index in summaries)
    # The pinned message folded as usual, and the block carried it from then on.
    assert Consolidation.objects.filter(chat_id=chat_id, status="succeeded", from_seq=1).exists()
    assert any(f"user: {first.content}" in pinned_entries(m) for m in contexts)
    # The summarizer was told what is pinned.
    folds = use_fake_openai.summarize_requests()
    assert folds and all(PINNED in r.text and CANARY in r.text for r in folds)


@pytest.mark.django_db
def test_a_pin_over_the_room_left_is_a_400_saying_the_room_and_stores_nothing(api: Any) -> None:
    chat_id = new_chat(api, policy="token-budget")
    response = pin(api, chat_id, {"text": "word " * 2500})
    assert response.status_code == 400, response.content
    body = response.json()
    assert body["code"] == "no_room_for_pin"
    assert body["room_left"] > 0
    assert f"only {body['room_left']} of the" in body["detail"]
    assert not Pin.objects.exists()
    # What fits is taken; the room left shrinks by it.
    small = pin(api, chat_id, {"text": "word " * 200})
    assert small.status_code == 201, small.content
    again = pin(api, chat_id, {"text": "word " * 2500})
    assert again.status_code == 400
    assert again.json()["room_left"] < body["room_left"]
    assert Pin.objects.count() == 1


@pytest.mark.django_db
def test_a_policy_change_that_leaves_the_pins_no_room_is_a_400_and_changes_nothing(
    api: Any,
) -> None:
    chat_id = new_chat(api, policy="token-budget")
    assert pin(api, chat_id, {"text": "word " * 600}).status_code == 201
    smaller = {"policy_overrides": {"max_tokens": 1200}}
    response = api.patch(f"/api/v1/chats/{chat_id}/", smaller, format="json")
    assert response.status_code == 400, response.content
    assert "unpin something first" in str(response.json())
    chat = api.get(f"/api/v1/chats/{chat_id}/").json()
    assert chat["policy_overrides"] == {}
    # A change the pins still fit is taken.
    larger = {"policy_overrides": {"max_tokens": 6000}}
    assert api.patch(f"/api/v1/chats/{chat_id}/", larger, format="json").status_code == 200


THAI = "ผมชอบกินข้าวผัดกุ้งที่ร้านริมแม่น้ำเจ้าพระยาทุกวันเสาร์ตอนเย็นกับครอบครัว "


@pytest.mark.django_db
def test_a_variant_change_recounts_the_pins_and_is_refused_when_they_no_longer_fit(
    api: Any, settings: Any
) -> None:
    # gpt-4o-mini counts Thai as it is; a local model without a tokenizer with its non-Latin
    # margin, about four times that.
    settings.CHAT_MODEL = "gpt-4o-mini"
    settings.MODEL_VARIANTS = "local=local-model:128000"
    chat_id = new_chat(api, policy="token-budget")
    small = pin(api, chat_id, {"text": THAI * 2}).json()
    assert small["tokens"] == count_tokens(THAI * 2, "gpt-4o-mini")
    url = f"/api/v1/chats/{chat_id}/"
    assert api.patch(url, {"model_variant": "local"}, format="json").status_code == 200
    # What the bound counts (the snapshot the context is built from) is the new model's count.
    assert [p.tokens for p in load_snapshot(chat_id).pins] == [
        count_tokens(THAI * 2, "local-model")
    ]
    assert api.patch(url, {"model_variant": ""}, format="json").status_code == 200
    assert Pin.objects.get().tokens == small["tokens"]
    # Fits gpt-4o-mini's room, not the local model's: the change is refused, nothing changed.
    assert pin(api, chat_id, {"text": THAI * 20}).status_code == 201
    counts = sorted(Pin.objects.values_list("tokens", flat=True))
    refused = api.patch(url, {"model_variant": "local"}, format="json")
    assert refused.status_code == 400, refused.content
    assert "unpin something first" in str(refused.json())
    assert sorted(Pin.objects.values_list("tokens", flat=True)) == counts
    assert api.get(url).json()["model_variant"] == ""


@pytest.mark.django_db
def test_a_pin_on_a_chat_whose_variant_was_removed_is_counted_with_the_default_model(
    api: Any, settings: Any
) -> None:
    settings.MODEL_VARIANTS = "local=local-model:128000"
    chat_id = new_chat(api, model_variant="local")
    settings.MODEL_VARIANTS = ""  # the operator removed it
    response = pin(api, chat_id, {"text": THAI})
    assert response.status_code == 201, response.content
    assert response.json()["tokens"] == count_tokens(THAI, settings.CHAT_MODEL)


@pytest.mark.django_db
def test_pins_are_listed_shown_in_the_context_and_removed(api: Any) -> None:
    chat_id = new_chat(api, system_prompt="Be brief.")
    made = pin(api, chat_id, {"text": CANARY}).json()
    assert made["seq"] is None and made["tokens"] > 0
    assert [p["id"] for p in api.get(f"/api/v1/chats/{chat_id}/pins/").json()] == [made["id"]]
    context = api.get(f"/api/v1/chats/{chat_id}/context/").json()["messages"]
    assert context[1] == {"role": "system", "content": PINNED_HEADER + pin_line(CANARY)}
    assert api.delete(f"/api/v1/chats/{chat_id}/pins/{made['id']}/").status_code == 204
    assert api.delete(f"/api/v1/chats/{chat_id}/pins/{made['id']}/").status_code == 404
    assert api.get(f"/api/v1/chats/{chat_id}/pins/").json() == []
    context = api.get(f"/api/v1/chats/{chat_id}/context/").json()["messages"]
    assert not pinned_entries(context)


@pytest.mark.django_db
def test_a_pinned_message_in_the_verbatim_tail_is_not_shown_twice(api: Any) -> None:
    chat_id = new_chat(api)
    turn(api, chat_id, "remember the blue door")
    assert pin(api, chat_id, {"seq": 1}).status_code == 201
    context = api.get(f"/api/v1/chats/{chat_id}/context/").json()["messages"]
    assert times_present(context, "user", "remember the blue door") == 1
    assert not pinned_entries(context)


@pytest.mark.django_db
@pytest.mark.parametrize(
    ("body", "field"),
    [
        ({}, "non_field_errors"),
        ({"text": "a", "seq": 1}, "non_field_errors"),
        ({"text": "   "}, "text"),
        ({"text": 5}, "text"),
        ({"seq": 0}, "seq"),
        ({"seq": 99}, "seq"),
        ({"text": "a", "colour": "red"}, "colour"),
    ],
)
def test_bad_pins_are_a_400_naming_the_field_and_store_nothing(
    api: Any, body: dict[str, Any], field: str
) -> None:
    chat_id = new_chat(api)
    response = pin(api, chat_id, body)
    assert response.status_code == 400, response.content
    assert field in response.json(), response.json()
    assert not Pin.objects.exists()


@pytest.mark.django_db
def test_a_message_pinned_twice_is_a_400(api: Any) -> None:
    chat_id = new_chat(api)
    turn(api, chat_id, "hello")
    assert pin(api, chat_id, {"seq": 2}).status_code == 201
    again = pin(api, chat_id, {"seq": 2})
    assert again.status_code == 400 and "already pinned" in again.json()["seq"][0]
    assert Pin.objects.count() == 1


@pytest.mark.django_db
def test_another_users_chat_is_a_404_on_every_pin_route_and_method(
    api: Any, other_api: Any
) -> None:
    chat_id = new_chat(api)
    pin_id = pin(api, chat_id, {"text": "mine"}).json()["id"]
    pins = f"/api/v1/chats/{chat_id}/pins/"
    assert other_api.get(pins).status_code == 404
    assert other_api.post(pins, {"text": "theirs"}, format="json").status_code == 404
    assert other_api.post(pins, {"bogus": 1}, format="json").status_code == 404  # before the body
    assert other_api.delete(f"{pins}{pin_id}/").status_code == 404
    # Their own chat cannot reach this chat's pin either.
    theirs = new_chat(other_api)
    assert other_api.delete(f"/api/v1/chats/{theirs}/pins/{pin_id}/").status_code == 404
    assert list(Pin.objects.values_list("text", flat=True)) == ["mine"]
