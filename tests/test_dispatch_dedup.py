"""One queued consolidation task per chat: a turn that finds a fold due publishes nothing while a
task for that chat is queued and not started (memory_worker.coordination.dispatch), and the task
gives the chat back to later turns when it starts, before it reads anything."""

from collections.abc import Iterator
from typing import Any

import pytest

from memory_worker.coordination.dispatch import QUEUED_KEY, RequestReason, clear_queued
from memory_worker.coordination.locks import LocalChatLock
from memory_worker.folding.outcomes import FoldOutcome, FoldStatus
from memory_worker.scheduling import runs
from memory_worker.scheduling.runs import request_fold
from tests.conftest import client_for, contract_chat_after_turns
from tests.support.workers import Worker, point_celery_at, wait_until

pytestmark = [pytest.mark.redis]

QUEUE = "memory"  # kombu's Redis transport keeps a queue's messages in a list of that name


def queued_tasks(client: Any) -> list[tuple[str, str]]:
    """(task name, its arguments) of every message waiting in the memory queue."""
    import json

    messages = [json.loads(raw) for raw in client.lrange(QUEUE, 0, -1)]
    return [(m["headers"]["task"], m["headers"]["argsrepr"]) for m in messages]


@pytest.fixture
def broker(settings, clean_redis) -> Iterator[Any]:  # type: ignore[no-untyped-def]
    import redis

    previous = point_celery_at(clean_redis)
    settings.REDIS_URL = clean_redis
    settings.MEMORY_DISPATCH = "celery"
    yield redis.Redis.from_url(clean_redis)
    point_celery_at(previous)


def test_turns_queue_one_task_per_chat_until_it_starts(broker) -> None:  # type: ignore[no-untyped-def]
    for _ in range(5):
        # Handed on: to the task already queued.
        assert request_fold(7, RequestReason.TURN)
    assert broker.llen(QUEUE) == 1
    assert request_fold(8, RequestReason.TURN)  # another chat has its own marker
    assert broker.llen(QUEUE) == 2
    clear_queued(7)  # what the task does when it starts
    assert request_fold(7, RequestReason.TURN)
    assert broker.llen(QUEUE) == 3


def test_manual_sweep_and_rerun_requests_always_publish(broker) -> None:  # type: ignore[no-untyped-def]
    assert request_fold(7, RequestReason.TURN)
    manual, sweep, rerun = RequestReason.MANUAL, RequestReason.SWEEP, RequestReason.RERUN
    for trigger in (manual, sweep, rerun, manual):
        assert request_fold(7, trigger)
    assert broker.llen(QUEUE) == 5


def test_the_marker_expires(broker, settings) -> None:  # type: ignore[no-untyped-def]
    settings.MEMORY_ENQUEUE_DEDUP_SECONDS = 0.2
    assert request_fold(7, RequestReason.TURN)
    assert 0 < broker.pttl(QUEUED_KEY.format(7)) <= 200
    assert wait_until(lambda: not broker.exists(QUEUED_KEY.format(7)), timeout=5)
    assert request_fold(7, RequestReason.TURN)
    assert broker.llen(QUEUE) == 2


def test_zero_turns_deduplication_off(broker, settings) -> None:  # type: ignore[no-untyped-def]
    settings.MEMORY_ENQUEUE_DEDUP_SECONDS = 0
    for _ in range(3):
        assert request_fold(7, RequestReason.TURN)
    assert broker.llen(QUEUE) == 3


def test_a_failed_publish_leaves_no_marker(broker) -> None:  # type: ignore[no-untyped-def]
    """The marker lives in Redis beside the broker; if the publish fails after the marker was
    taken, the marker is given back so the next turn publishes."""
    import socket

    with socket.socket() as probe:  # a port nothing listens on
        probe.bind(("127.0.0.1", 0))
        dead_port = probe.getsockname()[1]
    live = point_celery_at(f"redis://127.0.0.1:{dead_port}/0")
    try:
        assert not request_fold(7, RequestReason.TURN)  # logged, never raised
    finally:
        point_celery_at(live)
    assert not broker.exists(QUEUED_KEY.format(7))
    assert request_fold(7, RequestReason.TURN)
    assert broker.llen(QUEUE) == 1


class RecordingLock(LocalChatLock):
    def __init__(self, calls: list[str]) -> None:
        super().__init__(ttl_seconds=30)
        self.calls = calls

    def acquire_or_mark_pending(self, chat_id: int, token: str, *, manual: bool = False) -> bool:
        self.calls.append(f"lock {chat_id}")
        return super().acquire_or_mark_pending(chat_id, token, manual=manual)


def test_the_run_clears_the_marker_after_the_lock_and_before_it_reads(monkeypatch) -> None:  # type: ignore[no-untyped-def]
    """Called as a worker's task calls it: the marker goes once the lock is taken (a turn over its
    bound sees the fold queued, then in flight) and before the chat is read (a turn that found
    the marker taken is seen by this run)."""
    calls: list[str] = []
    monkeypatch.setattr(runs, "clear_queued", lambda chat_id: calls.append(f"clear {chat_id}"))

    def fold_once(chat_id: int, trigger: str, **_: object) -> FoldOutcome:
        calls.append(f"read {chat_id}")
        return FoldOutcome(FoldStatus.NOTHING)

    monkeypatch.setattr(runs, "fold_once", fold_once)
    monkeypatch.setattr(runs, "hand_on_pending", lambda *args: None)
    runs.fold_with_lock(7, RequestReason.TURN, RecordingLock(calls))
    assert calls == ["lock 7", "clear 7", "read 7"]


def test_a_run_whose_marker_cannot_be_cleared_still_runs(monkeypatch) -> None:  # type: ignore[no-untyped-def]
    def broken(chat_id: int) -> None:
        raise ConnectionError("redis is down")

    ran: list[int] = []

    def fold_once(chat_id: int, trigger: str, **_: object) -> FoldOutcome:
        ran.append(chat_id)
        return FoldOutcome(FoldStatus.NOTHING)

    monkeypatch.setattr(runs, "clear_queued", broken)
    monkeypatch.setattr(runs, "fold_once", fold_once)
    monkeypatch.setattr(runs, "hand_on_pending", lambda *args: None)
    runs.fold_with_lock(7, RequestReason.TURN, LocalChatLock(ttl_seconds=30))
    assert ran == [7]


@pytest.mark.postgres
@pytest.mark.worker
def test_a_chat_behind_queues_one_task_and_a_worker_catches_it_up(
    require_postgres, broker, clean_redis, user
) -> None:  # type: ignore[no-untyped-def]
    """Workers down: 30 turns of a contract chat (a fold due after nearly every turn; the turns
    also fold synchronously when the bound is reached) leave one consolidation task in the
    queue, not one per turn (the flush hooks of the synchronous folds queue their own tasks).
    A worker started afterwards folds the chat up to date from that task and its reruns, and
    clears the marker."""
    from django.utils import timezone

    from conversations.models import Brief, Chat
    from memory_worker.folding.execute import decide_for_chat
    from memory_worker.folding.snapshot import load_snapshot

    chat_id = contract_chat_after_turns(client_for(user), 30)
    folds = [task for task in queued_tasks(broker) if task[0] == "chatmem.consolidate_chat"]
    assert folds == [("chatmem.consolidate_chat", f"({chat_id}, 'turn')")]
    assert broker.exists(QUEUED_KEY.format(chat_id))
    worker = Worker(clean_redis, "dedup")
    try:
        worker.wait_ready()

        def caught_up() -> bool:
            chat = Chat.objects.get(pk=chat_id)
            return decide_for_chat(chat, load_snapshot(chat_id), timezone.now()) is None

        assert wait_until(caught_up, timeout=60), worker.log()
    finally:
        worker.stop()
    assert Brief.objects.get(chat_id=chat_id).last_consolidated > 0
    assert not broker.exists(QUEUED_KEY.format(chat_id))
