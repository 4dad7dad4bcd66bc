"""The fold a turn needs before its model call (memory_worker.turn_fold), against a real Celery
worker, PostgreSQL and Redis: one fold per range on every path. A turn over its hard bound
waits for the fold in flight instead of summarizing the same range; with none in flight it
folds under the chat's lock and hands on a trigger that arrived meanwhile."""

import logging
import threading
import time
from typing import Any

import pytest
from django.db import connection

from conversations.models import Brief, Consolidation, Message
from memory_worker import turn_fold
from memory_worker.dispatch import RequestTrigger, mark_queued
from memory_worker.policy import Trigger
from memory_worker.runs import request_consolidation
from memory_worker.runtime import chat_lock
from tests.conftest import client_for
from tests.test_worker_faults import chat_with_fold_due, ledger_running, model_env
from tests.workers import Worker, wait_until

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
        assert request_consolidation(chat_id, RequestTrigger.TURN)
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


def test_a_turn_with_no_fold_in_flight_folds_under_the_lock_and_hands_on_a_trigger(
    require_postgres, broker, settings, user, use_fake_openai, monkeypatch
) -> None:  # type: ignore[no-untyped-def]
    use_fake_openai.summarize_latency = 1.0
    chat_id = chat_with_fold_due(user, settings)
    handed: list[tuple[int, str]] = []
    monkeypatch.setattr(
        turn_fold, "request_consolidation", lambda chat, trigger: handed.append((chat, trigger))
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


def test_a_rerun_asked_for_before_the_turn_took_the_lock_is_still_served(
    require_postgres, broker, settings, user, use_fake_openai, monkeypatch
) -> None:  # type: ignore[no-untyped-def]
    """A task that left a rerun pending as it released the lock: the turn's fold, which decided
    its range before acquiring, cannot serve it, so its acquire must not clear it."""
    chat_id = chat_with_fold_due(user, settings)
    handed: list[tuple[int, str]] = []
    monkeypatch.setattr(
        turn_fold, "request_consolidation", lambda chat, trigger: handed.append((chat, trigger))
    )
    chat_lock().mark_pending(chat_id)
    response = post_turn(user, chat_id, "over the bound")
    assert response.status_code == 201, response.content
    assert Consolidation.objects.filter(chat_id=chat_id, synchronous=True).exists()
    assert handed == [(chat_id, "rerun")]


def test_a_failing_summarizer_falls_back_to_the_offline_one_and_the_turn_goes_ahead(
    require_postgres, broker, settings, user, use_fake_openai
) -> None:  # type: ignore[no-untyped-def]
    """DESIGN §1.2: the model summarizer failing the fold a turn needs is no reason to fail the
    turn. The ledger keeps the failed attempt and the offline summarizer's fold after it."""
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
