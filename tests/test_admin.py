"""The Django admin for inspecting and editing chats.

Inspecting: memory shown once and plainly (the summary against its cap, folded/verbatim marks,
the next fold's outlook), ledger, context preview, filters, the "consolidate now" action; the
same page in headless Chromium is tests/test_first_hour.py's (tests/support/browser.py). The pages
that grow with the data (the owner select, the message and ledger lists, the daily notes) stay
cheap as it grows (docs/operations.md, "The admin").

Editing keeps the API's rules: a chat added there gets its brief and a counted system prompt, a
policy, variant or policy_overrides its turns could not use is refused on the form, an edit never
writes back the turn counter, history cannot be deleted row by row, and deleting chats does not
load their history. Deleting a user needs the permissions Django's own page would ask for, and a
view-only staff user cannot queue folds."""

from __future__ import annotations

import importlib
import re
from datetime import date, timedelta
from typing import Any

import pytest
from django.apps import apps
from django.contrib.auth import get_user_model
from django.contrib.auth.models import Permission
from django.db import connection
from django.test import Client
from django.test.utils import CaptureQueriesContext
from django.utils import timezone
from django.utils.html import linebreaks

from conversations import admin as chat_admin
from conversations import admin_filters
from conversations.chat_model.tokens import count_tokens
from conversations.models import AgentState, Brief, Chat, Consolidation, DailyNote, Message
from conversations.services import chats as chat_service
from conversations.services.context import SUMMARY_HEADER
from conversations.services.fold_outlook import fold_outlook
from conversations.variants import resolve_variant
from memory_worker.coordination.dispatch import RequestReason
from memory_worker.engine.policy import TRIGGER_PRIORITY, Trigger
from memory_worker.engine.presets import PRESETS, PolicyError
from memory_worker.folding.effective_policy import effective_policy
from memory_worker.folding.execute import decide_for_chat, fold_once
from memory_worker.folding.snapshot import load_snapshot
from memory_worker.scheduling.manual import ManualRequest
from tests.conftest import contract_chat_after_turns

pytestmark = pytest.mark.django_db

PASSWORD = "admin-pw-123"
HIDDEN = re.compile(
    r'<input type="hidden" name="([^"]+-(?:TOTAL|INITIAL|MIN_NUM|MAX_NUM)_FORMS)"[^>]*value="(\d*)"'
)


@pytest.fixture
def admin_user(db: Any) -> Any:
    return get_user_model().objects.create_superuser("root", "root@example.com", PASSWORD)


@pytest.fixture
def staff(admin_user: Any) -> Client:
    """A client logged in as the superuser."""
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


def management_forms(page: str) -> dict[str, str]:
    """The inline formsets' management fields, if the page has any (agent state is shown only
    for a chat that has some)."""
    return dict(HIDDEN.findall(page))


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


# --- inspecting: the chat page, the filters, the action -------------------------------------------


def chat_with_summary(api: Any, turns: int = 14) -> Chat:
    body = {"title": "inspected", "policy": "contract"}  # K = 6: folds come early
    chat_id = api.post("/api/v1/chats/", body, format="json").json()["id"]
    for number in range(turns):
        content = f"Remember that the launch code {number} is blue."
        response = api.post(f"/api/v1/chats/{chat_id}/turns/", {"content": content}, format="json")
        assert response.status_code == 201
    fold_once(chat_id, RequestReason.MANUAL)
    assert Brief.objects.get(chat_id=chat_id).last_consolidated > 0
    return Chat.objects.get(pk=chat_id)


def test_chat_page_shows_summary_ledger_and_context(client: Any, admin_user: Any, api: Any) -> None:
    chat = chat_with_summary(api)
    client.force_login(admin_user)
    page = client.get(f"/admin/conversations/chat/{chat.pk}/change/").content.decode()
    brief = Brief.objects.get(chat=chat)
    first_line = brief.summary.splitlines()[0]
    assert first_line in page  # the summary, rendered
    assert "succeeded" in page and "1..6" in page  # the ledger's first fold
    assert "What the model sees next" in page
    last = chat.messages.order_by("-seq").first()
    assert last is not None and last.content[:40] in page  # context preview and history
    assert chat.system_prompt[:40] in page


def test_filters_find_chats_with_many_unfolded_and_degraded(
    client: Any, admin_user: Any, api: Any
) -> None:
    quiet = api.post("/api/v1/chats/", {"title": "quiet-chat"}, format="json").json()["id"]
    lagging = api.post("/api/v1/chats/", {"title": "lagging-chat"}, format="json").json()["id"]
    Chat.objects.filter(pk=lagging).update(last_seq=500)
    Brief.objects.filter(chat_id=quiet).update(degraded=True)
    client.force_login(admin_user)
    listing = client.get("/admin/conversations/chat/?memory=many_unfolded").content.decode()
    assert "lagging-chat" in listing and "quiet-chat" not in listing
    listing = client.get("/admin/conversations/chat/?memory=degraded").content.decode()
    assert "quiet-chat" in listing and "lagging-chat" not in listing


def test_consolidate_now_action(client: Any, admin_user: Any, api: Any, settings: Any) -> None:
    settings.MEMORY_DISPATCH = "off"
    empty = api.post("/api/v1/chats/", {"title": "x"}, format="json").json()["id"]
    chat_id = contract_chat_after_turns(api, 4)  # a manual fold would fold 2
    client.force_login(admin_user)
    response = client.post(
        "/admin/conversations/chat/",
        {"action": "consolidate_now", "_selected_action": [empty]},
        follow=True,
    )
    # Nothing to fold: said so, and recorded in the ledger.
    assert "0 already queued; 1 with nothing to fold." in response.content.decode()
    assert Consolidation.objects.get(chat_id=empty).status == "nothing_to_fold"
    response = client.post(
        "/admin/conversations/chat/",
        {"action": "consolidate_now", "_selected_action": [chat_id]},
        follow=True,
    )
    # Dispatch is off here: the action reports honestly that nothing could be queued.
    assert "The next consolidation could not be queued" in response.content.decode()


def test_chat_page_shows_daily_notes(client: Any, admin_user: Any, api: Any) -> None:
    from memory_worker.daily_notes import Fact, merge_into_note

    chat_id = api.post("/api/v1/chats/", {"title": "noted"}, format="json").json()["id"]
    fact = "The staging password rotates every 30 days."
    merge_into_note(chat_id, date(2026, 11, 23), [1, 2], [Fact(1, "user", fact)], "offline")
    client.force_login(admin_user)
    page = client.get(f"/admin/conversations/chat/{chat_id}/change/").content.decode()
    assert fact in page and "2026-11-23" in page


# --- editing: a chat added or changed in the admin keeps the API's rules --------------------------


def test_a_chat_added_in_the_admin_takes_turns(staff: Client, user: Any, api: Any) -> None:
    response = add_chat(staff, user)
    assert response.status_code == 302, response.content.decode()[:2000]
    chat = Chat.objects.get(title="from the admin")
    assert Brief.objects.filter(chat=chat).exists()  # every turn reads it
    model = resolve_variant(chat.model_variant).model  # counted as the chat's model counts
    assert chat.system_prompt_tokens == count_tokens("Answer in French.", model) > 0
    turn = api.post(f"/api/v1/chats/{chat.pk}/turns/", {"content": "bonjour"}, format="json")
    assert turn.status_code == 201, turn.content


@pytest.mark.parametrize(
    ("fields", "field", "says"),
    [
        ({"policy_overrides": '{"window": -1}'}, "policy_overrides", "at least"),
        ({"policy_overrides": '{"no_such_knob": 1}'}, "policy_overrides", "no_such_knob"),
        ({"policy": "slidingwindow"}, "policy", "Select a valid choice"),
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
    model = resolve_variant(saved.model_variant).model
    assert saved.system_prompt_tokens == count_tokens(stale.system_prompt, model)


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
    with django_assert_max_num_queries(20):  # Django's own page would load every message
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

    def refused(chat_id: int) -> ManualRequest:
        tried.append(chat_id)
        if len(tried) < 3:  # the broker goes away at the third
            return ManualRequest.QUEUED
        return ManualRequest.NOT_QUEUED

    monkeypatch.setattr(chat_admin, "request_manual_fold", refused)
    data = {"action": "consolidate_now", "_selected_action": [str(c.pk) for c in chats]}
    response = staff.post("/admin/conversations/chat/", data, follow=True)
    assert len(tried) == 3
    assert "Queued 2 consolidation(s)" in response.content.decode()


def test_stored_chats_are_brought_within_the_new_rules(user: Any, api: Any) -> None:
    """Stored chats outside the knob bounds, or without a brief, would fail every turn and every
    listing of their owner's chats once the checks read them: the migration brings them within
    the rules."""
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
    no_brief = Chat.objects.create(owner=user, policy="contract")  # a chat without its brief
    with pytest.raises(PolicyError):  # out of bounds: what the API and the admin refuse
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


# --- policy_overrides: a JSON object, as the API takes --------------------------------------------


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


# --- the system prompt: the API's cap, and its whitespace kept ------------------------------------


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


# --- deleting a user needs the permission to delete their chats -----------------------------------


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


# --- "Consolidate now" needs the change permission ------------------------------------------------


def test_a_view_only_staff_user_cannot_queue_folds(user: Any, monkeypatch: Any) -> None:
    chat = chat_service.create_chat(user)
    queued: list[int] = []
    monkeypatch.setattr(chat_admin, "request_manual_fold", queued.append)
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

    def accept(chat_id: int) -> ManualRequest:
        queued.append(chat_id)
        return ManualRequest.QUEUED

    monkeypatch.setattr(chat_admin, "request_manual_fold", accept)
    editor = staff_with("conversations.view_chat", "conversations.change_chat")
    data = {"action": "consolidate_now", "_selected_action": [str(chat.pk)]}
    editor.post("/admin/conversations/chat/", data)
    assert queued == [chat.pk]


# --- the owner is picked by id, not from a select of every user -----------------------------------


def test_the_chat_pages_do_not_list_every_user(staff: Client, user: Any) -> None:
    get_user_model().objects.bulk_create(
        get_user_model()(username=f"someone-{number}") for number in range(50)
    )
    chat = chat_service.create_chat(user)
    for url in ("/admin/conversations/chat/add/", f"/admin/conversations/chat/{chat.pk}/change/"):
        page = staff.get(url).content.decode()
        assert "someone-49" not in page
        assert re.search(r'<input[^>]*name="owner"[^>]*vForeignKeyRawIdAdminField', page), url


# --- the message and ledger lists order by their own columns --------------------------------------


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
    choices offer each of them, the offline fallbacks (a turn's, a background fold's) included."""
    offered = [value for value, _label in admin_filters.LEDGER_TRIGGERS]
    assert offered == [trigger.value for trigger in Trigger]
    assert {*TRIGGER_PRIORITY, Trigger.MANUAL, Trigger.HARD_BOUND} < set(offered)
    assert {Trigger.HARD_BOUND_FALLBACK, Trigger.SUMMARIZER_FALLBACK} < set(offered)


# --- the chat page shows the latest daily notes only ----------------------------------------------


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


# --- the memory filter says what it selects -------------------------------------------------------


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


def test_a_fallback_summary_is_shown_as_one_and_briefs_filter_by_it(
    staff: Client, user: Any
) -> None:
    fallback = chat_service.create_chat(user, title="fallback-chat")
    model = chat_service.create_chat(user, title="model-chat")
    Brief.objects.filter(chat=fallback).update(
        fallback_since=timezone.now(), fallback_reason="summarizer returned an empty summary"
    )
    page = staff.get(f"/admin/conversations/chat/{fallback.pk}/change/").content.decode()
    assert "summarizer returned an empty summary" in page
    listing = staff.get("/admin/conversations/brief/?fallback_since__isempty=0")
    shown = [brief.chat_id for brief in listing.context["cl"].result_list]
    assert shown == [fallback.pk] and model.pk not in shown


def test_the_ledger_shows_each_folds_dropped_details_read_only(staff: Client, user: Any) -> None:
    chat = chat_service.create_chat(user)
    ledger = Consolidation.objects.create(
        chat=chat,
        trigger="window",
        status="succeeded",
        from_seq=1,
        to_seq=2,
        base_version=0,
        dropped_details=["QX-7719", "ana@example.org"],
    )
    listing = staff.get("/admin/conversations/consolidation/")
    [row] = listing.context["cl"].result_list
    assert listing.context["cl"].model_admin.dropped(row) == 2
    assert "dropped details" in listing.content.decode().lower()
    page = staff.get(f"/admin/conversations/consolidation/{ledger.pk}/change/").content.decode()
    assert "QX-7719" in page and "ana@example.org" in page
    assert 'name="dropped_details"' not in page  # shown, not an input


# --- pins, inline on the chat page --------------------------------------------------------------


def post_pins(staff: Client, chat: Chat, **rows: str) -> Any:
    """The chat's change form sent back unchanged but for the pin rows ``rows`` (pins-N-…)."""
    url = f"/admin/conversations/chat/{chat.pk}/change/"
    page = staff.get(url).content.decode()
    data = {
        **management_forms(page),
        **{field: str(getattr(chat, field) or "") for field in ("title", "system_prompt")},
        "owner": str(chat.owner_id),
        "external_id": chat.external_id,
        "policy": chat.policy,
        "policy_overrides": "{}",
        "model_variant": chat.model_variant,
        **rows,
    }
    pins = list(chat.pins.order_by("id"))
    data["pins-TOTAL_FORMS"] = str(max(len(pins) + 1, int(data.get("pins-TOTAL_FORMS", 0))))
    for index, pin in enumerate(pins):
        data.setdefault(f"pins-{index}-id", str(pin.pk))
        data.setdefault(f"pins-{index}-chat", str(chat.pk))
        data.setdefault(f"pins-{index}-text", pin.text)
        data.setdefault(f"pins-{index}-seq", "" if pin.seq is None else str(pin.seq))
    return staff.post(url, data)


def test_pins_are_added_rewritten_and_removed_inline_through_the_service(
    staff: Client, admin_user: Any, user: Any
) -> None:
    chat = chat_with_messages(user, 2)
    response = post_pins(staff, chat, **{"pins-0-text": "Budget: 1,200 EUR."})
    assert response.status_code == 302, response.content.decode()[:3000]
    pin = chat.pins.get()
    assert (pin.text, pin.seq, pin.created_by) == ("Budget: 1,200 EUR.", None, admin_user)
    assert pin.tokens == count_tokens(pin.text)
    assert (
        "Budget: 1,200 EUR."
        in staff.get(f"/admin/conversations/chat/{chat.pk}/change/").content.decode()
    )

    response = post_pins(staff, chat, **{"pins-0-text": "Budget: 1,500 EUR.", "pins-1-seq": "2"})
    assert response.status_code == 302, response.content.decode()[:3000]
    assert list(chat.pins.order_by("id").values_list("text", "seq")) == [
        ("Budget: 1,500 EUR.", None),
        ("user: message 2", 2),
    ]
    response = post_pins(staff, chat, **{"pins-0-DELETE": "on"})
    assert response.status_code == 302
    assert list(chat.pins.values_list("seq", flat=True)) == [2]


def test_a_pin_over_the_room_left_is_refused_on_the_form(staff: Client, user: Any) -> None:
    chat = chat_service.create_chat(user, policy="token-budget")
    response = post_pins(staff, chat, **{"pins-0-text": "word " * 2500})
    assert response.status_code == 200
    assert "tokens kept for pins are left" in response.content.decode()
    assert not chat.pins.exists()


def test_the_summary_is_edited_through_the_version_check(staff: Client, api: Any) -> None:
    chat = chat_with_summary(api)
    brief = Brief.objects.get(chat=chat)
    url = f"/admin/conversations/chat/{chat.pk}/summary/"
    assert f'href="{url}"' in staff.get(f"/admin/conversations/chat/{chat.pk}/change/").text
    page = staff.get(url)
    assert page.status_code == 200
    assert f'name="version" value="{brief.version}"' in page.text
    stale = staff.post(url, {"summary": "- stale edit", "version": brief.version - 1}, follow=True)
    assert "changed since version" in stale.text
    assert Brief.objects.get(chat=chat).summary == brief.summary
    saved = staff.post(url, {"summary": "- kept by hand 4471", "version": brief.version})
    assert saved.status_code == 302
    edited = Brief.objects.get(chat=chat)
    assert (edited.summary, edited.version) == ("- kept by hand 4471", brief.version + 1)
    edit = Consolidation.objects.get(chat=chat, trigger="edit")
    assert edit.edited_by == "root"


# --- memory, once and plainly ---------------------------------------------------------------------

TIMESTAMP = re.compile(r"\d{4}-\d{2}-\d{2} \d{2}:\d{2}:\d{2} UTC")


def change_page(staff: Client, chat: Chat) -> str:
    response = staff.get(f"/admin/conversations/chat/{chat.pk}/change/")
    assert response.status_code == 200
    return response.content.decode()


def test_the_summary_appears_once_with_its_tokens_against_the_cap(staff: Client, api: Any) -> None:
    chat = chat_with_summary(api)
    brief = Brief.objects.get(chat=chat)
    page = change_page(staff, chat)
    rendered = linebreaks(brief.summary, autoescape=True)
    assert page.count(rendered) == 1  # not again in the preview, nor in an inline
    assert SUMMARY_HEADER.strip() not in page
    cap = effective_policy("contract").summary_token_cap
    assert f"{brief.summary_tokens:,} / {cap:,} tokens" in page
    assert "(the summary, as shown under Memory)" in page  # the preview names it
    assert "What the model sees next" in page


def test_history_rows_are_marked_folded_or_verbatim(staff: Client, api: Any) -> None:
    chat = chat_with_summary(api)
    watermark = Brief.objects.get(chat=chat).last_consolidated
    page = change_page(staff, chat)
    assert f"<tr><td>{watermark}</td><td>folded</td>" in page
    assert f"<tr><td>{watermark + 1}</td><td>verbatim</td>" in page
    listing = staff.get(f"/admin/conversations/message/?chat__id__exact={chat.pk}")
    marks = {
        message.seq: listing.context["cl"].model_admin.memory(message)
        for message in listing.context["cl"].result_list
    }
    assert marks[watermark] == "folded" and marks[watermark + 1] == "verbatim"


def test_the_next_fold_line_says_when_and_why_from_the_engine(staff: Client, api: Any) -> None:
    chat_id = api.post("/api/v1/chats/", {"policy": "contract"}, format="json").json()["id"]
    for number in range(2):  # 4 messages: contract folds past 8 unfolded (K + B less headroom)
        api.post(f"/api/v1/chats/{chat_id}/turns/", {"content": f"fact {number}"}, format="json")
    chat = Chat.objects.get(pk=chat_id)
    page = change_page(staff, chat)
    assert "next fold: when more than 8 messages are unfolded (now 4); trigger overflow." in page
    for number in range(2, 5):  # 10 messages: the engine's decision is due
        api.post(f"/api/v1/chats/{chat_id}/turns/", {"content": f"fact {number}"}, format="json")
    chat.refresh_from_db()
    outlook = fold_outlook(chat)
    decision = decide_for_chat(chat, load_snapshot(chat.pk), timezone.now())
    assert decision is not None and outlook.due == decision
    page = change_page(staff, chat)
    assert (
        "due now: more than 8 messages are unfolded (now 10); trigger overflow; the fold takes "
        f"messages {decision.from_seq}..{decision.to_seq}." in page
    )


def test_a_failing_chat_says_it_is_paused_or_degraded(staff: Client, user: Any) -> None:
    chat = chat_service.create_chat(user)
    Brief.objects.filter(chat=chat).update(
        consecutive_failures=1,
        next_attempt_at=timezone.now() + timedelta(minutes=5),
        last_error="rate limited",
    )
    page = change_page(staff, chat)
    assert "paused: the last fold failed (rate limited); the next attempt is at" in page
    assert "folds keep failing" not in page
    Brief.objects.filter(chat=chat).update(consecutive_failures=5, degraded=True)
    page = change_page(staff, chat)
    assert "degraded: the last 5 folds failed (rate limited)" in page
    assert "⚠ degraded: folds keep failing" in page


def test_degraded_is_a_warning_only_when_true(staff: Client, user: Any) -> None:
    fine = chat_service.create_chat(user, title="fine-chat")
    failing = chat_service.create_chat(user, title="failing-chat")
    Brief.objects.filter(chat=failing).update(degraded=True)
    listing = staff.get("/admin/conversations/chat/").content.decode()
    assert "icon-no.svg" not in listing and "icon-yes.svg" not in listing
    assert listing.count("⚠ degraded") == 1
    assert "folds keep failing" not in change_page(staff, fine)
    assert "folds keep failing" in change_page(staff, failing)
    briefs = staff.get("/admin/conversations/brief/").content.decode()
    assert "icon-no.svg" not in briefs and briefs.count("⚠ degraded") == 1


def test_the_policy_is_a_choice_of_the_presets(staff: Client, user: Any) -> None:
    chat = chat_service.create_chat(user, policy="chunked")
    page = change_page(staff, chat)
    select = re.search(r'<select name="policy"[^>]*>(.*?)</select>', page, re.S)
    assert select is not None, "policy is not a select"
    offered = re.findall(r'<option value="([^"]+)"', select.group(1))
    assert offered == list(PRESETS)
    assert '<option value="chunked" selected>' in select.group(1)


def test_agent_state_is_shown_under_a_plain_title_only_when_there_is_some(
    staff: Client, user: Any
) -> None:
    chat = chat_service.create_chat(user)
    assert "tracking" not in change_page(staff, chat).lower()
    state = AgentState.objects.create(chat=chat)  # a row of empty lists
    assert "tracking" not in change_page(staff, chat).lower()
    state.active_entities = [{"id": "e1", "name": "the Lisbon trip"}]
    state.save()
    page = change_page(staff, chat)
    assert "What the assistant is tracking" in page and "the Lisbon trip" in page
    assert "seed 004" not in page
    assert "Recent step results" not in page  # empty: left out, not shown as []


def test_the_message_list_shows_content_truncated(staff: Client, user: Any) -> None:
    chat = chat_service.create_chat(user)
    long = "The itinerary starts in Lisbon " + "and goes on " * 30
    Message.objects.create(chat=chat, seq=1, role="user", content=long, token_count=90)
    Chat.objects.filter(pk=chat.pk).update(last_seq=1)
    listing = staff.get("/admin/conversations/message/").content.decode()
    assert "The itinerary starts in Lisbon" in listing
    assert long not in listing and "…" in listing


def test_list_and_detail_pages_use_one_timestamp_format(staff: Client, user: Any) -> None:
    chat = chat_with_messages(user, 2)
    Brief.objects.filter(chat=chat).update(last_consolidated_at=timezone.now())
    pages = [
        staff.get("/admin/conversations/chat/").content.decode(),
        staff.get("/admin/conversations/message/").content.decode(),
        change_page(staff, chat),
    ]
    for page in pages:
        assert TIMESTAMP.search(page), page[:500]
        assert "a.m." not in page and "p.m." not in page and "midnight" not in page
