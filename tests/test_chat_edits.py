"""Changing a chat (PATCH /api/v1/chats/{id}/): only the fields sent change, with the checks
creation makes, atomically; the memory (summary, W, version) is kept and a new policy applies
from the chat's next fold decision. PUT is a 405 that says to PATCH."""

from typing import Any

import pytest
from django.utils import timezone

from conversations.models import Brief, Chat
from conversations.variants import _parse_variants
from memory_worker.coordination.dispatch import RequestReason
from memory_worker.engine.policy import Trigger
from memory_worker.folding.execute import decide_for_chat, fold_once
from memory_worker.folding.snapshot import load_snapshot

pytestmark = pytest.mark.django_db

TUTOR = "Answer in the voice of a patient tutor. " * 400  # about 3,200 tokens


def new_chat(api: Any, **body: Any) -> dict[str, Any]:
    response = api.post("/api/v1/chats/", body, format="json")
    assert response.status_code == 201, response.content
    return dict(response.json())


def patch(api: Any, chat_id: int, body: Any) -> Any:
    return api.patch(f"/api/v1/chats/{chat_id}/", body, format="json")


def stored(chat_id: int) -> dict[str, Any]:
    chat = Chat.objects.get(pk=chat_id)
    return {
        "title": chat.title,
        "system_prompt": chat.system_prompt,
        "system_prompt_tokens": chat.system_prompt_tokens,
        "policy": chat.policy,
        "policy_overrides": chat.policy_overrides,
        "model_variant": chat.model_variant,
    }


def take_turns(api: Any, chat_id: int, count: int) -> None:
    for number in range(count):
        response = api.post(
            f"/api/v1/chats/{chat_id}/turns/", {"content": f"fact {number}"}, format="json"
        )
        assert response.status_code == 201, response.content


def test_a_rename_changes_only_the_title(api: Any) -> None:
    chat = new_chat(api, title="draft", policy="contract", system_prompt="Be brief.")
    before = stored(chat["id"])
    response = patch(api, chat["id"], {"title": "Trip planning"})
    assert response.status_code == 200, response.content
    assert response.json()["title"] == "Trip planning"
    assert stored(chat["id"]) == {**before, "title": "Trip planning"}


def test_a_new_system_prompt_is_counted_for_the_bound(api: Any) -> None:
    chat = new_chat(api, system_prompt="Be brief.")
    short = Chat.objects.get(pk=chat["id"]).system_prompt_tokens
    response = patch(api, chat["id"], {"system_prompt": "Answer in French, " * 50})
    assert response.status_code == 200, response.content
    assert Chat.objects.get(pk=chat["id"]).system_prompt_tokens > short
    context = api.get(f"/api/v1/chats/{chat['id']}/context/").json()["messages"]
    assert context[0] == {"role": "system", "content": "Answer in French, " * 50}


def test_a_policy_change_echoes_the_effective_policy_and_keeps_the_memory(api: Any) -> None:
    chat = new_chat(api, policy="contract")
    take_turns(api, chat["id"], 8)
    fold_once(chat["id"], RequestReason.MANUAL)
    brief = Brief.objects.get(chat_id=chat["id"])
    assert brief.last_consolidated > 0
    body = {"policy": "token-budget", "policy_overrides": {"max_tokens": 4800}}
    response = patch(api, chat["id"], body)
    assert response.status_code == 200, response.content
    echoed = response.json()
    assert (echoed["policy"], echoed["policy_overrides"]) == ("token-budget", {"max_tokens": 4800})
    assert echoed["effective_policy"]["name"] == "token-budget"
    assert echoed["effective_policy"]["max_tokens"] == 4800
    after = Brief.objects.get(chat_id=chat["id"])
    kept = ("summary", "last_consolidated", "version", "summary_tokens", "turns_mark")
    assert {f: getattr(after, f) for f in kept} == {f: getattr(brief, f) for f in kept}


def test_the_fold_after_a_policy_change_follows_the_new_policy(api: Any) -> None:
    """Eight turns are nothing to fold for sliding-window (context 75) and past the contract
    preset's K + B: the next decision, and the fold it runs, are the contract's."""
    chat = new_chat(api, policy="sliding-window")
    take_turns(api, chat["id"], 8)
    now = timezone.now()
    snapshot = load_snapshot(chat["id"])
    assert decide_for_chat(Chat.objects.get(pk=chat["id"]), snapshot, now) is None
    assert patch(api, chat["id"], {"policy": "contract"}).status_code == 200
    decision = decide_for_chat(Chat.objects.get(pk=chat["id"]), snapshot, now)
    assert decision is not None and decision.trigger == Trigger.OVERFLOW
    fold_once(chat["id"], RequestReason.SWEEP)
    brief = Brief.objects.get(chat_id=chat["id"])
    assert (brief.last_consolidated, brief.version) == (decision.to_seq, 1)
    assert brief.summary


def test_overrides_are_checked_against_the_new_policy_when_only_the_policy_changes(
    api: Any,
) -> None:
    """The chat's overrides stay; with the new preset they must still be consistent."""
    chat = new_chat(api, policy="sliding-window", policy_overrides={"tail_messages": 50})
    before = stored(chat["id"])
    response = patch(api, chat["id"], {"policy": "contract"})
    assert response.status_code == 400, response.content
    assert "tail_messages" in response.json()["policy_overrides"][0]
    assert stored(chat["id"]) == before
    fine = patch(api, chat["id"], {"policy": "contract", "policy_overrides": {}})
    assert fine.status_code == 200, fine.content


@pytest.mark.parametrize(
    ("body", "field"),
    [
        ({"policy": "no-such-policy"}, "policy"),
        ({"policy_overrides": {"no_such_knob": 1}}, "policy_overrides"),
        ({"policy_overrides": {"summary_token_cap": 8001}}, "policy_overrides"),
        ({"policy_overrides": {"tail_messages": 70}}, "policy_overrides"),
        ({"policy_overrides": "big"}, "policy_overrides"),
        ({"title": "x" * 201}, "title"),
        ({"title": 5}, "title"),
        ({"system_prompt": ["a"]}, "system_prompt"),
        ({"model_variant": "nope"}, "model_variant"),
        ({"title": "ok", "owner": 2}, "owner"),
        ({"title": "ok", "polcy": "contract"}, "polcy"),
    ],
)
def test_a_refused_change_is_a_400_naming_the_field_and_stores_nothing(
    api: Any, body: dict[str, Any], field: str
) -> None:
    chat = new_chat(api, title="kept", policy="sliding-window")
    before = stored(chat["id"])
    response = patch(api, chat["id"], body)
    assert response.status_code == 400, response.content
    assert field in response.json(), response.json()
    assert stored(chat["id"]) == before


def test_an_unknown_field_is_refused_at_creation_too(api: Any) -> None:
    response = api.post("/api/v1/chats/", {"polcy": "contract"}, format="json")
    assert response.status_code == 400, response.content
    assert "Unknown field" in response.json()["polcy"][0]
    assert Chat.objects.count() == 0


def test_read_only_fields_sent_back_are_ignored(api: Any) -> None:
    """A client may send back what it read: only the writable fields it changed count."""
    chat = new_chat(api, title="draft")
    response = patch(api, chat["id"], {**chat, "title": "final", "last_seq": 99, "id": 12345})
    assert response.status_code == 200, response.content
    assert (response.json()["id"], response.json()["last_seq"]) == (chat["id"], 0)
    assert Chat.objects.get(pk=chat["id"]).title == "final"


@pytest.mark.parametrize(
    "body",
    [{"system_prompt": TUTOR}, {"policy_overrides": {"summary_token_cap": 3000}}],
    ids=["system-prompt", "summary-cap"],
)
def test_a_change_that_leaves_no_room_in_the_window_is_refused(
    api: Any, settings: Any, body: dict[str, Any]
) -> None:
    """Creation's room check: the system prompt and a summary at its cap must leave a quarter
    of what a turn may send for the conversation."""
    settings.CHAT_MODEL_CONTEXT_TOKENS = 4096
    _parse_variants.cache_clear()
    try:
        chat = new_chat(api, system_prompt="Be brief.")
        before = stored(chat["id"])
        response = patch(api, chat["id"], body)
        assert response.status_code == 400, response.content
        assert "left for the conversation" in response.json()["non_field_errors"][0]
        assert stored(chat["id"]) == before
    finally:
        _parse_variants.cache_clear()


def test_a_variant_with_a_larger_window_makes_room_for_a_long_prompt(
    api: Any, settings: Any
) -> None:
    settings.CHAT_MODEL_CONTEXT_TOKENS = 4096
    settings.MODEL_VARIANTS = "deep=gpt-deep:128000"
    _parse_variants.cache_clear()
    try:
        chat = new_chat(api, system_prompt="Be brief.")
        assert patch(api, chat["id"], {"system_prompt": TUTOR}).status_code == 400
        both = patch(api, chat["id"], {"system_prompt": TUTOR, "model_variant": "deep"})
        assert both.status_code == 200, both.content
        assert stored(chat["id"])["model_variant"] == "deep"
    finally:
        _parse_variants.cache_clear()


def test_another_users_chat_is_a_404_and_unchanged(api: Any, other_api: Any) -> None:
    chat = new_chat(api, title="private")
    response = patch(other_api, chat["id"], {"title": "mine now"})
    assert response.status_code == 404
    assert response.json()["code"] == "not_found"
    assert Chat.objects.get(pk=chat["id"]).title == "private"


def test_an_empty_change_answers_the_chat_and_writes_nothing(api: Any) -> None:
    chat = new_chat(api, title="same")
    response = patch(api, chat["id"], {})
    assert response.status_code == 200
    assert response.json()["updated_at"] == chat["updated_at"]


def test_put_is_a_405_that_says_to_patch(api: Any) -> None:
    chat = new_chat(api, title="kept")
    response = api.put(f"/api/v1/chats/{chat['id']}/", {"title": "x"}, format="json")
    assert response.status_code == 405
    assert response.json()["code"] == "method_not_allowed"
    assert "PATCH" in response.json()["detail"]
    assert Chat.objects.get(pk=chat["id"]).title == "kept"
