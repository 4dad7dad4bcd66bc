"""The per-chat lock contract, on real Redis and in-process: acquire-or-mark-pending and
release-or-rerun are atomic, so a trigger during a run yields exactly one rerun; a short TTL
that its holder renews (memory_worker.coordination.lease) until the run ends or reaches its
deadline."""

import threading
import time

import pytest

from memory_worker.coordination.lease import Lease
from memory_worker.coordination.locks import LocalChatLock, RedisChatLock, Release
from tests.support.workers import wait_until


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


# --- Renewal: a short TTL that its holder keeps alive ------------------------------------


def test_a_renewed_lock_outlives_its_ttl_and_a_lapsed_one_goes_to_another_token(make_lock) -> None:  # type: ignore[no-untyped-def]
    ttl = 0.3
    lock = make_lock(ttl)
    acquired_at = time.monotonic()
    assert lock.acquire_or_mark_pending(7, "a")
    # Renewed every 50 ms for more than three TTLs: still a's, and nobody else gets it.
    assert wait_until(
        lambda: lock.renew(7, "a") and time.monotonic() - acquired_at > 3 * ttl,
        timeout=10,
        interval=0.05,
    )
    assert not lock.try_acquire(7, "b")
    # No longer renewed: it lapses, another token takes it, and the old holder's renewal
    # reports the loss instead of reviving it.
    assert wait_until(lambda: lock.try_acquire(7, "b"), timeout=10, interval=0.02)
    assert not lock.renew(7, "a")
    assert lock.renew(7, "b")
    assert not lock.release(7, "a")
    assert lock.release(7, "b")
    assert not lock.renew(7, "b")  # released: nothing to renew


def test_the_lease_renews_the_lock_until_its_deadline_then_lets_it_lapse(make_lock) -> None:  # type: ignore[no-untyped-def]
    """The renewer thread keeps the lock through a silent stretch (one long summarizer call)
    longer than its TTL, but not past the holder's own deadline: a stuck holder's lock
    lapses one TTL after it."""
    ttl = 0.3
    lock = make_lock(ttl)
    assert lock.acquire_or_mark_pending(8, "a")
    until = time.monotonic() + 4 * ttl
    lease = Lease(lock, 8, "a", until=until).start()
    try:
        while time.monotonic() < until:  # never free while the lease renews it
            assert lock.is_held(8) and not lock.try_acquire(8, "b")
            time.sleep(0.02)
        assert wait_until(lambda: not lease.renewing, timeout=5)
        assert wait_until(lambda: lock.try_acquire(8, "b"), timeout=5, interval=0.02)
        assert time.monotonic() >= until
        assert not lease.lost  # it stopped at its deadline, it did not lose the lock
    finally:
        lease.stop()


def test_a_stopped_lease_renews_no_more(make_lock) -> None:  # type: ignore[no-untyped-def]
    """The run ended (or its process died): nothing keeps the lock beyond one TTL."""
    ttl = 0.3
    lock = make_lock(ttl)
    assert lock.acquire_or_mark_pending(9, "a")
    lease = Lease(lock, 9, "a", until=time.monotonic() + 60).start()
    assert lease.renewing
    lease.stop()
    assert not lease.renewing
    stopped_at = time.monotonic()
    assert wait_until(lambda: lock.try_acquire(9, "b"), timeout=5, interval=0.02)
    assert time.monotonic() - stopped_at < 10 * ttl


def test_a_lease_whose_lock_was_taken_reports_it_lost(make_lock) -> None:  # type: ignore[no-untyped-def]
    lock = make_lock(0.3)
    assert lock.acquire_or_mark_pending(11, "a")
    lease = Lease(lock, 11, "a", until=time.monotonic() + 60).start()
    try:
        assert lease.renew() and not lease.lost
        assert lock.release(11, "a") and lock.try_acquire(11, "b")  # as after a lapse
        assert wait_until(lambda: lease.lost, timeout=5, interval=0.02)
        assert wait_until(lambda: not lease.renewing, timeout=5)
        assert not lease.renew()
        assert lock.release(11, "b")  # the new holder's lock was left alone
    finally:
        lease.stop()


def test_a_lock_released_inside_its_lease_is_not_reported_lost(
    monkeypatch: pytest.MonkeyPatch, caplog: pytest.LogCaptureFixture
) -> None:
    """A run releases its lock inside its lease (release_or_rerun), and the lease stops only
    when the run returns: a renewal in between finds the lock gone, which is no lost lock."""
    from memory_worker.coordination.dispatch import RequestReason
    from memory_worker.folding.outcomes import FoldOutcome, FoldStatus
    from memory_worker.scheduling import runs

    ttl = 0.15

    class SlowToReturn(LocalChatLock):
        def release_or_rerun(self, chat_id: int, token: str) -> Release:
            released = super().release_or_rerun(chat_id, token)
            time.sleep(2 * ttl)  # the lease's thread renews meanwhile
            return released

    monkeypatch.setattr(runs, "fold_once", lambda *a, **k: FoldOutcome(FoldStatus.NOTHING))
    caplog.set_level("WARNING", logger="chatmem.fold")
    lock = SlowToReturn(ttl_seconds=ttl)
    assert len(runs.fold_with_lock(12, RequestReason.TURN, lock)) == 1
    assert [r for r in caplog.records if getattr(r, "event", "") == "lock_lost"] == []
