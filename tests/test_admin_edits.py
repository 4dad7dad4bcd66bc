"""Editing through the Django admin keeps the API's rules: a chat added there gets its brief and
a counted system prompt, a policy or variant its turns could not use is refused on the form,
an edit never writes back the turn counter, history cannot be deleted row by row, and deleting
chats does not load their history."""

from __future__ import annotations

import re
from typing import Any

import pytest
from django.contrib.auth import get_user_model
from django.test import Client

from conversations import admin as chat_admin
from conversations.models import Brief, Chat, Consolidation, Message
from conversations.services import chats as chat_service
from memory_worker.policies import effective_policy
from memory_worker.presets import PolicyError
from memory_worker.tokens import count_tokens

pytestmark = pytest.mark.django_db

HIDDEN = re.compile(
    r'<input type="hidden" name="([^"]+-(?:TOTAL|INITIAL|MIN_NUM|MAX_NUM)_FORMS)"[^>]*value="(\d*)"'
)


@pytest.fixture
def staff(db: Any) -> Client:
    get_user_model().objects.create_superuser("root", "root@example.com", "admin-pw-123")
    client = Client()
    assert client.login(username="root", password="admin-pw-123")
    return client


def management_forms(page: str) -> dict[str, str]:
    found = dict(HIDDEN.findall(page))
    assert any(name.endswith("TOTAL_FORMS") for name in found), "no inline formsets on the page"
    return found


def add_chat(staff: Client, owner: Any, **fields: str) -> Any:
    page = staff.get("/admin/conversations/chat/add/").content.decode()
    data = {
        **management_forms(page),
        "title": "from the admin",
        "owner": str(owner.pk),
        "external_id": "",
        "system_prompt": "Answer in French.",
        "policy": "contract",
        "policy_overrides": "{}",
        "model_variant": "",
        **fields,
    }
    return staff.post("/admin/conversations/chat/add/", data)


def test_a_chat_added_in_the_admin_takes_turns(staff: Client, user: Any, api: Any) -> None:
    response = add_chat(staff, user)
    assert response.status_code == 302, response.content.decode()[:2000]
    chat = Chat.objects.get(title="from the admin")
    assert Brief.objects.filter(chat=chat).exists()  # every turn reads it: was missing
    assert chat.system_prompt_tokens == count_tokens("Answer in French.", None) > 0
    turn = api.post(f"/api/v1/chats/{chat.pk}/turns/", {"content": "bonjour"}, format="json")
    assert turn.status_code == 201, turn.content


@pytest.mark.parametrize(
    ("fields", "field", "says"),
    [
        ({"policy_overrides": '{"window": -1}'}, "policy_overrides", "at least"),
        ({"policy_overrides": '{"no_such_knob": 1}'}, "policy_overrides", "no_such_knob"),
        ({"policy": "slidingwindow"}, "policy", "Unknown policy"),
        ({"model_variant": "turbo"}, "model_variant", "Unknown model_variant"),
    ],
)
def test_settings_its_turns_cannot_use_are_refused_on_the_form(
    staff: Client, user: Any, fields: dict[str, str], field: str, says: str
) -> None:
    response = add_chat(staff, user, **fields)
    assert response.status_code == 200  # the form again, with the error
    errors = response.context["adminform"].form.errors
    assert says in " ".join(errors.get(field, [])), errors
    assert not Chat.objects.exists()


def test_an_edit_counts_the_new_prompt_and_keeps_the_turn_counter(user: Any, api: Any) -> None:
    chat = chat_service.create_chat(user, system_prompt="Be brief.")
    stale = Chat.objects.get(pk=chat.pk)  # an editor's form, read before the turn below
    assert (
        api.post(f"/api/v1/chats/{chat.pk}/turns/", {"content": "hi"}, format="json").status_code
        == 201
    )
    stale.system_prompt = "Be very brief, and answer in the user's language."
    chat_service.save_chat(stale)
    saved = Chat.objects.get(pk=chat.pk)
    assert saved.last_seq == 2  # not the 0 the stale instance held
    assert saved.system_prompt_tokens == count_tokens(stale.system_prompt, None)


def test_history_rows_cannot_be_deleted_one_by_one(staff: Client, user: Any, api: Any) -> None:
    chat = chat_service.create_chat(user)
    api.post(f"/api/v1/chats/{chat.pk}/turns/", {"content": "hi"}, format="json")
    message = Message.objects.filter(chat=chat).first()
    assert message is not None
    assert staff.get(f"/admin/conversations/message/{message.pk}/delete/").status_code == 403
    assert staff.get(f"/admin/conversations/brief/{chat.pk}/delete/").status_code == 403
    assert Message.objects.filter(chat=chat).count() == 2


def test_deleting_chats_counts_their_history_instead_of_listing_it(
    staff: Client, user: Any, django_assert_max_num_queries: Any
) -> None:
    chat = chat_service.create_chat(user)
    Message.objects.bulk_create(
        Message(chat=chat, seq=seq, role="user", content=f"m{seq}", token_count=2)
        for seq in range(1, 301)
    )
    Chat.objects.filter(pk=chat.pk).update(last_seq=300)
    Consolidation.objects.create(chat=chat, trigger="manual", from_seq=1, to_seq=10, base_version=0)
    data = {"action": "delete_selected", "_selected_action": [str(chat.pk)]}
    with django_assert_max_num_queries(20):  # Django's page loaded all 300 messages and more
        page = staff.post("/admin/conversations/chat/", data)
    assert page.status_code == 200
    text = page.content.decode()
    assert "300 messages" in text and "1 consolidations" in text
    assert "m150" not in text
    done = staff.post("/admin/conversations/chat/", {**data, "post": "yes"})
    assert done.status_code == 302
    assert not Chat.objects.exists() and not Message.objects.exists()


def test_consolidate_now_stops_at_the_first_refusal(
    staff: Client, user: Any, monkeypatch: Any
) -> None:
    chats = [chat_service.create_chat(user) for _ in range(5)]
    tried: list[int] = []

    def refused(chat_id: int, trigger: str) -> bool:
        tried.append(chat_id)
        return len(tried) < 3  # the broker goes away at the third

    monkeypatch.setattr(chat_admin, "request_consolidation", refused)
    data = {"action": "consolidate_now", "_selected_action": [str(c.pk) for c in chats]}
    response = staff.post("/admin/conversations/chat/", data, follow=True)
    assert len(tried) == 3
    assert "Queued 2 of 5" in response.content.decode()


def test_stored_chats_are_brought_within_the_new_rules(user: Any, api: Any) -> None:
    """Chats written before the knob bounds (or added in the admin without a brief) would fail
    every turn and every listing of their owner's chats once the new checks read them."""
    import importlib

    from django.apps import apps

    migration = importlib.import_module(
        "conversations.migrations.0007_stored_chats_within_the_new_rules"
    )
    low_cap = Chat.objects.create(
        owner=user, policy="sliding-window", policy_overrides={"summary_token_cap": 50}
    )
    huge = Chat.objects.create(
        owner=user,
        policy="sliding-window",
        policy_overrides={"cooldown_seconds": 1e12, "window": 6, "summary_token_cap": 9000},
    )
    for chat in (low_cap, huge):
        Brief.objects.create(chat=chat)
    no_brief = Chat.objects.create(owner=user, policy="contract")  # as the admin used to add
    with pytest.raises(PolicyError):  # out of bounds: what the API and the admin now refuse
        effective_policy(low_cap.policy, low_cap.policy_overrides)
    migration.bring_within_rules(apps, None)
    assert Chat.objects.get(pk=low_cap.pk).policy_overrides == {"summary_token_cap": 64}
    assert Chat.objects.get(pk=huge.pk).policy_overrides == {
        "cooldown_seconds": 1e9,
        "window": 6,
        "summary_token_cap": 8000,
    }
    assert Brief.objects.filter(chat=no_brief).exists()
    assert api.get("/api/v1/chats/").status_code == 200
    for chat in (low_cap, huge, no_brief):
        turn = api.post(f"/api/v1/chats/{chat.pk}/turns/", {"content": "hi"}, format="json")
        assert turn.status_code == 201, turn.content


def test_deleting_a_user_takes_their_chats_and_history(staff: Client, user: Any, api: Any) -> None:
    """History rows have no delete page of their own; deleting their owner must still work."""
    chat = chat_service.create_chat(user)
    api.post(f"/api/v1/chats/{chat.pk}/turns/", {"content": "hi"}, format="json")
    page = staff.post(f"/admin/auth/user/{user.pk}/delete/")
    assert page.status_code == 200
    assert "2 messages" in page.content.decode()
    done = staff.post(f"/admin/auth/user/{user.pk}/delete/", {"post": "yes"})
    assert done.status_code == 302, done.content.decode()[:500]
    assert not Chat.objects.exists() and not Message.objects.exists()
    assert not Brief.objects.exists()
