"""The admin keeps the API's rules and stays cheap as data grows (docs/operations.md, "The
admin"): the chat form refuses what the API refuses, deleting a user needs the permissions
Django's own page would ask for, a view-only staff user cannot queue folds, and the pages that
grow with the data (the owner select, the message and ledger lists, the daily notes) do not."""

from __future__ import annotations

import re
from datetime import date, timedelta
from typing import Any

import pytest
from django.contrib.auth import get_user_model
from django.contrib.auth.models import Permission
from django.db import connection
from django.test import Client
from django.test.utils import CaptureQueriesContext
from django.utils import timezone

from conversations import admin as chat_admin
from conversations.models import Brief, Chat, Consolidation, DailyNote, Message
from conversations.services import chats as chat_service
from tests.test_admin_edits import add_chat

pytestmark = pytest.mark.django_db

PASSWORD = "staff-pw-123"


@pytest.fixture
def staff(db: Any) -> Client:
    get_user_model().objects.create_superuser("root", "root@example.com", PASSWORD)
    client = Client()
    assert client.login(username="root", password=PASSWORD)
    return client


def staff_with(*codenames: str) -> Client:
    """A staff user holding only these permissions ("app_label.codename")."""
    member = get_user_model().objects.create_user("member", password=PASSWORD, is_staff=True)
    for name in codenames:
        app_label, codename = name.split(".")
        member.user_permissions.add(
            Permission.objects.get(content_type__app_label=app_label, codename=codename)
        )
    client = Client()
    assert client.login(username="member", password=PASSWORD)
    return client


def chat_with_messages(owner: Any, count: int) -> Chat:
    chat = chat_service.create_chat(owner)
    Message.objects.bulk_create(
        Message(chat=chat, seq=seq, role="user", content=f"message {seq}", token_count=2)
        for seq in range(1, count + 1)
    )
    Chat.objects.filter(pk=chat.pk).update(last_seq=count)
    return chat


# --- 1. policy_overrides: a JSON object, as the API takes ------------------------------------


@pytest.mark.parametrize("typed", ["[]", "0", "false", '""', "null", '"{}"', "[1, 2]"])
def test_policy_overrides_that_are_not_an_object_are_refused(
    staff: Client, user: Any, api: Any, typed: str
) -> None:
    response = add_chat(staff, user, policy_overrides=typed)
    assert response.status_code == 200  # the form again, with the error
    errors = response.context["adminform"].form.errors
    assert "object" in " ".join(errors.get("policy_overrides", [])), errors
    assert not Chat.objects.exists()
    assert api.get("/api/v1/chats/").status_code == 200


def test_an_empty_policy_overrides_box_means_no_overrides(staff: Client, user: Any) -> None:
    response = add_chat(staff, user, policy_overrides="")
    assert response.status_code == 302, response.content.decode()[:2000]
    assert Chat.objects.get().policy_overrides == {}


def test_an_edit_to_a_non_object_is_refused_and_the_owner_can_still_list(
    staff: Client, user: Any, api: Any
) -> None:
    assert add_chat(staff, user).status_code == 302
    chat = Chat.objects.get()
    page = staff.get(f"/admin/conversations/chat/{chat.pk}/change/").content.decode()
    response = add_chat_change(staff, chat, page, policy_overrides="0")
    assert response.status_code == 200
    assert Chat.objects.get().policy_overrides == {}
    assert api.get("/api/v1/chats/").status_code == 200


def add_chat_change(staff: Client, chat: Chat, page: str, **fields: str) -> Any:
    from tests.test_admin_edits import management_forms

    data = {
        **management_forms(page),
        "title": chat.title,
        "owner": str(chat.owner_id),
        "external_id": chat.external_id,
        "system_prompt": chat.system_prompt,
        "policy": chat.policy,
        "policy_overrides": "{}",
        "model_variant": chat.model_variant,
        **fields,
    }
    return staff.post(f"/admin/conversations/chat/{chat.pk}/change/", data)


# --- 2. the system prompt: the API's cap, and its whitespace kept ---------------------------


def test_a_system_prompt_over_the_api_cap_is_refused(staff: Client, user: Any) -> None:
    too_long = "x" * (chat_service.MAX_SYSTEM_PROMPT_CHARS + 1)
    response = add_chat(staff, user, system_prompt=too_long)
    assert response.status_code == 200
    assert "system_prompt" in response.context["adminform"].form.errors
    assert not Chat.objects.exists()
    at_cap = "x" * chat_service.MAX_SYSTEM_PROMPT_CHARS
    assert add_chat(staff, user, system_prompt=at_cap).status_code == 302


def test_the_system_prompt_keeps_its_whitespace_as_the_api_does(staff: Client, user: Any) -> None:
    prompt = "  Answer in French.\n\n"
    assert add_chat(staff, user, system_prompt=prompt).status_code == 302
    assert Chat.objects.get().system_prompt == prompt


# --- 3. deleting a user needs the permission to delete their chats --------------------------


def test_deleting_a_user_needs_the_permission_to_delete_chats(user: Any) -> None:
    chat_with_messages(user, 3)
    manager = staff_with("auth.view_user", "auth.delete_user")
    page = manager.get(f"/admin/auth/user/{user.pk}/delete/")
    assert page.status_code == 200
    assert "chat" in page.context["perms_lacking"], page.context["perms_lacking"]
    refused = manager.post(f"/admin/auth/user/{user.pk}/delete/", {"post": "yes"})
    assert refused.status_code == 403
    assert Chat.objects.count() == 1 and Message.objects.count() == 3


def test_deleting_a_user_with_the_permission_to_delete_chats(user: Any) -> None:
    chat_with_messages(user, 3)
    manager = staff_with("auth.view_user", "auth.delete_user", "conversations.delete_chat")
    page = manager.get(f"/admin/auth/user/{user.pk}/delete/")
    assert not page.context["perms_lacking"]
    done = manager.post(f"/admin/auth/user/{user.pk}/delete/", {"post": "yes"})
    assert done.status_code == 302
    assert not Chat.objects.exists() and not Message.objects.exists()


def test_deleting_a_user_without_chats_needs_no_chat_permission(user: Any) -> None:
    manager = staff_with("auth.view_user", "auth.delete_user")
    page = manager.get(f"/admin/auth/user/{user.pk}/delete/")
    assert not page.context["perms_lacking"]


# --- 4. "Consolidate now" needs the change permission ---------------------------------------


def test_a_view_only_staff_user_cannot_queue_folds(user: Any, monkeypatch: Any) -> None:
    chat = chat_service.create_chat(user)
    queued: list[int] = []
    monkeypatch.setattr(
        chat_admin, "request_consolidation", lambda chat_id, trigger: queued.append(chat_id)
    )
    viewer = staff_with("conversations.view_chat")
    listing = viewer.get("/admin/conversations/chat/")
    assert listing.status_code == 200
    assert "consolidate_now" not in listing.content.decode()
    data = {"action": "consolidate_now", "_selected_action": [str(chat.pk)]}
    viewer.post("/admin/conversations/chat/", data)
    assert queued == []


def test_a_staff_user_who_may_change_chats_can_queue_folds(user: Any, monkeypatch: Any) -> None:
    chat = chat_service.create_chat(user)
    queued: list[int] = []

    def accept(chat_id: int, trigger: str) -> bool:
        queued.append(chat_id)
        return True

    monkeypatch.setattr(chat_admin, "request_consolidation", accept)
    editor = staff_with("conversations.view_chat", "conversations.change_chat")
    data = {"action": "consolidate_now", "_selected_action": [str(chat.pk)]}
    editor.post("/admin/conversations/chat/", data)
    assert queued == [chat.pk]


# --- 5. the owner is picked by id, not from a select of every user --------------------------


def test_the_chat_pages_do_not_list_every_user(staff: Client, user: Any) -> None:
    get_user_model().objects.bulk_create(
        get_user_model()(username=f"someone-{number}") for number in range(50)
    )
    chat = chat_service.create_chat(user)
    for url in ("/admin/conversations/chat/add/", f"/admin/conversations/chat/{chat.pk}/change/"):
        page = staff.get(url).content.decode()
        assert "someone-49" not in page
        assert re.search(r'<input[^>]*name="owner"[^>]*vForeignKeyRawIdAdminField', page), url


# --- 6. the message and ledger lists order by their own columns ------------------------------


def order_by_of_listing(staff: Client, url: str, table: str) -> str:
    with CaptureQueriesContext(connection) as queries:
        assert staff.get(url).status_code == 200
    listing = [q["sql"] for q in queries if q["sql"].startswith(f'SELECT "{table}"."id"')]
    assert listing, [q["sql"][:80] for q in queries]
    return listing[0].split("ORDER BY", 1)[1]


def test_the_message_list_orders_by_its_own_index(staff: Client, user: Any) -> None:
    chat_with_messages(user, 3)
    order_by = order_by_of_listing(staff, "/admin/conversations/message/", "conversations_message")
    assert "conversations_chat" not in order_by  # no join to sort 2M rows by the chat's order
    assert '"conversations_message"."chat_id" DESC' in order_by
    assert '"conversations_message"."seq" DESC' in order_by


def test_the_ledger_list_orders_by_its_own_id(staff: Client, user: Any) -> None:
    chat = chat_service.create_chat(user)
    Consolidation.objects.create(chat=chat, trigger="window", from_seq=1, to_seq=2, base_version=0)
    order_by = order_by_of_listing(
        staff, "/admin/conversations/consolidation/", "conversations_consolidation"
    )
    assert "conversations_chat" not in order_by
    assert order_by.strip().startswith('"conversations_consolidation"."id" DESC')


def test_a_chats_all_messages_link_lands_on_its_newest(staff: Client, user: Any) -> None:
    chat = chat_with_messages(user, 150)  # more than a page
    page = staff.get(f"/admin/conversations/chat/{chat.pk}/change/").content.decode()
    link = re.search(r'<a href="([^"]+)">all messages</a>', page)
    assert link is not None
    listing = staff.get(link.group(1).replace("&amp;", "&"))
    shown = [message.seq for message in listing.context["cl"].result_list]
    assert shown[0] == 150 and 1 not in shown


def test_the_ledger_trigger_filter_offers_the_known_triggers_without_a_scan(
    staff: Client, user: Any
) -> None:
    chat = chat_service.create_chat(user)
    for trigger in ("window", "manual"):
        Consolidation.objects.create(
            chat=chat, trigger=trigger, from_seq=1, to_seq=2, base_version=0
        )
    with CaptureQueriesContext(connection) as queries:
        page = staff.get("/admin/conversations/consolidation/").content.decode()
    assert not [q["sql"] for q in queries if "DISTINCT" in q["sql"]]
    for trigger in ("token_budget", "hard_bound", "manual", "cooldown"):
        assert f"?trigger={trigger}" in page, trigger
    filtered = staff.get("/admin/conversations/consolidation/?trigger=manual")
    assert [ledger.trigger for ledger in filtered.context["cl"].result_list] == ["manual"]


def test_the_ledger_trigger_filter_knows_every_trigger_a_fold_can_name() -> None:
    """A ledger row's trigger is its Decision's, a policy.Trigger (typed): the filter's fixed
    choices offer each of them, the offline fallback of a turn's fold included."""
    from memory_worker.policy import TRIGGER_PRIORITY, Trigger

    offered = [value for value, _label in chat_admin.LEDGER_TRIGGERS]
    assert offered == [trigger.value for trigger in Trigger]
    assert {*TRIGGER_PRIORITY, Trigger.MANUAL, Trigger.HARD_BOUND} < set(offered)
    assert Trigger.HARD_BOUND_FALLBACK in offered


# --- 7. the chat page shows the latest daily notes only -------------------------------------


def test_the_chat_page_shows_only_the_latest_daily_notes(staff: Client, user: Any) -> None:
    chat = chat_service.create_chat(user)
    first = date(2026, 1, 1)
    DailyNote.objects.bulk_create(
        DailyNote(chat=chat, day=first + timedelta(days=n), facts=[{"text": f"fact of day {n}"}])
        for n in range(40)
    )
    page = staff.get(f"/admin/conversations/chat/{chat.pk}/change/").content.decode()
    newest = 10  # the admin's RECENT_NOTES
    assert "fact of day 39" in page and f"fact of day {40 - newest}" in page
    assert f"fact of day {39 - newest}" not in page and "fact of day 0" not in page
    assert f"/api/v1/chats/{chat.pk}/notes/" in page


# --- 8. the memory filter says what it selects ----------------------------------------------


def test_the_unfolded_filter_says_it_counts_messages_whatever_the_policy(
    staff: Client, user: Any
) -> None:
    listing = staff.get("/admin/conversations/chat/").content.decode()
    assert "Lagging" not in listing
    assert "Over 60 unfolded messages" in listing


def test_the_backing_off_filter_finds_chats_waiting_to_retry_a_fold(
    staff: Client, user: Any
) -> None:
    waiting = chat_service.create_chat(user, title="waiting-chat")
    chat_service.create_chat(user, title="fine-chat")
    Brief.objects.filter(chat=waiting).update(
        consecutive_failures=1, next_attempt_at=timezone.now() + timedelta(minutes=5)
    )
    listing = staff.get("/admin/conversations/chat/?memory=backing_off").content.decode()
    assert "waiting-chat" in listing and "fine-chat" not in listing
