"""The fold a turn needs before its model call (memory_worker.scheduling.before_turn), against a
real Celery worker, PostgreSQL and Redis: one fold per range on every path. A turn over its hard
bound waits for the fold in flight instead of summarizing the same range; with none in flight it
folds under the chat's lock and hands on a trigger that arrived meanwhile."""

import itertools
import logging
import threading
import time
from typing import Any

import pytest
from django.db import connection

from conversations.models import Brief, Chat, Consolidation, Message
from memory_worker.coordination.dispatch import RequestReason, fold_queued, mark_queued
from memory_worker.coordination.locks import RedisChatLock
from memory_worker.coordination.request_redis import breaker_open, reset_breaker
from memory_worker.coordination.runtime import chat_lock, request_chat_lock
from memory_worker.engine.policy import Trigger
from memory_worker.folding import execute as folds_module
from memory_worker.folding.execute import fold_once
from memory_worker.scheduling import runs
from memory_worker.scheduling.before_turn import Wait, wait_for_lock
from memory_worker.scheduling.runs import request_fold
from memory_worker.tasks import fold_chat
from tests.conftest import client_for
from tests.support.invariants import chat_violations
from tests.support.workers import Worker, wait_until
from tests.test_redis_restart import StalledRedis, point_web_at
from tests.test_worker_faults import chat_with_fold_due, ledger_running, model_env

pytestmark = [pytest.mark.postgres, pytest.mark.redis, pytest.mark.worker]


def post_turn(user: Any, chat_id: int, content: str) -> Any:
    return client_for(user).post(
        f"/api/v1/chats/{chat_id}/turns/", {"content": content}, format="json"
    )


def test_a_turn_over_its_bound_waits_for_the_workers_fold_and_summarizes_nothing(
    require_postgres, broker, settings, user, use_fake_openai, caplog
) -> None:  # type: ignore[no-untyped-def]
    use_fake_openai.summarize_latency = 2.0  # the worker's fold outlasts the turn's arrival
    chat_id = chat_with_fold_due(user, settings)  # 12 unfolded, K + B = 10: over the bound
    worker = Worker(broker, "slowfold", env=model_env(use_fake_openai))
    try:
        worker.wait_ready()
        assert request_fold(chat_id, RequestReason.TURN)
        assert wait_until(lambda: ledger_running(chat_id), timeout=30), worker.log()
        with caplog.at_level(logging.INFO, logger="chatmem.fold"):
            response = post_turn(user, chat_id, "over the bound")
        assert response.status_code == 201, response.content
    finally:
        worker.stop()
    folds = Consolidation.objects.filter(chat_id=chat_id)
    assert not folds.filter(synchronous=True).exists()
    assert len(use_fake_openai.summarize_requests()) == 1  # the worker's: none of the turn's
    fold = folds.get(status="succeeded")
    stored = Message.objects.get(chat_id=chat_id, seq=13)  # the turn's user message
    assert fold.finished_at is not None and fold.finished_at <= stored.created_at
    assert [r for r in caplog.records if getattr(r, "event", "") == "sync_fold_wait"]
    # The reply keeps how long its turn waited: the admin's timeline marks the turn.
    reply = Message.objects.get(chat_id=chat_id, seq=14)
    assert reply.metadata["waited_for_fold_ms"] > 0


def test_a_turn_with_no_fold_in_flight_folds_under_the_lock_and_hands_on_a_trigger(
    require_postgres, broker, settings, user, use_fake_openai, monkeypatch
) -> None:  # type: ignore[no-untyped-def]
    use_fake_openai.summarize_latency = 1.0
    chat_id = chat_with_fold_due(user, settings)
    handed: list[tuple[int, str]] = []
    monkeypatch.setattr(
        runs, "request_fold", lambda chat, trigger, due: handed.append((chat, trigger))
    )
    responses: list[Any] = []

    def send() -> None:
        try:
            responses.append(post_turn(user, chat_id, "over the bound"))
        finally:
            connection.close()

    sender = threading.Thread(target=send)
    sender.start()
    lock = chat_lock()
    held = wait_until(lambda: lock.is_held(chat_id), timeout=10, interval=0.01)
    # A trigger during the turn's fold finds the lock held and marks the chat pending.
    contended = held and not lock.acquire_or_mark_pending(chat_id, "a-trigger")
    sender.join(timeout=30)
    assert held and contended
    assert responses and responses[0].status_code == 201, responses
    assert Consolidation.objects.filter(
        chat_id=chat_id, synchronous=True, status="succeeded"
    ).exists()
    assert len(use_fake_openai.summarize_requests()) == 1
    assert not lock.is_held(chat_id)
    assert handed == [(chat_id, "rerun")]


def test_a_queued_task_that_does_not_start_is_waited_for_briefly(
    require_postgres, broker, settings, user, use_fake_openai
) -> None:  # type: ignore[no-untyped-def]
    """No worker takes the queued task: the turn waits MEMORY_QUEUED_FOLD_WAIT_SECONDS for it
    to start, then folds itself rather than wait behind a backlog."""
    settings.MEMORY_QUEUED_FOLD_WAIT_SECONDS = 0.5
    chat_id = chat_with_fold_due(user, settings)
    assert mark_queued(chat_id)
    started = time.monotonic()
    response = post_turn(user, chat_id, "over the bound")
    assert response.status_code == 201, response.content
    assert 0.5 <= time.monotonic() - started < 5  # not the fold deadline (5 s in these tests)
    assert Consolidation.objects.filter(
        chat_id=chat_id, synchronous=True, status="succeeded"
    ).exists()


def chat_seen_by_a_waiting_turn(chat_id: int) -> bool:
    """What acquire_or_wait looks at: a fold in flight (the lock held) or queued and not started."""
    return chat_lock().is_held(chat_id) or fold_queued(chat_id)


@pytest.mark.parametrize("lock_free", [True, False], ids=["lock-free", "lock-held"])
def test_a_starting_task_gives_up_its_queued_marker_only_once_it_holds_the_lock_or_marked_pending(
    require_postgres, broker, settings, user, use_fake_openai, monkeypatch, lock_free
) -> None:  # type: ignore[no-untyped-def]
    """A turn over its bound that looks while a queued task starts must see the fold queued or
    in flight; seeing neither, it would fold the range itself. Each step of the start is
    observed where it happens: the lock call and the marker's delete."""
    chat_id = chat_with_fold_due(user, settings)
    if not lock_free:
        assert chat_lock().acquire_or_mark_pending(chat_id, "another-run")
    assert mark_queued(chat_id)
    seen: list[tuple[str, bool]] = []
    real_acquire = RedisChatLock.acquire_or_mark_pending
    real_clear = runs.clear_queued

    def acquire(self, chat_id: int, token: str, *, manual: bool = False) -> bool:  # type: ignore[no-untyped-def]
        seen.append(("before the lock call", chat_seen_by_a_waiting_turn(chat_id)))
        claimed = real_acquire(self, chat_id, token, manual=manual)
        seen.append(("after the lock call", chat_seen_by_a_waiting_turn(chat_id)))
        return claimed

    def clear(chat_id: int) -> None:
        real_clear(chat_id)
        held = chat_lock().is_held(chat_id)
        seen.append(("after the marker's delete", held))

    monkeypatch.setattr(RedisChatLock, "acquire_or_mark_pending", acquire)
    monkeypatch.setattr(runs, "clear_queued", clear)
    outcomes = fold_chat(chat_id, "turn")
    assert all(visible for _, visible in seen), seen
    steps = ["before the lock call", "after the lock call", "after the marker's delete"]
    if not lock_free:  # busy: the holder is marked again after the delete (test below)
        steps += ["before the lock call", "after the lock call"]
    assert [step for step, _ in seen] == steps
    assert not fold_queued(chat_id)  # given up either way: the next turn queues a new task
    assert outcomes == ([] if not lock_free else ["succeeded"])


def test_a_task_finding_the_lock_busy_marks_the_holder_again_after_giving_up_its_marker(
    require_postgres, broker, settings, user, use_fake_openai, monkeypatch
) -> None:  # type: ignore[no-untyped-def]
    """The holder's rerun may read the chat between this task's pending mark and the marker's
    delete; a turn that commits then finds the marker taken and queues nothing. Forced here:
    the holder takes the pending mark (its rerun starts reading) just before the delete. The
    task marks the holder pending once more after the delete, so the holder runs again and
    reads that turn."""
    chat_id = chat_with_fold_due(user, settings)
    lock = chat_lock()
    assert lock.acquire_or_mark_pending(chat_id, "the-holder")
    assert mark_queued(chat_id)
    real_clear = runs.clear_queued

    def holder_reads_then_delete(chat_id: int) -> None:
        assert lock.take_pending(chat_id)  # the holder's rerun has begun: this mark is spent
        real_clear(chat_id)

    monkeypatch.setattr(runs, "clear_queued", holder_reads_then_delete)
    assert fold_chat(chat_id, "turn") == []
    assert lock.take_pending(chat_id)  # marked after the delete: the holder owes another run


def test_a_rerun_asked_for_before_the_turn_took_the_lock_is_still_served(
    require_postgres, broker, settings, user, use_fake_openai, monkeypatch
) -> None:  # type: ignore[no-untyped-def]
    """A task that left a rerun pending as it released the lock: the turn's fold, which decided
    its range before acquiring, cannot serve it, so its acquire must not clear it."""
    chat_id = chat_with_fold_due(user, settings)
    handed: list[tuple[int, str]] = []
    monkeypatch.setattr(
        runs, "request_fold", lambda chat, trigger, due: handed.append((chat, trigger))
    )
    chat_lock().mark_pending(chat_id)
    response = post_turn(user, chat_id, "over the bound")
    assert response.status_code == 201, response.content
    assert Consolidation.objects.filter(chat_id=chat_id, synchronous=True).exists()
    assert handed == [(chat_id, "rerun")]


def test_a_failing_summarizer_falls_back_to_the_offline_one_and_the_turn_goes_ahead(
    require_postgres, broker, settings, user, use_fake_openai
) -> None:  # type: ignore[no-untyped-def]
    """Promise 2 (docs/design.md): the model summarizer failing the fold a turn needs is no reason
    to fail the turn. The ledger keeps the failed attempt and the offline summarizer's fold after
    it."""
    use_fake_openai.set_faults("summarize", rate=1.0, faults=["500"])
    chat_id = chat_with_fold_due(user, settings)
    response = post_turn(user, chat_id, "over the bound")
    assert response.status_code == 201, response.content
    folds = list(Consolidation.objects.filter(chat_id=chat_id).order_by("id"))
    assert [(f.status, f.trigger, f.synchronous) for f in folds] == [
        ("failed", "hard_bound", True),
        ("succeeded", Trigger.HARD_BOUND_FALLBACK, True),
    ]
    brief = Brief.objects.get(chat_id=chat_id)
    assert brief.summary and brief.last_consolidated == folds[1].to_seq


def test_a_turns_fold_the_model_refused_withholds_its_range_instead_of_copying_it(
    require_postgres, broker, settings, user, use_fake_openai
) -> None:  # type: ignore[no-untyped-def]
    """The offline fallback after a refusal writes no word of what the model refused: a summary
    carrying it would have every later model fold of the chat refused too. The range is
    withheld (a marker line, the brief's list); its messages stay in the history."""
    use_fake_openai.refuse_summaries_containing("fact 0")
    chat_id = chat_with_fold_due(user, settings)
    response = post_turn(user, chat_id, "over the bound")
    assert response.status_code == 201, response.content
    fallback = Consolidation.objects.get(
        chat_id=chat_id, status="succeeded", trigger=Trigger.HARD_BOUND_FALLBACK
    )
    assert fallback.withheld_seqs == list(range(fallback.from_seq, fallback.to_seq + 1))
    brief = Brief.objects.get(chat_id=chat_id)
    assert "fact 0" not in brief.summary
    assert f"messages 1-{fallback.to_seq} withheld" in brief.summary
    assert [item["seq"] for item in brief.withheld] == fallback.withheld_seqs
    # The next model fold is not refused for the summary it starts from.
    settings.MEMORY_DISPATCH = "off"
    for number in range(6):
        assert post_turn(user, chat_id, f"later {number}").status_code == 201
    outcome = fold_once(chat_id, RequestReason.MANUAL)
    assert outcome.status == "succeeded", outcome
    assert f"messages 1-{fallback.to_seq} withheld" in Brief.objects.get(chat_id=chat_id).summary
    assert chat_violations(chat_id) == []


def context_within_contract_bound(request: Any) -> bool:
    """contract's hard bound: at most K + B = 10 history messages before the new one."""
    messages = request.body["messages"]
    history = [m for m in messages if m["role"] != "system"][:-1]
    return len(history) <= 10


def turn_until(user: Any, chat_id: int, done: Any, turns: int) -> int:
    """Turns until ``done()`` holds; how many it took (``turns`` at most)."""
    for number in range(1, turns + 1):
        response = post_turn(user, chat_id, f"after recovery {number}: keep budget 40 EUR")
        assert response.status_code == 201, response.content
        if done():
            return number
    return turns + 1


def test_a_summarizer_failing_every_call_never_fails_a_turn_and_recovers(
    require_postgres, broker, settings, user, use_fake_openai
) -> None:  # type: ignore[no-untyped-def]
    """Issue 29's acceptance: with every summarizer call failing (invalid output, 5xx), 200
    turns at the bound answer, every context within its bound; the ledger shows the turns'
    fallback folds and the brief marks the summary as a fallback; once the summarizer answers
    again, the next model fold replaces the fallback summary. Background folds run in a real
    worker (and fail, and back off) with the default: no background fallback."""
    settings.MEMORY_QUEUED_FOLD_WAIT_SECONDS = 0.2
    use_fake_openai.set_faults(
        "summarize", rate=1.0, faults=["empty", "truncated", "refusal", "500"], seed=29
    )
    chat_id = client_for(user).post("/api/v1/chats/", {"policy": "contract"}, format="json")
    chat_id = chat_id.json()["id"]
    worker = Worker(broker, "failing-summarizer", env=model_env(use_fake_openai))
    try:
        worker.wait_ready()
        for number in range(200):
            response = post_turn(user, chat_id, f"turn {number}: the deadline is day {number}")
            assert response.status_code == 201, (number, response.content)
        chats = use_fake_openai.chat_requests()
        assert len(chats) == 200
        assert all(context_within_contract_bound(request) for request in chats)
        folds = Consolidation.objects.filter(chat_id=chat_id)
        assert (
            not folds.filter(status="succeeded")
            .exclude(trigger=Trigger.HARD_BOUND_FALLBACK)
            .exists()
        )
        fallbacks = folds.filter(trigger=Trigger.HARD_BOUND_FALLBACK, status="succeeded")
        assert fallbacks.count() >= 50
        assert all(row.error.startswith("fallback after: summarizer") for row in fallbacks)
        brief = Brief.objects.get(chat_id=chat_id)
        assert brief.fallback_since is not None and brief.fallback_reason
        assert brief.last_consolidated == fallbacks.order_by("-id")[0].to_seq
        fallback_summary = brief.summary

        use_fake_openai.clear_faults("summarize")

        def model_fold_committed() -> bool:
            return Brief.objects.get(chat_id=chat_id).fallback_since is None

        assert turn_until(user, chat_id, model_fold_committed, turns=6) <= 6
    finally:
        worker.stop()
    brief = Brief.objects.get(chat_id=chat_id)
    last = Consolidation.objects.filter(chat_id=chat_id, status="succeeded").order_by("-id")[0]
    assert last.trigger != Trigger.HARD_BOUND_FALLBACK and not last.error
    assert (brief.fallback_reason, brief.degraded, brief.last_error) == ("", False, "")
    assert brief.summary != fallback_summary and brief.last_consolidated == last.to_seq
    assert all(context_within_contract_bound(r) for r in use_fake_openai.chat_requests())
    assert chat_violations(chat_id) == []  # the ledger's commits, fallbacks too, cover 1..W once


def test_with_the_background_fallback_the_worker_folds_offline_and_recovers(
    require_postgres, broker, settings, user, use_fake_openai
) -> None:  # type: ignore[no-untyped-def]
    """MEMORY_SUMMARIZER_FALLBACK=offline in the worker: once its fast retry also failed, a
    background fold commits the offline summary (ledger summarizer_fallback) without a turn
    having to; the model's next fold replaces it."""
    use_fake_openai.set_faults("summarize", rate=1.0, faults=["empty", "refusal"], seed=7)
    chat_id = chat_with_fold_due(user, settings)
    env = {
        **model_env(use_fake_openai),
        "MEMORY_SUMMARIZER_FALLBACK": "offline",
        "MEMORY_INVALID_OUTPUT_RETRY_SECONDS": "0.5",
    }
    worker = Worker(broker, "fallback", env=env)
    try:
        worker.wait_ready()
        assert request_fold(chat_id, RequestReason.TURN)

        def background_fallback() -> bool:
            return Consolidation.objects.filter(
                chat_id=chat_id, trigger=Trigger.SUMMARIZER_FALLBACK, status="succeeded"
            ).exists()

        assert wait_until(background_fallback, timeout=30), worker.log()
        rows = list(Consolidation.objects.filter(chat_id=chat_id).order_by("id"))
        # The first failure's fast retry (the worker's own delayed task), then the fallback.
        assert [(r.status, r.trigger) for r in rows] == [
            ("failed", "overflow"),
            ("failed", "overflow"),
            ("succeeded", Trigger.SUMMARIZER_FALLBACK),
        ]
        assert not any(r.synchronous for r in rows)
        brief = Brief.objects.get(chat_id=chat_id)
        assert brief.fallback_since is not None and brief.consecutive_failures >= 2
        assert brief.degraded == (brief.consecutive_failures >= 3)  # the streak, not the kind
        use_fake_openai.clear_faults("summarize")
        for number in range(6):
            assert post_turn(user, chat_id, f"recovered {number}").status_code == 201
        assert wait_until(
            lambda: Brief.objects.get(chat_id=chat_id).fallback_since is None, timeout=30
        ), worker.log()
    finally:
        worker.stop()
    last = Consolidation.objects.filter(chat_id=chat_id, status="succeeded").order_by("-id")[0]
    assert last.trigger not in (Trigger.SUMMARIZER_FALLBACK, Trigger.HARD_BOUND_FALLBACK)


def test_a_stalled_redis_holds_a_turns_synchronous_fold_for_one_request_timeout_at_most(
    require_postgres, broker, settings, user, use_fake_openai
) -> None:  # type: ignore[no-untyped-def]
    """Redis accepts and never answers. The turn's lock look gives up after the request path's
    timeout and opens the breaker; the turn folds fenced, without the lock, and later turns and
    the chat's memory view ask Redis nothing while the breaker is open."""
    settings.REDIS_REQUEST_TIMEOUT_SECONDS = 0.25  # the default the suite raises
    chat_id = chat_with_fold_due(user, settings)
    stalled = StalledRedis()
    reset_breaker()
    try:
        point_web_at(settings, stalled.url)
        started = time.monotonic()
        waited = wait_for_lock(chat_id, 0, request_chat_lock(), "a-turn", started, started + 30)
        assert waited is Wait.EXPIRED
        assert breaker_open()
        # Well under the workers' socket timeout (BROKER_SOCKET_TIMEOUT_SECONDS): the request's own.
        assert time.monotonic() - started < 2.5
        started = time.monotonic()
        response = post_turn(user, chat_id, "over the bound, Redis stalled")
        assert response.status_code == 201, response.content
        brief = client_for(user).get(f"/api/v1/chats/{chat_id}/brief/")
        assert brief.status_code == 200, brief.content
        assert time.monotonic() - started < 2.5
    finally:
        point_web_at(settings, broker)
        reset_breaker()
        stalled.stop()
    assert Consolidation.objects.filter(
        chat_id=chat_id, synchronous=True, status="succeeded"
    ).exists()
    assert chat_violations(chat_id) == []


def test_a_turns_fold_longer_than_its_slot_keeps_the_slot_and_no_retry_folds_it_again(
    require_postgres, broker, settings, user, use_fake_openai, monkeypatch
) -> None:  # type: ignore[no-untyped-def]
    """A backlog of nine summarizer chunks (0.4 s each) before a turn whose slot goes stale
    after 2 s. The turn's fold has a deadline within the slot's lifetime (no chunk starts that
    could not end by then) and renews the slot before every chunk, so the client's retry, sent
    once the slot would have gone stale, cannot take it over: the turn answers 201 for the work
    it did, and no range is summarized twice."""
    settings.MEMORY_DISPATCH = "off"  # build the backlog without triggering anything
    api = client_for(user)
    body = {"policy": "sliding-window", "policy_overrides": {"tail_messages": 2, "window": 4}}
    chat_id = api.post("/api/v1/chats/", body, format="json").json()["id"]
    for number in range(10):  # 20 messages, none folded
        assert post_turn(user, chat_id, f"fact {number}").status_code == 201
    # Over the bound now: the next turn folds down to the 2-message tail, a turn per chunk.
    overrides = {"tail_messages": 2, "window": 4, "hard_limit": 8, "context_size": 18}
    Chat.objects.filter(pk=chat_id).update(policy_overrides=overrides)
    settings.MEMORY_DISPATCH = "celery"
    settings.MEMORY_SUMMARIZER_INPUT_BUDGET = 1
    settings.MEMORY_LLM_TIMEOUT_SECONDS = 1.0
    settings.TURN_SLOT_STALE_SECONDS = 2.0
    use_fake_openai.summarize_latency = 0.4
    slot_at_chunk: list[Any] = []
    fold_chunk = folds_module.fold_chunk

    def chunk_seeing_the_slot(*args, **kwargs):  # type: ignore[no-untyped-def]
        slot_at_chunk.append(
            Chat.objects.filter(pk=chat_id).values_list("turn_started_at", flat=True).get()
        )
        return fold_chunk(*args, **kwargs)

    monkeypatch.setattr(folds_module, "fold_chunk", chunk_seeing_the_slot)
    responses: list[Any] = []

    def send() -> None:
        try:
            responses.append(post_turn(user, chat_id, "over the bound"))
        finally:
            connection.close()

    sender = threading.Thread(target=send)
    sender.start()
    time.sleep(settings.TURN_SLOT_STALE_SECONDS + 0.3)
    retry = post_turn(user, chat_id, "over the bound")  # the client gave up waiting
    sender.join(timeout=30)
    assert responses and responses[0].status_code == 201, responses[0].content
    assert retry.status_code in (201, 409), retry.content
    assert len(slot_at_chunk) >= 2
    assert all(later > earlier for earlier, later in itertools.pairwise(slot_at_chunk))
    ledger = Consolidation.objects.filter(chat_id=chat_id)
    assert set(ledger.values_list("status", flat=True)) == {"succeeded"}
    assert ledger.count() == len(use_fake_openai.summarize_requests())
    assert chat_violations(chat_id) == []
