"""The daily tier (a flush hook filling one note per chat and day) and its RunningSummary view on
the brief."""

from __future__ import annotations

from datetime import date
from typing import Any

import pytest

from conversations.models import Brief, DailyNote, Message
from memory_worker import daily_notes
from tests.support.fake_openai import FakeOpenAI

FACT = "The staging database password rotates every 30 days."


def new_chat(api: Any, **body: Any) -> int:
    response = api.post("/api/v1/chats/", body, format="json")
    assert response.status_code == 201, response.content
    return int(response.json()["id"])


def say(api: Any, chat_id: int, *contents: str) -> None:
    for content in contents:
        response = api.post(f"/api/v1/chats/{chat_id}/turns/", {"content": content}, format="json")
        assert response.status_code == 201, response.content


def message(seq: int, content: str, role: str = "user") -> Message:
    return Message(seq=seq, role=role, content=content, token_count=1)


def test_offline_extraction_keeps_durable_sentences_only() -> None:
    messages = [
        message(1, f"Hi there! {FACT} Can you remind me next week?"),
        message(2, "Sounds good. We decided to ship on Friday.", role="assistant"),
        message(3, "Thanks a lot."),
    ]
    texts = [fact.text for fact in daily_notes.extract_offline(messages)]
    assert texts == [FACT, "We decided to ship on Friday."]


def test_tool_output_and_the_offline_models_echo_are_not_facts() -> None:
    """Every line of a tool result carries an id or a count, and every offline reply a message
    count: they passed for facts and filled the note."""
    messages = [
        message(1, FACT),
        message(2, '{"id": 123, "rows": 42}. Found 3 orders in 2 warehouses.', role="tool"),
        message(3, "[offline model] You said: hi. (Context: 12 messages.)", role="assistant"),
    ]
    assert [fact.text for fact in daily_notes.extract_offline(messages)] == [FACT]


@pytest.mark.django_db
def test_a_full_note_says_what_it_dropped(api: Any, caplog: Any) -> None:
    chat_id = new_chat(api)
    day = date(2026, 11, 24)
    facts = [
        daily_notes.Fact(n, "user", f"Server {n} runs on port {8000 + n}.")
        for n in range(daily_notes.MAX_FACTS_PER_NOTE + 5)
    ]
    with caplog.at_level("WARNING", logger="chatmem.daily_notes"):
        added = daily_notes.merge_into_note(chat_id, day, [1, 9], facts, "offline")
    assert added == daily_notes.MAX_FACTS_PER_NOTE
    full = [r for r in caplog.records if getattr(r, "event", "") == "daily_note_full"]
    assert len(full) == 1 and full[0].facts_dropped == 5


@pytest.mark.django_db
def test_a_fold_range_is_merged_once_and_facts_deduplicated(api: Any) -> None:
    chat_id = new_chat(api)
    day = date(2026, 11, 23)
    first = [daily_notes.Fact(1, "user", FACT)]
    assert daily_notes.merge_into_note(chat_id, day, [1, 4], first, "offline") == 1
    # The same fold's hook delivered twice (late ack, redelivery): nothing added.
    assert daily_notes.merge_into_note(chat_id, day, [1, 4], first, "offline") == 0
    # A later fold repeating the fact in other words of the same content: deduplicated.
    again = [daily_notes.Fact(6, "user", FACT.upper()), daily_notes.Fact(7, "user", "Port 8443.")]
    assert daily_notes.merge_into_note(chat_id, day, [5, 8], again, "offline") == 1
    note = DailyNote.objects.get(chat_id=chat_id, day=day)
    assert [fact["text"] for fact in note.facts] == [FACT, "Port 8443."]
    assert note.ranges == [[1, 4], [5, 8]]


def test_a_fold_fills_the_days_note_after_commit(api, settings, transactional_db) -> None:  # type: ignore[no-untyped-def]
    from memory_worker.coordination.dispatch import drain_inline

    assert daily_notes.HOOK_PATH in settings.MEMORY_FLUSH_HOOKS  # on by default
    settings.MEMORY_DISPATCH = "inline"
    chat_id = new_chat(api, policy="contract")
    say(api, chat_id, FACT, *(f"Small talk number {n}, nothing more." for n in range(12)))
    drain_inline()
    folded_to = Brief.objects.get(chat_id=chat_id).last_consolidated
    assert folded_to >= 12  # synchronous and background folds both ran
    notes = api.get(f"/api/v1/chats/{chat_id}/notes/").json()["results"]
    assert len(notes) == 1
    covered = sorted(seq for start, end in notes[0]["ranges"] for seq in range(start, end + 1))
    assert covered == list(range(1, folded_to + 1))  # every fold's hook ran, each once
    assert FACT in [fact["text"] for fact in notes[0]["facts"]]
    assert notes[0]["day"] == str(Message.objects.get(chat_id=chat_id, seq=1).created_at.date())
    # The brief's RunningSummary view names what the summary covers.
    running = api.get(f"/api/v1/chats/{chat_id}/brief/").json()["running_summary"]
    last = Message.objects.get(chat_id=chat_id, seq=folded_to)
    assert running["summarized_message_ids"] == {"from_seq": 1, "to_seq": folded_to}
    assert running["last_summarized_message_id"] == last.pk
    assert running["summary"] and FACT.split()[1] in running["summary"]


@pytest.mark.django_db
def test_notes_of_another_users_chat_are_a_404(api: Any, other_api: Any) -> None:
    chat_id = new_chat(api)
    assert other_api.get(f"/api/v1/chats/{chat_id}/notes/").status_code == 404
    brief = api.get(f"/api/v1/chats/{chat_id}/brief/").json()
    assert brief["running_summary"]["summarized_message_ids"] is None


@pytest.mark.django_db
def test_model_extractor_stores_the_models_lines(api: Any, settings: Any) -> None:
    reply = "- The billing export runs on port 8443.\n- None"
    with FakeOpenAI(reply_fn=lambda body: reply) as server:
        settings.OPENAI_BASE_URL = server.base_url
        settings.OPENAI_API_KEY = "test-key"
        settings.MEMORY_DAILY_NOTES_BACKEND = "chat"
        chat_id = new_chat(api)
        say(api, chat_id, "Where does the export run?")
        messages = list(Message.objects.filter(chat_id=chat_id).order_by("seq"))
        daily_notes.extract_daily_notes(chat_id, messages, version=1)
        sent = [record for record in server.requests if "durable facts" in record.text]
    assert len(sent) == 1 and "Where does the export run?" in sent[0].text
    note = DailyNote.objects.get(chat_id=chat_id)
    assert [fact["text"] for fact in note.facts] == ["The billing export runs on port 8443."]
    assert note.extractor == "chat"


def test_an_unknown_extractor_is_a_startup_error(settings: Any) -> None:
    from memory_worker.checks import check_daily_notes_backend

    assert check_daily_notes_backend() == []
    settings.MEMORY_DAILY_NOTES_BACKEND = "gpt"
    assert [error.id for error in check_daily_notes_backend()] == ["chatmem.E004"]


@pytest.mark.django_db
def test_a_failing_hook_is_retried_and_the_range_lands_once(api: Any, monkeypatch: Any) -> None:
    """A hook task that fails once (a 429 from the extraction model) is retried, not
    acknowledged and gone: its fold range reaches the note, once."""
    from memory_worker import tasks

    chat_id = new_chat(api)
    say(api, chat_id, FACT)
    calls: list[int] = []
    real = daily_notes.extract_facts

    def flaky(messages: Any, extractor: str) -> Any:
        calls.append(1)
        if len(calls) < 3:
            raise TimeoutError("the extraction model timed out")
        return real(messages, extractor)

    monkeypatch.setattr(daily_notes, "extract_facts", flaky)
    # apply(): this one call runs here, its retries too (no global eager mode).
    result = tasks.run_flush_hook.apply(args=(daily_notes.HOOK_PATH, chat_id, 1, 2, 1))
    assert result.successful(), result.traceback
    assert len(calls) == 3
    note = DailyNote.objects.get(chat_id=chat_id)
    assert FACT in [fact["text"] for fact in note.facts] and note.ranges == [[1, 2]]


@pytest.mark.django_db
def test_a_hook_the_broker_refused_is_replayed_by_the_sweep_once(
    api: Any, settings: Any, monkeypatch: Any
) -> None:
    """A fold committed while the broker refused the hook's publish: the hook was logged and
    lost, and that range never reached the daily note. The sweep now finds committed folds
    whose range no note records (the ledger and DailyNote.ranges) and queues the hook again."""
    from datetime import timedelta

    from django.core.cache import cache
    from django.utils import timezone

    from conversations.models import Consolidation, ConsolidationStatus
    from memory_worker import hooks
    from memory_worker.signals import messages_folded

    cache.delete(hooks.REPLAY_CURSOR_KEY)
    settings.MEMORY_DISPATCH = "celery"
    chat_id = new_chat(api)
    say(api, chat_id, FACT, "The deploy window opens at 02:00 UTC.")
    broker = {"down": True}
    queued: list[tuple[Any, ...]] = []

    def publish(args: tuple[Any, ...], **options: Any) -> None:
        if broker["down"]:
            raise ConnectionError("broker unreachable")
        queued.append(args)

    monkeypatch.setattr(hooks.RUN_FLUSH_HOOK, "apply_async", publish)
    now = timezone.now()
    for version, (first, last) in enumerate([(1, 2), (3, 4)]):
        Consolidation.objects.create(
            chat_id=chat_id,
            trigger="turn",
            status=ConsolidationStatus.SUCCEEDED,
            from_seq=first,
            to_seq=last,
            base_version=version,
            finished_at=now,
        )
        messages_folded.send(
            sender=Brief, chat_id=chat_id, from_seq=first, to_seq=last, version=version + 1
        )
        broker["down"] = False  # back for the second fold, whose hook runs
    assert queued == [(daily_notes.HOOK_PATH, chat_id, 3, 4, 2)]
    hooks.run_hook(*queued.pop())
    assert DailyNote.objects.get(chat_id=chat_id).ranges == [[3, 4]]

    # Not before the hook task's own retries are over: it may still be on its way.
    assert hooks.replay_missed_daily_notes(now) == 0 and queued == []
    later = now + timedelta(minutes=21)
    assert hooks.replay_missed_daily_notes(later) == 1
    assert queued == [(daily_notes.HOOK_PATH, chat_id, 1, 2, 1)]
    hooks.run_hook(*queued.pop())
    note = DailyNote.objects.get(chat_id=chat_id)
    assert sorted(note.ranges) == [[1, 2], [3, 4]]
    assert FACT in [fact["text"] for fact in note.facts]
    # Each ledger row is looked at once: later sweeps queue nothing more.
    assert hooks.replay_missed_daily_notes(later + timedelta(minutes=5)) == 0
    assert queued == []


@pytest.mark.django_db
@pytest.mark.parametrize(
    ("zone", "day"), [("UTC", date(2026, 11, 25)), ("America/Los_Angeles", date(2026, 11, 24))]
)
def test_a_note_is_filed_under_the_operators_days(
    api: Any, settings: Any, zone: str, day: date
) -> None:
    """A note's day is the operator's TIME_ZONE, not UTC: a user eight hours west has their
    evening filed under that evening's note, not the next day's."""
    from datetime import UTC, datetime

    settings.TIME_ZONE = zone
    chat_id = new_chat(api)
    evening = message(1, FACT)
    evening.created_at = datetime(2026, 11, 25, 3, 0, tzinfo=UTC)  # 19:00 the day before in LA
    daily_notes.extract_daily_notes(chat_id, [evening], version=1)
    assert list(DailyNote.objects.filter(chat_id=chat_id).values_list("day", flat=True)) == [day]


def test_the_zone_is_the_operators_setting() -> None:
    import os
    import subprocess
    import sys

    script = (
        "import django; django.setup(); from django.conf import settings; print(settings.TIME_ZONE)"
    )
    environment = {
        **os.environ,
        "DJANGO_SETTINGS_MODULE": "chatmem_project.settings",
        "TIME_ZONE": "America/Los_Angeles",
    }
    shown = subprocess.run(
        [sys.executable, "-c", script], env=environment, capture_output=True, text=True, check=True
    )
    assert shown.stdout.strip() == "America/Los_Angeles"
