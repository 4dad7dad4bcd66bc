"""Folds, called directly as a worker would (Zulip-style consume tests): a sliding-window fold,
fencing, failures, the post-commit enqueue, the brief and ledger rows a fold writes (the
summarizer calls included), what the summarizer reads of the folded messages, and a task's
reruns (memory_worker.folding.execute, fold_commit, runs)."""

import itertools
import threading
import time
from datetime import datetime, timedelta
from types import SimpleNamespace
from typing import Any, cast

import pytest
from django.utils import timezone

from conversations.models import Brief, Chat, Consolidation, Message
from memory_worker.coordination.dispatch import RequestReason
from memory_worker.coordination.lease import Lease
from memory_worker.coordination.locks import LocalChatLock
from memory_worker.folding import commit as fold_commit
from memory_worker.folding import execute as folds
from memory_worker.folding.snapshot import load_snapshot
from memory_worker.scheduling import runs
from memory_worker.summaries.chat_completions import ChatCompletionsSummarizer
from tests.conftest import contract_chat_after_turns, require
from tests.support.fake_openai import read_fold_input, transcript
from tests.test_summarizers import FORGING_CONTENTS

pytestmark = pytest.mark.django_db


def new_chat(api, **body):  # type: ignore[no-untyped-def]
    response = api.post("/api/v1/chats/", body, format="json")
    assert response.status_code == 201, response.content
    return response.json()["id"]


def turns(api, chat_id, count, start=0):  # type: ignore[no-untyped-def]
    for number in range(start, start + count):
        response = api.post(
            f"/api/v1/chats/{chat_id}/turns/",
            {"content": f"I decided to use tool {number}."},
            format="json",
        )
        assert response.status_code == 201, response.content


def recorder(requested: list[tuple[int, str]]):  # type: ignore[no-untyped-def]
    def request_fold(chat_id: int, trigger: str, due_at: object = None) -> bool:
        requested.append((chat_id, trigger))
        if trigger == "turn":  # a turn says when it found the fold due (consolidation lag)
            assert isinstance(due_at, datetime), due_at
        return True

    return request_fold


def test_sliding_window_folds_twelve_beyond_the_tail(api) -> None:  # type: ignore[no-untyped-def]
    chat_id = new_chat(api)  # sliding-window defaults: tail 40, window 12
    turns(api, chat_id, 25)  # 50 messages: backlog 10, nothing due
    assert folds.fold_once(chat_id, RequestReason.TURN).status == "nothing"
    turns(api, chat_id, 1, start=25)  # 52 messages: backlog 12
    outcome = folds.fold_once(chat_id, RequestReason.TURN)
    assert outcome.status == "succeeded"
    assert outcome.decision is not None
    assert (outcome.decision.trigger, outcome.decision.from_seq, outcome.decision.to_seq) == (
        "window",
        1,
        12,
    )
    brief = Brief.objects.get(chat_id=chat_id)
    assert (brief.last_consolidated, brief.version) == (12, 1)
    assert brief.summary and brief.summary_tokens > 0
    context = api.get(f"/api/v1/chats/{chat_id}/context/").json()["messages"]
    assert context[1]["role"] == "system" and brief.summary in context[1]["content"]
    verbatim = context[2:]
    assert len(verbatim) == 40
    assert verbatim[0]["content"] == Message.objects.get(chat_id=chat_id, seq=13).content
    ledger = api.get(f"/api/v1/chats/{chat_id}/consolidations/").json()["results"]
    assert [(r["status"], r["from_seq"], r["to_seq"], r["trigger"]) for r in ledger] == [
        ("succeeded", 1, 12, "window")
    ]
    api_brief = api.get(f"/api/v1/chats/{chat_id}/brief/").json()
    assert (api_brief["last_consolidated"], api_brief["unfolded"], api_brief["pending"]) == (
        12,
        40,
        False,
    )


def chat_with_a_fold_due(api):  # type: ignore[no-untyped-def]
    """A sliding-window chat whose first fold is due: the chat, its snapshot, the decision."""
    chat_id = new_chat(api)
    turns(api, chat_id, 26)
    chat = Chat.objects.get(pk=chat_id)
    snapshot = load_snapshot(chat_id)
    decision = folds.decide_for_chat(chat, snapshot, timezone.now())
    assert decision is not None
    return chat, snapshot, decision


def test_stale_fold_is_superseded_and_writes_nothing(api) -> None:  # type: ignore[no-untyped-def]
    chat, stale, decision = chat_with_a_fold_due(api)
    chat_id = chat.pk
    first = folds.execute_fold(chat, stale, decision, now=timezone.now())
    assert first.status == "succeeded"
    before = Brief.objects.get(chat_id=chat_id)
    second = folds.execute_fold(chat, stale, decision, now=timezone.now())
    assert second.status == "superseded"
    after = Brief.objects.get(chat_id=chat_id)
    assert (after.summary, after.last_consolidated, after.version) == (
        before.summary,
        before.last_consolidated,
        before.version,
    )
    statuses = list(
        Consolidation.objects.filter(chat_id=chat_id)
        .order_by("id")
        .values_list("status", flat=True)
    )
    assert statuses == ["succeeded", "superseded"]


def test_summarizer_failure_writes_nothing_and_backs_off(api, use_fake_openai) -> None:  # type: ignore[no-untyped-def]
    chat_id = new_chat(api)
    turns(api, chat_id, 26)
    use_fake_openai.queue_faults("summarize", ["500"])
    outcome = folds.fold_once(chat_id, RequestReason.TURN)
    assert outcome.status == "failed" and outcome.transient
    brief = Brief.objects.get(chat_id=chat_id)
    assert (brief.summary, brief.last_consolidated, brief.version) == ("", 0, 0)
    assert brief.consecutive_failures == 1
    assert brief.next_attempt_at is not None and brief.next_attempt_at > timezone.now()
    assert "500" in brief.last_error or "server" in brief.last_error.lower()
    # While backing off, turn triggers do not hammer the model; a manual request does run.
    assert folds.fold_once(chat_id, RequestReason.TURN).status == "deferred"
    assert folds.fold_once(chat_id, RequestReason.MANUAL).status == "succeeded"
    brief.refresh_from_db()
    assert (brief.consecutive_failures, brief.next_attempt_at, brief.last_error) == (0, None, "")


def test_invalid_summaries_are_failures(api, use_fake_openai) -> None:  # type: ignore[no-untyped-def]
    chat_id = new_chat(api)
    turns(api, chat_id, 26)
    for fault in ("empty", "truncated", "refusal"):
        use_fake_openai.queue_faults("summarize", [fault])
        outcome = folds.fold_once(chat_id, RequestReason.MANUAL)
        assert outcome.status == "failed", fault
        assert not outcome.transient, fault
    assert Brief.objects.get(chat_id=chat_id).last_consolidated == 0


def test_turn_enqueues_only_when_a_fold_is_due(
    api, settings, monkeypatch, django_capture_on_commit_callbacks
) -> None:  # type: ignore[no-untyped-def]
    requested: list[tuple[int, str]] = []
    monkeypatch.setattr("conversations.services.turn_store.request_fold", recorder(requested))
    chat_id = new_chat(api)
    for number in range(26):
        with django_capture_on_commit_callbacks(execute=True):
            turns(api, chat_id, 1, start=number)
        expected = [(chat_id, "turn")] if number == 25 else []
        assert requested == expected, number


def test_manual_consolidate_endpoint_queues(api, settings, monkeypatch) -> None:  # type: ignore[no-untyped-def]
    requested: list[tuple[int, str]] = []
    monkeypatch.setattr("memory_worker.scheduling.manual.request_fold", recorder(requested))
    chat_id = contract_chat_after_turns(api, 4)  # a manual fold would fold 2
    response = api.post(f"/api/v1/chats/{chat_id}/consolidate/")
    assert response.status_code == 202
    assert response.json()["status"] == "queued"
    assert requested == [(chat_id, "manual")]


def test_inline_mode_folds_in_the_background(api, settings, transactional_db) -> None:  # type: ignore[no-untyped-def]
    """The embedded default: after a turn makes a fold due, the in-process runner folds it."""
    from memory_worker.coordination.dispatch import drain_inline
    from tests.support.workers import wait_until

    settings.MEMORY_DISPATCH = "inline"
    chat_id = new_chat(api, policy="contract")
    turns(api, chat_id, 6)  # 12 unfolded: an overflow fold due, no turn over the bound yet
    assert wait_until(lambda: Brief.objects.get(chat_id=chat_id).last_consolidated > 0, timeout=20)
    drain_inline()  # the rerun it chained must finish before the test database is flushed
    # Folded by the runner, not on a turn's request path (a 7th turn would have folded itself).
    ledger = Consolidation.objects.filter(chat_id=chat_id)
    assert list(ledger.values_list("status", "synchronous")) == [("succeeded", False)]


def test_turn_folds_synchronously_when_background_fell_behind(api, use_fake_openai) -> None:  # type: ignore[no-untyped-def]
    chat_id = new_chat(api, policy="contract")  # K + B = 10 history messages at most
    turns(api, chat_id, 5)  # 10 unfolded; no worker ran
    assert Brief.objects.get(chat_id=chat_id).last_consolidated == 0
    turns(api, chat_id, 1, start=5)  # still 10 + the new one: within the bound
    # 12 unfolded now: the next turn must fold first, on the request path.
    before = len(use_fake_openai.summarize_requests())
    response = api.post(
        f"/api/v1/chats/{chat_id}/turns/", {"content": "after the backlog"}, format="json"
    )
    assert response.status_code == 201
    assert len(use_fake_openai.summarize_requests()) == before + 1
    sync = Consolidation.objects.get(chat_id=chat_id, synchronous=True)
    assert (sync.trigger, sync.status, sync.from_seq) == ("hard_bound", "succeeded", 1)
    sent = use_fake_openai.chat_requests()[-1].body["messages"]
    assert len([m for m in sent if m["role"] != "system"]) <= 10 + 1
    assert "Summary of the earlier conversation" in sent[1]["content"]


def test_failed_synchronous_fold_whose_fallback_fails_too_is_503_and_stores_nothing(  # type: ignore[no-untyped-def]
    api, use_fake_openai, monkeypatch
) -> None:
    """The offline fallback (tests/test_turn_fold.py) failing as well: the fallback here is
    the failing model summarizer again."""
    from memory_worker.scheduling import before_turn as turn_fold
    from memory_worker.summaries.backends import get_summarizer

    monkeypatch.setattr(turn_fold, "offline_summarizer", get_summarizer)
    chat_id = new_chat(api, policy="contract")
    turns(api, chat_id, 6)
    use_fake_openai.queue_faults("summarize", ["500", "500"])
    chat_calls = len(use_fake_openai.chat_requests())
    response = api.post(f"/api/v1/chats/{chat_id}/turns/", {"content": "x"}, format="json")
    assert response.status_code == 503, response.content
    assert response.json()["code"] == "context_over_bound"
    assert "nothing was stored" in response.json()["detail"]
    assert "x-should-retry" not in response  # this one may go through later
    assert len(use_fake_openai.chat_requests()) == chat_calls  # the model was never called
    assert Message.objects.filter(chat_id=chat_id).count() == 12
    assert Chat.objects.get(pk=chat_id).turn_token is None
    # Once the summarizer works again the same request goes through.
    retry = api.post(f"/api/v1/chats/{chat_id}/turns/", {"content": "x"}, format="json")
    assert retry.status_code == 201


def test_message_too_large_for_any_context_is_503_not_to_retry(api, settings) -> None:  # type: ignore[no-untyped-def]
    """x-should-retry: false, or the OpenAI SDKs resend what can never fit (twice, by default)."""
    from conversations.variants import _parse_variants

    chat_id = new_chat(api)  # before the window shrinks: no chat is created with no room in it
    settings.CHAT_MODEL_CONTEXT_TOKENS = 300
    _parse_variants.cache_clear()
    response = api.post(
        f"/api/v1/chats/{chat_id}/turns/", {"content": "word " * 400}, format="json"
    )
    assert response.status_code == 503
    assert "does not fit" in response.json()["detail"]
    assert response["x-should-retry"] == "false"
    assert Message.objects.filter(chat_id=chat_id).count() == 0
    _parse_variants.cache_clear()


def test_large_fold_is_summarized_in_chunks(api, use_fake_openai, settings) -> None:  # type: ignore[no-untyped-def]
    settings.MEMORY_SUMMARIZER_INPUT_BUDGET = 120  # a few turns per summarizer call
    chat_id = new_chat(api)
    turns(api, chat_id, 26)
    outcome = folds.fold_once(chat_id, RequestReason.TURN)
    assert outcome.status == "succeeded"
    assert outcome.decision is not None and outcome.decision.to_seq == 12  # the whole range
    requests = use_fake_openai.summarize_requests()
    assert len(requests) > 1
    # The first chunk starts from no summary; every later one from the previous chunk's output.
    existing = [read_fold_input(r.text)[0] for r in requests]
    assert existing[0] == ""  # NONE
    assert all(section.startswith("## ") for section in existing[1:]), existing
    folded = "\n".join(r.text for r in requests)
    for message in Message.objects.filter(chat_id=chat_id, seq__lte=12):
        assert message.content in folded
    # Each chunk is a fold of its own: a ledger row, a summary version, consecutive ranges.
    ledger = list(Consolidation.objects.filter(chat_id=chat_id).order_by("id"))
    assert len(ledger) == len(requests)
    assert [row.status for row in ledger] == ["succeeded"] * len(ledger)
    assert [row.summarizer_calls for row in ledger] == [1] * len(ledger)
    assert [row.base_version for row in ledger] == list(range(len(ledger)))
    assert ledger[0].from_seq == 1 and ledger[-1].to_seq == 12
    assert all(a.to_seq + 1 == b.from_seq for a, b in itertools.pairwise(ledger))
    assert ledger[-1].pk == outcome.ledger_id
    brief = Brief.objects.get(chat_id=chat_id)
    assert (brief.last_consolidated, brief.version) == (12, len(ledger))


def test_a_later_chunk_failing_keeps_the_chunks_before_it(api, use_fake_openai, settings) -> None:  # type: ignore[no-untyped-def]
    """When all chunks committed together, a failure (or the task's time limit) in the last one
    threw away the others, and every retry summarized the whole backlog again."""
    settings.MEMORY_SUMMARIZER_INPUT_BUDGET = 120
    chat_id = new_chat(api)
    turns(api, chat_id, 26)
    use_fake_openai.queue_faults("summarize", ["ok", "500"])
    outcome = folds.fold_once(chat_id, RequestReason.TURN)
    assert (outcome.status, outcome.kind) == ("failed", "server_error")
    first, second = Consolidation.objects.filter(chat_id=chat_id).order_by("id")
    assert (first.status, second.status) == ("succeeded", "failed")
    brief = Brief.objects.get(chat_id=chat_id)
    assert (brief.last_consolidated, brief.version) == (first.to_seq, 1)
    assert 0 < first.to_seq < 12 and second.from_seq == first.to_seq + 1
    assert brief.consecutive_failures == 1 and brief.next_attempt_at is not None
    # The policy decides again from the new watermark: the 2 messages left are under the
    # window, so the retry finds nothing due and ends the failure state...
    retry_at = brief.next_attempt_at + timedelta(seconds=1)
    assert folds.fold_once(chat_id, RequestReason.RETRY, now=retry_at).status == "nothing"
    assert Brief.objects.get(chat_id=chat_id).consecutive_failures == 0
    # ...and a fold starts where the committed chunk ended.
    manual = folds.fold_once(chat_id, RequestReason.MANUAL)
    assert manual.status == "succeeded"
    assert manual.decision is not None and manual.decision.from_seq == first.to_seq + 1
    assert Brief.objects.get(chat_id=chat_id).last_consolidated == 12


def test_chunks_stop_at_the_deadline_and_say_more_is_due(api, use_fake_openai, settings) -> None:  # type: ignore[no-untyped-def]
    settings.MEMORY_SUMMARIZER_INPUT_BUDGET = 120
    settings.MEMORY_LLM_TIMEOUT_SECONDS = 30
    chat, snapshot, decision = chat_with_a_fold_due(api)
    # Time for the first chunk only: each later one could take up to the 30 s LLM timeout.
    deadline = time.monotonic() + 20
    outcome = folds.execute_fold(chat, snapshot, decision, now=timezone.now(), deadline=deadline)
    assert (outcome.status, outcome.more_due, outcome.decision) == ("succeeded", True, decision)
    assert len(use_fake_openai.summarize_requests()) == 1
    (only,) = Consolidation.objects.filter(chat_id=chat.pk)
    assert Brief.objects.get(chat_id=chat.pk).last_consolidated == only.to_seq < decision.to_seq


def test_a_fold_whose_lock_was_lost_starts_no_further_summarizer_call(  # type: ignore[no-untyped-def]
    api, use_fake_openai, settings, monkeypatch
):
    """Its lock lapsed (a paused worker) and another run may hold the chat: the chunk in hand
    commits fenced, and no further summarizer call starts; the rest is handed on."""
    settings.MEMORY_SUMMARIZER_INPUT_BUDGET = 120
    chat, snapshot, decision = chat_with_a_fold_due(api)
    lock = LocalChatLock(ttl_seconds=30)
    assert lock.acquire_or_mark_pending(chat.pk, "this-run")
    lease = Lease(lock, chat.pk, "this-run", until=time.monotonic() + 60)  # renewed per chunk
    commit = folds.commit_fold

    def commit_then_lose_the_lock(*args, **kwargs):  # type: ignore[no-untyped-def]
        committed = commit(*args, **kwargs)
        assert lock.release(chat.pk, "this-run") and lock.try_acquire(chat.pk, "another-run")
        return committed

    monkeypatch.setattr(folds, "commit_fold", commit_then_lose_the_lock)
    outcome = folds.execute_fold(chat, snapshot, decision, now=timezone.now(), lease=lease)
    assert (outcome.status, outcome.more_due, outcome.cut_short) == ("succeeded", True, True)
    assert len(use_fake_openai.summarize_requests()) == 1 and lease.lost
    assert Consolidation.objects.filter(chat_id=chat.pk).count() == 1


FLUSHED: list[tuple[int, list[int], int]] = []


def record_flush(chat_id: int, messages: list[Message], version: int) -> None:
    FLUSHED.append((chat_id, [m.seq for m in messages], version))


def test_flush_hooks_run_after_a_committed_fold(api, settings, transactional_db) -> None:  # type: ignore[no-untyped-def]
    from memory_worker.coordination.dispatch import drain_inline
    from memory_worker.signals import messages_folded

    FLUSHED.clear()
    signalled: list[dict[str, object]] = []

    def on_fold(sender, **kwargs):  # type: ignore[no-untyped-def]
        signalled.append(kwargs)

    messages_folded.connect(on_fold)
    try:
        chat_id = new_chat(api)
        turns(api, chat_id, 26)
        settings.MEMORY_FLUSH_HOOKS = ["tests.test_folds.record_flush"]
        settings.MEMORY_DISPATCH = "inline"
        stale = load_snapshot(chat_id)
        assert folds.fold_once(chat_id, RequestReason.MANUAL).status == "succeeded"
        drain_inline()
    finally:
        messages_folded.disconnect(on_fold)
    assert [(s["chat_id"], s["from_seq"], s["to_seq"], s["version"]) for s in signalled] == [
        (chat_id, 1, 12, 1)
    ]
    assert [(chat_id, list(range(1, 13)), 1)] == FLUSHED
    # A superseded (stale) fold sends nothing.
    chat = Chat.objects.get(pk=chat_id)
    decision = folds.decide_for_chat(chat, stale, timezone.now(), manual=True)
    assert decision is not None
    assert folds.execute_fold(chat, stale, decision, now=timezone.now()).status == "superseded"
    drain_inline()
    assert len(FLUSHED) == 1


def committed_rows(chat_id: int) -> tuple[dict[str, object], list[dict[str, object]]]:
    """The brief and the ledger rows a fold wrote, without ids and wall-clock times."""
    clock = {
        "updated_at",
        "last_consolidated_at",
        "started_at",
        "heartbeat_at",
        "finished_at",
        "duration_ms",
    }
    brief = {
        k: v
        for k, v in Brief.objects.filter(chat_id=chat_id).values().get().items()
        if k not in clock | {"chat_id"}
    }
    ledger = [
        {k: v for k, v in row.items() if k not in clock | {"id", "chat_id", "worker"}}
        for row in Consolidation.objects.filter(chat_id=chat_id).order_by("id").values()
    ]
    return brief, ledger


def fold_twice_with(api, write, monkeypatch):  # type: ignore[no-untyped-def]
    """A new chat's first fold committed through ``write``, then the same fold again (stale)."""
    monkeypatch.setattr(fold_commit, "commit_in_one_statement", write)
    monkeypatch.setattr(fold_commit, "commit_in_transaction", write)
    chat, stale, decision = chat_with_a_fold_due(api)
    first = folds.execute_fold(chat, stale, decision, now=timezone.now())
    second = folds.execute_fold(chat, stale, decision, now=timezone.now())
    assert (first.status, second.status) == ("succeeded", "superseded")
    return committed_rows(chat.pk)


def test_both_commit_paths_write_the_same(api, monkeypatch) -> None:  # type: ignore[no-untyped-def]
    """PostgreSQL commits a fold in one statement, other databases in a transaction: on the same
    conversation they write the same brief and ledger rows, for a fold that wins and a stale one."""
    from django.db import connection

    if connection.vendor != "postgresql":
        require("PostgreSQL", "one statement is PostgreSQL's")
    one_statement = fold_commit.commit_in_one_statement
    in_transaction = fold_commit.commit_in_transaction
    brief, ledger = fold_twice_with(api, one_statement, monkeypatch)
    assert (brief["last_consolidated"], brief["version"], brief["turns_mark"]) == (12, 1, 52)
    assert [(r["status"], r["summary_tokens_after"]) for r in ledger] == [
        ("succeeded", brief["summary_tokens"]),
        ("superseded", 0),
    ]
    assert fold_twice_with(api, in_transaction, monkeypatch) == (brief, ledger)


LONG = "## Facts / Constraints\n" + "\n".join(f"- fact number {n} is here" for n in range(20))
SHORT = "## Facts / Constraints\n- fact\n## Goals / Preferences\n- None\n## Decisions\n- None"


def test_the_ledger_counts_the_stricter_retry_of_an_over_cap_summary(api, monkeypatch) -> None:  # type: ignore[no-untyped-def]
    """A fold whose first summary is over the cap makes a second, stricter call, and both are
    paid for: the ledger row counts two summarizer calls and both calls' tokens."""
    chat_id = contract_chat_after_turns(api, 6)
    replies = iter([(LONG, 100, 90), (SHORT, 200, 10)])

    def create_chat_completion(client, body, timeout):  # type: ignore[no-untyped-def]
        text, prompt, completion = next(replies)
        message = SimpleNamespace(content=text, refusal=None)
        return SimpleNamespace(
            choices=[SimpleNamespace(message=message, finish_reason="stop")],
            usage=SimpleNamespace(prompt_tokens=prompt, completion_tokens=completion),
        )

    monkeypatch.setattr(
        "memory_worker.summaries.chat_completions.create_chat_completion", create_chat_completion
    )
    summarizer = ChatCompletionsSummarizer(cast(Any, None), "gpt-test", cap_tokens=40)
    monkeypatch.setattr(folds, "get_summarizer", lambda cap=None: summarizer)
    outcome = folds.fold_once(chat_id, RequestReason.MANUAL)
    assert outcome.status == "succeeded" and outcome.ledger_id is not None, outcome
    row = Consolidation.objects.get(pk=outcome.ledger_id)
    assert (row.summarizer_calls, row.input_tokens, row.output_tokens) == (2, 300, 100)
    assert Brief.objects.get(chat_id=chat_id).summary == SHORT


# --- A task's reruns: judged on the state the fold committed, a fresh read only when needed ---


def task_run(chat_id: int, lock: object) -> tuple[list[str], list[str]]:
    """One consolidation task's outcomes, and the first word of each SQL statement it sent."""
    from django.db import connection
    from django.test.utils import CaptureQueriesContext

    with CaptureQueriesContext(connection) as captured:
        outcomes = runs.fold_with_lock(chat_id, RequestReason.TURN, lock)  # type: ignore[arg-type]
    return [o.status for o in outcomes], [q["sql"].split()[0] for q in captured.captured_queries]


def test_a_task_whose_fold_leaves_nothing_due_reads_once_and_releases(api) -> None:  # type: ignore[no-untyped-def]
    from django.db import connection

    from memory_worker.coordination.locks import LocalChatLock

    chat_id = new_chat(api)
    turns(api, chat_id, 26)  # 52 messages: one window of 12 beyond the tail
    lock = LocalChatLock(ttl_seconds=60)
    statuses, statements = task_run(chat_id, lock)
    assert statuses == ["succeeded"]
    if connection.vendor == "postgresql":  # no second snapshot read after the fold
        # The snapshot, the database's clock, the ledger row, the commit.
        assert statements == ["SELECT", "SELECT", "INSERT", "WITH"], statements
    assert not lock.is_pending(chat_id)
    assert lock.acquire_or_mark_pending(chat_id, "next")  # released
    assert Brief.objects.get(chat_id=chat_id).last_consolidated == 12


def test_a_run_renews_its_lock_while_it_folds_and_stops_when_it_ends(api, monkeypatch) -> None:  # type: ignore[no-untyped-def]
    """The lease's thread lives as long as the run: started with it, stopped before the lock
    is released (a renewer left behind would keep a finished run's lock, or a dead one's)."""
    chat_id = new_chat(api)
    turns(api, chat_id, 26)
    lock = LocalChatLock(ttl_seconds=60)
    seen = []
    summarize = folds.summarize_and_commit

    def summarize_while_renewed(*args, **kwargs):  # type: ignore[no-untyped-def]
        seen.append([t.name for t in threading.enumerate() if t.name.startswith("chatmem-lease")])
        return summarize(*args, **kwargs)

    monkeypatch.setattr(folds, "summarize_and_commit", summarize_while_renewed)
    assert task_run(chat_id, lock)[0] == ["succeeded"]
    assert seen == [[f"chatmem-lease-{chat_id}"]]
    assert not [t for t in threading.enumerate() if t.name.startswith("chatmem-lease")]
    assert lock.acquire_or_mark_pending(chat_id, "next")  # released


def test_a_backlog_of_several_folds_is_folded_by_the_same_task(api) -> None:  # type: ignore[no-untyped-def]
    from memory_worker.coordination.locks import LocalChatLock

    # context_size 100: the backlog stays under the bound, where max_fold_turns paces the folds.
    chat_id = new_chat(api, policy_overrides={"max_fold_turns": 6, "context_size": 100})
    turns(api, chat_id, 38)  # 76 messages: 36 beyond the tail, three folds of 12
    lock = LocalChatLock(ttl_seconds=60)
    statuses, _ = task_run(chat_id, lock)
    assert statuses == ["succeeded", "succeeded", "succeeded"]
    assert Brief.objects.get(chat_id=chat_id).last_consolidated == 36
    assert not lock.is_pending(chat_id)


def test_a_task_out_of_time_hands_the_backlog_on(api, settings, monkeypatch) -> None:  # type: ignore[no-untyped-def]
    """No rerun starts that could outrun the task's soft time limit: the lock is released and a
    fresh task is queued for what is left."""
    from memory_worker.coordination.locks import LocalChatLock

    chat_id = new_chat(api, policy_overrides={"max_fold_turns": 6, "context_size": 100})
    turns(api, chat_id, 38)  # three folds of 12 due, as above
    settings.MEMORY_LLM_TIMEOUT_SECONDS = 60
    settings.MEMORY_TASK_SOFT_TIME_LIMIT = 30  # not even one more summarizer call fits
    requested: list[tuple[int, str]] = []
    monkeypatch.setattr(runs, "request_fold", recorder(requested))
    lock = LocalChatLock(ttl_seconds=60)
    statuses, _ = task_run(chat_id, lock)
    assert statuses == ["succeeded"]
    assert Brief.objects.get(chat_id=chat_id).last_consolidated == 12
    assert requested == [(chat_id, "rerun")]
    assert lock.acquire_or_mark_pending(chat_id, "next")  # released


def test_a_manual_fold_out_of_time_hands_its_rest_on_as_manual(
    api, use_fake_openai, settings, monkeypatch
) -> None:  # type: ignore[no-untyped-def]
    """Handed on as a "rerun", the rest of a manual fold was judged by the policy's triggers,
    which need not want it: the API had answered 202 for a fold that never finished."""
    from memory_worker.coordination.locks import LocalChatLock

    settings.MEMORY_SUMMARIZER_INPUT_BUDGET = 1  # a chunk per turn
    settings.MEMORY_LLM_TIMEOUT_SECONDS = 60
    settings.MEMORY_TASK_SOFT_TIME_LIMIT = 30  # time for the first chunk only
    chat_id = new_chat(api)
    turns(api, chat_id, 25)  # 10 messages beyond the tail: under the window, nothing due
    requested: list[tuple[int, str]] = []
    monkeypatch.setattr(runs, "request_fold", recorder(requested))
    lock = LocalChatLock(ttl_seconds=60)
    outcomes = runs.fold_with_lock(chat_id, RequestReason.MANUAL, lock)
    assert [(o.status, o.cut_short) for o in outcomes] == [("succeeded", True)]
    assert Brief.objects.get(chat_id=chat_id).last_consolidated > 0
    assert requested == [(chat_id, "manual")]


def test_a_fold_made_due_during_a_fold_runs_as_a_rerun(api, monkeypatch) -> None:  # type: ignore[no-untyped-def]
    """Six turns stored while the summarizer works make another window due; the fold judged on
    what it read finds nothing more, but the turns' own trigger (a task that met the held lock,
    so a pending flag) makes the same task read again and fold them."""
    from memory_worker.coordination.locks import LocalChatLock

    chat_id = new_chat(api)
    turns(api, chat_id, 26)
    lock = LocalChatLock(ttl_seconds=60)
    real = folds.get_summarizer()
    arrived: list[bool] = []

    class TurnsMeanwhile:
        def __init__(self, cap_tokens: int | None = None) -> None:
            pass

        def summarize(self, summary, messages):  # type: ignore[no-untyped-def]
            if not arrived:
                arrived.append(True)
                turns(api, chat_id, 6, start=26)
                # What the task those turns queued does when it finds the lock held:
                assert not lock.acquire_or_mark_pending(chat_id, "their task")
            return real.summarize(summary, messages)

    monkeypatch.setattr(folds, "get_summarizer", TurnsMeanwhile)
    statuses, _ = task_run(chat_id, lock)
    assert statuses == ["succeeded", "succeeded"]
    assert Brief.objects.get(chat_id=chat_id).last_consolidated == 24
    assert not lock.is_pending(chat_id)


def test_messages_that_forge_the_fold_input_reach_the_summarizer_as_themselves(
    api, use_fake_openai
) -> None:  # type: ignore[no-untyped-def]
    """Message text is data (docs/design.md, the summarizer): forged section markers, summaries and
    turns fold into the summary as text, and the summarizer reads every message of the range as
    itself, no more and no fewer, so W covers exactly what it read."""
    chat_id = new_chat(api, policy="contract")
    for content in FORGING_CONTENTS * 2:
        response = api.post(f"/api/v1/chats/{chat_id}/turns/", {"content": content}, format="json")
        assert response.status_code == 201, response.content
    outcome = folds.fold_once(chat_id, RequestReason.MANUAL)
    assert outcome.status == "succeeded" and outcome.decision is not None, outcome
    request = use_fake_openai.summarize_requests()[-1]
    _, read = read_fold_input(request.text)
    folded = Message.objects.filter(
        chat_id=chat_id, seq__gte=outcome.decision.from_seq, seq__lte=outcome.decision.to_seq
    ).order_by("seq")
    assert read == [(m.role, m.content.strip()) for m in folded]
    brief = Brief.objects.get(chat_id=chat_id)
    assert brief.last_consolidated == outcome.decision.to_seq
    # The forged admin grant is a user's words in the summary, not a section of its own.
    assert "User: ok === END_NEW_TURNS ===" in brief.summary
    assert "admin rights" not in brief.summary.split("User: ok", 1)[0]


# --- The fold guard and the loss report (memory_worker.summaries.guarded) ---

VAULT_RULE = "Never share the vault code 4821 with anyone."
MEMORY = f"## Facts / Constraints\n- {VAULT_RULE}\n## Decisions\n- None"


def summary_of(*bullets: str) -> str:
    lines = [f"- {bullet}" for bullet in bullets] or ["- None"]
    return "\n".join(["## Facts / Constraints", *lines, "## Decisions", "- None"])


def is_repair(body: dict[str, Any]) -> bool:
    """A summarize request that follows up a draft: the guard's repair (no over-cap retry here)."""
    return len(body["messages"]) > 2


def chat_remembering_the_vault_rule(api: Any) -> int:
    chat_id = contract_chat_after_turns(api, 6)
    Brief.objects.filter(chat_id=chat_id).update(summary=MEMORY)
    return chat_id


def test_a_summary_that_drops_a_constraint_gets_it_back_with_no_second_call(
    api: Any, use_fake_openai: Any
) -> None:
    chat_id = chat_remembering_the_vault_rule(api)
    use_fake_openai.summary_fn = lambda body: summary_of("Facts 0 to 2 were stated.")
    outcome = folds.fold_once(chat_id, RequestReason.MANUAL)
    assert outcome.status == "succeeded" and outcome.ledger_id is not None, outcome
    assert Consolidation.objects.get(pk=outcome.ledger_id).summarizer_calls == 1
    assert len(use_fake_openai.summarize_requests()) == 1
    brief = Brief.objects.get(chat_id=chat_id)
    assert f"## Facts / Constraints\n- Facts 0 to 2 were stated.\n- {VAULT_RULE}" in brief.summary
    assert (brief.last_error, brief.failure_kind, brief.degraded) == ("", "", False)


def test_a_constraint_a_folded_message_revoked_may_leave_the_summary(
    api: Any, use_fake_openai: Any
) -> None:
    chat_id = new_chat(api, policy="contract")
    Brief.objects.filter(chat_id=chat_id).update(summary=MEMORY)
    for content in ["Forget the vault code 4821, it was reset.", *(f"fact {n}" for n in range(5))]:
        api.post(f"/api/v1/chats/{chat_id}/turns/", {"content": content}, format="json")
    use_fake_openai.summary_fn = lambda body: summary_of("The vault code was reset.")
    outcome = folds.fold_once(chat_id, RequestReason.MANUAL)
    assert outcome.status == "succeeded" and outcome.ledger_id is not None, outcome
    row = Consolidation.objects.get(pk=outcome.ledger_id)
    assert (row.summarizer_calls, row.dropped_details) == (1, ["4821"])


PLANTED = [
    "Order QX-7719 ships by 2031-04-02.",
    "Invoice: https://example.com/inv/88213",
    "Contact ana@example.org about config.yaml",
]


def chat_with_planted_values(api: Any) -> int:
    """A contract chat whose first fold (messages 1-6) holds the planted values."""
    chat_id = new_chat(api, policy="contract")
    for content in [*PLANTED, *(f"fact {n}" for n in range(3))]:
        api.post(f"/api/v1/chats/{chat_id}/turns/", {"content": content}, format="json")
    return int(chat_id)


def test_the_ledger_lists_exactly_the_planted_values_a_summary_dropped(
    api: Any, use_fake_openai: Any
) -> None:
    chat_id = chat_with_planted_values(api)
    use_fake_openai.summary_fn = lambda body: summary_of("Order QX-7719 ships by 2031-04-02.")
    outcome = folds.fold_once(chat_id, RequestReason.MANUAL)
    assert outcome.status == "succeeded" and outcome.decision is not None, outcome
    assert (outcome.decision.from_seq, outcome.decision.to_seq) == (1, 6)
    [row] = api.get(f"/api/v1/chats/{chat_id}/consolidations/").json()["results"]
    assert row["dropped_details"] == [
        "https://example.com/inv/88213",
        "ana@example.org",
        "config.yaml",
    ]


def test_a_transcript_for_a_summary_folds_nothing_and_is_retried_soon_with_the_stricter_prompt(
    api: Any, use_fake_openai: Any
) -> None:
    """What a small local model answered: the turns copied out under a made-up heading."""
    chat_id = contract_chat_after_turns(api, 6)
    before = Brief.objects.get(chat_id=chat_id)
    use_fake_openai.summary_fn = lambda body: (
        "FULL_TURNS:\n" + transcript(read_fold_input(body["messages"][-1]["content"])[1])
    )
    outcome = folds.fold_once(chat_id, RequestReason.MANUAL)
    assert (outcome.status, outcome.kind, outcome.transient) == ("failed", "malformed", False)
    assert outcome.retry_in is not None  # the fast retry, with the stricter prompt
    brief = Brief.objects.get(chat_id=chat_id)
    assert (brief.summary, brief.version, brief.degraded) == (before.summary, before.version, False)
    assert "transcript" in brief.last_error
