"""The per-chat lock contract, on real Redis and in-process: acquire-or-mark-pending and
release-or-rerun are atomic, so a trigger during a run yields exactly one rerun."""

import threading
import time

import pytest

from memory_worker.locks import LocalChatLock, RedisChatLock, Release
from tests.workers import wait_until


@pytest.fixture(params=["redis", "local"])
def make_lock(request):  # type: ignore[no-untyped-def]
    """A factory of locks of one kind with a given TTL."""
    if request.param == "local":
        return lambda ttl_seconds: LocalChatLock(ttl_seconds=ttl_seconds)
    import redis

    client = redis.Redis.from_url(request.getfixturevalue("clean_redis"))
    return lambda ttl_seconds: RedisChatLock(client, ttl_seconds=ttl_seconds)


@pytest.fixture
def lock(make_lock):  # type: ignore[no-untyped-def]
    return make_lock(30)


def test_a_lock_past_its_ttl_goes_to_the_next_trigger(make_lock) -> None:  # type: ignore[no-untyped-def]
    """A holder that stops (a killed or paused worker) keeps the chat only for the TTL: then the
    next trigger takes the lock, and the old holder's release finds it lost."""
    ttl = 0.2
    lock = make_lock(ttl)
    acquired_at = time.monotonic()
    assert lock.acquire_or_mark_pending(6, "a")
    assert wait_until(lambda: lock.acquire_or_mark_pending(6, "b"), timeout=10, interval=0.02)
    assert time.monotonic() - acquired_at >= ttl * 0.9  # not before the TTL ran out
    assert lock.release_or_rerun(6, "a") is Release.LOST
    assert not lock.release(6, "a")
    assert lock.release_or_rerun(6, "b") is Release.RELEASED  # b's acquire cleared the pending


def test_second_acquire_marks_pending_and_release_reruns_once(lock) -> None:  # type: ignore[no-untyped-def]
    assert lock.acquire_or_mark_pending(1, "a")
    assert not lock.acquire_or_mark_pending(1, "b")
    assert not lock.acquire_or_mark_pending(1, "c")  # a pile of triggers is one pending flag
    assert lock.is_pending(1)
    assert lock.release_or_rerun(1, "a") is Release.RERUN
    assert not lock.is_pending(1)
    assert lock.release_or_rerun(1, "a") is Release.RELEASED
    assert lock.acquire_or_mark_pending(1, "d")


def test_release_by_a_stranger_is_lost(lock) -> None:  # type: ignore[no-untyped-def]
    assert lock.acquire_or_mark_pending(2, "owner")
    assert lock.release_or_rerun(2, "stranger") is Release.LOST
    assert not lock.release(2, "stranger")
    assert lock.release(2, "owner")


def test_acquire_clears_stale_pending(lock) -> None:  # type: ignore[no-untyped-def]
    lock.mark_pending(3)
    assert lock.acquire_or_mark_pending(3, "a")  # this run reads fresh state: covers the trigger
    assert lock.release_or_rerun(3, "a") is Release.RELEASED


def test_chats_are_independent(lock) -> None:  # type: ignore[no-untyped-def]
    assert lock.acquire_or_mark_pending(4, "a")
    assert lock.acquire_or_mark_pending(5, "b")
    assert lock.pending_chats() == []


def test_races_between_triggers_and_release_lose_no_rerun(lock) -> None:  # type: ignore[no-untyped-def]
    """1,000 races of a trigger against the holder's release. After each race either the trigger
    took the lock itself, or it left a pending flag that the holder turned into a rerun: never
    neither (a lost rerun) and never both (an extra run)."""
    for attempt in range(1000):
        chat_id = 10_000 + attempt
        assert lock.acquire_or_mark_pending(chat_id, "holder")
        start = threading.Barrier(2)
        outcome: dict[str, object] = {}

        def trigger(
            chat_id: int = chat_id,
            start: threading.Barrier = start,
            outcome: dict[str, object] = outcome,
        ) -> None:
            start.wait()
            outcome["trigger_acquired"] = lock.acquire_or_mark_pending(chat_id, "trigger")

        thread = threading.Thread(target=trigger)
        thread.start()
        start.wait()
        outcome["release"] = lock.release_or_rerun(chat_id, "holder")
        thread.join()
        reran = outcome["release"] is Release.RERUN
        assert reran != outcome["trigger_acquired"], (attempt, outcome)
        if reran:
            assert lock.release_or_rerun(chat_id, "holder") is Release.RELEASED
        else:
            assert lock.release_or_rerun(chat_id, "trigger") is Release.RELEASED
        assert not lock.is_pending(chat_id)
