"""Consolidation across real worker processes under faults (docs/design.md, the fold): a burst of
triggers, a worker killed in the middle of the LLM call, a paused worker whose result comes back
stale."""

import json
import signal
import time
from collections import Counter

import pytest
import redis

from conversations.models import Brief, Consolidation
from memory_worker import tasks
from memory_worker.coordination.dispatch import RequestReason
from memory_worker.coordination.locks import RedisChatLock
from memory_worker.scheduling.runs import request_fold
from tests.conftest import client_for, contract_chat_after_turns
from tests.support.invariants import chat_violations
from tests.support.workers import FAST_DEADLINES, Worker, wait_until

pytestmark = [pytest.mark.postgres, pytest.mark.redis, pytest.mark.worker]


def model_env(server) -> dict[str, str]:  # type: ignore[no-untyped-def]
    return {
        "OPENAI_BASE_URL": server.base_url,
        "OPENAI_API_KEY": "test-key",
        "CHAT_BACKEND": "openai",
        "MEMORY_SUMMARIZER_BACKEND": "chat",
        "MEMORY_SUMMARIZER_MODEL": "fake-summarizer",
        **FAST_DEADLINES,
    }


def chat_with_fold_due(user, settings) -> int:  # type: ignore[no-untyped-def]
    """A contract chat with 12 unfolded messages (K + B = 10): one overflow fold is due."""
    settings.MEMORY_DISPATCH = "off"  # build the backlog without triggering anything
    chat_id = contract_chat_after_turns(client_for(user), 6)
    settings.MEMORY_DISPATCH = "celery"
    return chat_id


def ledger_running(chat_id: int) -> bool:
    return Consolidation.objects.filter(chat_id=chat_id, status="running").exists()


def queue_is_empty(redis_url: str) -> bool:
    return redis.Redis.from_url(redis_url).llen("memory") == 0


def queued_folds(queue: redis.Redis) -> int:
    """Consolidation tasks waiting in the memory queue (a fold's hooks wait there too)."""
    messages = (json.loads(raw) for raw in queue.lrange("memory", 0, -1))
    return sum(message["headers"]["task"] == "chatmem.consolidate_chat" for message in messages)


def test_burst_of_200_triggers_across_4_workers(
    require_postgres, broker, settings, user, use_fake_openai
) -> None:  # type: ignore[no-untyped-def]
    use_fake_openai.summarize_latency = 1.0  # runs overlap the whole burst
    settings.MEMORY_ENQUEUE_DEDUP_SECONDS = 0  # all 200 tasks reach the broker: the lock decides
    chat_id = chat_with_fold_due(user, settings)
    workers = [Worker(broker, f"burst{n}", env=model_env(use_fake_openai)) for n in range(4)]
    try:
        for worker in workers:
            worker.wait_ready()
        for _ in range(200):
            assert request_fold(chat_id, RequestReason.TURN)
        assert wait_until(
            lambda: (
                queue_is_empty(broker)
                and Brief.objects.get(chat_id=chat_id).last_consolidated > 0
                and use_fake_openai.counters()["in_flight"] == 0
            ),
            timeout=60,
        )
        # Let any rerun the burst chained finish, then measure.
        assert wait_until(
            lambda: not Consolidation.objects.filter(chat_id=chat_id, status="running").exists(),
            timeout=30,
        )
    finally:
        for worker in workers:
            worker.stop()
    summarize_calls = len(use_fake_openai.summarize_requests())
    assert use_fake_openai.counters()["max_in_flight"] == 1  # never two folds of the chat at once
    assert 1 <= summarize_calls <= 2
    assert Consolidation.objects.filter(chat_id=chat_id, status="succeeded").count() == 1
    assert chat_violations(chat_id) == []
    handled_by = {
        line.split("]")[0]
        for worker in workers
        for line in worker.log().splitlines()
        if "chatmem.consolidate_chat" in line and "succeeded" in line
    }
    assert handled_by, "no worker reported a finished task"
    contended = [w.name for w in workers if "lock busy, rerun marked" in w.log()]
    assert contended, "no task met the held lock: the burst did not test it"


def test_worker_killed_mid_llm_call_is_refolded_by_another_within_a_minute(
    require_postgres, broker, settings, user, use_fake_openai
) -> None:  # type: ignore[no-untyped-def]
    """Two workers; the one folding the chat is killed (SIGKILL to its process group, as an
    out-of-memory kill or a drained node) in the middle of its summarizer call. Its lock,
    no longer renewed, lapses within one TTL (3 s here); the recovery that beat runs every
    MEMORY_RECOVERY_INTERVAL_SECONDS marks the run interrupted and queues the chat, and the
    other worker folds it: well within a minute, with no failure counted for the chat."""
    use_fake_openai.summarize_latency = 3.0
    chat_id = chat_with_fold_due(user, settings)
    workers = [Worker(broker, f"pair{n}", env=model_env(use_fake_openai)) for n in range(2)]
    try:
        for worker in workers:
            worker.wait_ready()
        assert request_fold(chat_id, RequestReason.TURN)
        assert wait_until(lambda: use_fake_openai.counters()["in_flight"] == 1, timeout=30)
        [victim] = [w for w in workers if "Task chatmem.consolidate_chat[" in w.log()]
        victim.signal(signal.SIGKILL)
        killed_at = time.monotonic()
        victim.process.wait(timeout=10)
        brief = Brief.objects.get(chat_id=chat_id)
        assert (brief.last_consolidated, brief.version, brief.summary) == (0, 0, "")
        use_fake_openai.summarize_latency = 0.0

        def refolded() -> bool:
            tasks.recover_runs()  # what beat runs every MEMORY_RECOVERY_INTERVAL_SECONDS
            return Brief.objects.get(chat_id=chat_id).last_consolidated > 0

        assert wait_until(refolded, timeout=60, interval=1.0), [w.log() for w in workers]
        print(f"\nrefolded {time.monotonic() - killed_at:.1f} s after kill -9 (lock TTL 3 s)")
        tasks.recover_runs()  # the lock is free by now, whoever redid the fold
    finally:
        for worker in workers:
            worker.stop()
    assert Consolidation.objects.filter(chat_id=chat_id, status="succeeded").count() == 1
    # The killed run's ledger row says what happened to it, and the chat is not failing.
    killed = Consolidation.objects.get(chat_id=chat_id, status="interrupted")
    assert killed.error == "interrupted: worker died" and not ledger_running(chat_id)
    brief = Brief.objects.get(chat_id=chat_id)
    assert (brief.consecutive_failures, brief.degraded, brief.next_attempt_at) == (0, False, None)
    assert brief.version == 1
    assert chat_violations(chat_id) == []


def test_a_backlog_slower_than_the_time_limit_is_folded_chunk_by_chunk(
    require_postgres, broker, settings, user, use_fake_openai
) -> None:  # type: ignore[no-untyped-def]
    """A fold of 9 turns, every turn its own summarizer chunk, each call 1 s: longer than the
    task's 5 s soft time limit. Committed together, the chunks were thrown away at the limit by
    every attempt and the chat never folded; committed one by one, each task folds what fits
    and hands the rest on."""
    use_fake_openai.summarize_latency = 1.0
    settings.MEMORY_DISPATCH = "off"  # build the backlog without triggering anything
    api = client_for(user)
    body = {"policy": "sliding-window", "policy_overrides": {"tail_messages": 2, "window": 4}}
    chat_id = api.post("/api/v1/chats/", body, format="json").json()["id"]
    for number in range(10):  # 20 messages: 18 beyond the tail, under the hard limit (30)
        api.post(f"/api/v1/chats/{chat_id}/turns/", {"content": f"fact {number}"}, format="json")
    assert Brief.objects.get(chat_id=chat_id).last_consolidated == 0
    settings.MEMORY_DISPATCH = "celery"
    env = {**model_env(use_fake_openai), "MEMORY_SUMMARIZER_INPUT_BUDGET": "1"}
    worker = Worker(broker, "chunks", env=env)
    try:
        worker.wait_ready()
        assert request_fold(chat_id, RequestReason.TURN)
        # Until the backlog beyond the tail is under the window again: W = 16 of 18.
        assert wait_until(
            lambda: (
                Brief.objects.get(chat_id=chat_id).last_consolidated >= 16
                and not Consolidation.objects.filter(chat_id=chat_id, status="running").exists()
            ),
            timeout=60,
            interval=0.2,
        ), worker.log()
    finally:
        worker.stop()
    ledger = Consolidation.objects.filter(chat_id=chat_id)
    assert set(ledger.values_list("status", flat=True)) == {"succeeded"}
    assert ledger.count() == len(use_fake_openai.summarize_requests()) == 8
    assert chat_violations(chat_id) == []


def test_paused_worker_past_its_lock_writes_nothing(
    require_postgres, broker, settings, user, use_fake_openai
) -> None:  # type: ignore[no-untyped-def]
    use_fake_openai.summarize_latency = 2.0
    chat_id = chat_with_fold_due(user, settings)
    # The solo pool has no parent process enforcing time limits: a paused worker really comes
    # back later with a stale result (as after a VM pause), which only the fencing UPDATE stops.
    sleeper = Worker(broker, "sleeper", pool="solo", env=model_env(use_fake_openai))
    other = None
    try:
        sleeper.wait_ready()
        assert request_fold(chat_id, RequestReason.TURN)
        assert wait_until(lambda: use_fake_openai.counters()["in_flight"] == 1, timeout=30)
        sleeper.signal(signal.SIGSTOP)
        # The paused worker holds the chat's lock (3 s TTL, no longer renewed) in the test's
        # Redis db.
        test_redis, lock_key = redis.Redis.from_url(broker), RedisChatLock.key(chat_id)
        sleepers_token = test_redis.get(lock_key)
        assert sleepers_token is not None, "the paused worker holds no lock"
        use_fake_openai.summarize_latency = 0.0
        other = Worker(broker, "other", env=model_env(use_fake_openai))
        other.wait_ready()
        # Until the paused worker's lock TTL runs out: its token leaves the key.
        assert wait_until(
            lambda: test_redis.get(lock_key) != sleepers_token,
            timeout=30,
            interval=0.1,
        ), "the paused worker's lock never expired"

        def folded_by_other() -> bool:
            request_fold(chat_id, RequestReason.TURN)
            return Brief.objects.get(chat_id=chat_id).version == 1

        assert wait_until(folded_by_other, timeout=30, interval=1.0), other.log()
        committed = Brief.objects.get(chat_id=chat_id)
        sleeper.signal(signal.SIGCONT)
        assert wait_until(
            lambda: not Consolidation.objects.filter(chat_id=chat_id, status="running").exists(),
            timeout=30,
        ), sleeper.log()
    finally:
        sleeper.signal(signal.SIGCONT)
        sleeper.stop()
        if other is not None:
            other.stop()
    after = Brief.objects.get(chat_id=chat_id)
    assert (after.summary, after.version, after.last_consolidated) == (
        committed.summary,
        committed.version,
        committed.last_consolidated,
    )
    statuses = sorted(
        Consolidation.objects.filter(chat_id=chat_id).values_list("status", flat=True)
    )
    assert statuses == ["succeeded", "superseded"]
    assert chat_violations(chat_id) == []


def test_a_thousand_manual_fold_requests_on_one_chat(
    require_postgres, broker, settings, user, use_fake_openai
) -> None:  # type: ignore[no-untyped-def]
    """1,000 requests in a loop (the throttle raised out of the way; it has its own test): at
    most one task queued at a time, and one summarizer call for the one range that was due."""
    use_fake_openai.summarize_latency = 0.5  # requests keep coming while the fold runs
    settings.MEMORY_MANUAL_FOLD_RATE_LIMIT = ""
    chat_id = chat_with_fold_due(user, settings)
    api = client_for(user)
    queue = redis.Redis.from_url(broker)
    worker = Worker(broker, "manual", env=model_env(use_fake_openai))
    answers: Counter[str] = Counter()
    most_queued = 0
    try:
        worker.wait_ready()
        for _request in range(1000):
            response = api.post(f"/api/v1/chats/{chat_id}/consolidate/")
            assert response.status_code in (200, 202), response.content
            answers[response.json()["status"]] += 1
            most_queued = max(most_queued, queued_folds(queue))
        assert wait_until(
            lambda: (
                queue_is_empty(broker)
                and not ledger_running(chat_id)
                and use_fake_openai.counters()["in_flight"] == 0
            ),
            timeout=60,
        )
    finally:
        worker.stop()
    assert most_queued <= 1, answers
    folds = Consolidation.objects.filter(chat_id=chat_id).exclude(status="nothing_to_fold")
    ranges = list(folds.values_list("from_seq", "to_seq"))
    assert len(use_fake_openai.summarize_requests()) == len(ranges) == len(set(ranges)) == 1
    assert answers["queued"] >= 1 and answers["nothing_to_fold"] >= 1, answers
    assert chat_violations(chat_id) == []
