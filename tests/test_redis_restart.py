"""Redis crashes and comes back in the middle of a run (docs/design.md, the fold; docs/operations.md
"Redis lost"): 50 chats x 40 turns through the API with two real celery workers. Turns never need
Redis to answer, so every turn succeeds while it is down; the workers reconnect once it is back; the
queue, the locks and the pending set died with it (no persistence), so the sweep must re-drive every
chat with a fold due; at the end every chat has converged and its ledger holds.

A private redis-server on a free port is crashed and restarted: the shared one is never
touched. The full 50 x 40 of the issue, not scaled down: about 40 s on an idle 2-core machine
(most of it the 2000 turns, sent one after another from this process)."""

import contextlib
import logging
import socket
import threading
import time
from collections import Counter
from functools import partial

import pytest
from django.utils import timezone
from prometheus_client.registry import REGISTRY

from conversations.models import Brief, Chat, Consolidation, Message
from memory_worker import tasks
from memory_worker.coordination.request_redis import reset_breaker
from memory_worker.folding import execute as folds
from memory_worker.folding import ledger as fold_ledger
from memory_worker.folding.snapshot import load_snapshot
from tests.conftest import client_for, require
from tests.support.invariants import chat_violations
from tests.support.private_redis import PrivateRedis, redis_server_available
from tests.support.workers import FAST_DEADLINES, Worker, point_celery_at, wait_until

pytestmark = [pytest.mark.postgres, pytest.mark.redis, pytest.mark.worker]

CHATS, TURNS = 50, 40
# Redis is crashed at the first round of each outage and restarted at the second: once in the
# middle (turns go on after it is back, so the web process must reconnect too), once until after
# the last turn (nothing but the sweep can re-drive the chats left with a fold due).
OUTAGES = ((14, 22), (34, TURNS))
# contract folds every few turns, and a turn folds synchronously once it would pass the bound, so
# those chats keep the workers busy; sliding-window chats (window 12 beyond a 40-message tail)
# are left with a fold due by the last outage, as no turn folds them on the request path.
POLICIES = ("contract", "sliding-window")


@pytest.fixture
def private_redis():  # type: ignore[no-untyped-def]
    if not redis_server_available():
        require("redis-server", "the binary is not on PATH (apt-get install redis-server)")
    server = PrivateRedis()
    server.start()
    yield server
    server.stop()


@pytest.fixture
def broker(settings, private_redis):  # type: ignore[no-untyped-def]
    from memory_worker.coordination.runtime import _lock

    previous = point_celery_at(private_redis.url)
    settings.REDIS_URL = private_redis.url
    settings.MEMORY_DISPATCH = "celery"
    settings.MEMORY_LOCK_TTL_SECONDS = 8
    # The sweep this test drives looks at every chat with a backlog, however recent its fold.
    settings.MEMORY_SWEEP_MIN_COOLDOWN_SECONDS = 0
    _lock.cache_clear()
    yield private_redis
    point_celery_at(previous)
    _lock.cache_clear()


def fold_due(chat: Chat) -> bool:
    snapshot = load_snapshot(chat.pk)
    return folds.decide_for_chat(chat, snapshot, timezone.now()) is not None


def converged(chat_ids: list[int]) -> bool:
    """One beat tick (what beat runs every minute), then: no chat has a fold due."""
    tasks.sweep()
    chats = Chat.objects.filter(pk__in=chat_ids)
    return not any(fold_due(chat) for chat in chats)


def all_reconnected(workers: list[Worker], restarts: int) -> bool:
    """Each worker has connected to the broker once more than it started with, per restart."""
    return all(worker.log().count("Connected to redis") >= restarts + 1 for worker in workers)


def redis_down(round_number: int) -> bool:
    return any(first <= round_number < last for first, last in OUTAGES)


def test_redis_crash_and_restart_during_50_chats_x_40_turns(
    require_postgres, broker, settings, user, caplog
) -> None:  # type: ignore[no-untyped-def]
    caplog.set_level(logging.INFO, logger="chatmem.dispatch")
    workers = [Worker(broker.url, f"redis{n}", env=FAST_DEADLINES) for n in range(2)]
    api = client_for(user)
    acknowledged: Counter[int] = Counter()
    down_latencies: list[float] = []
    try:
        for worker in workers:
            worker.wait_ready()
        chat_ids = [
            api.post("/api/v1/chats/", {"policy": POLICIES[n % 2]}, format="json").json()["id"]
            for n in range(CHATS)
        ]
        started = time.monotonic()
        restarts = 0
        for round_number in range(TURNS + 1):
            if round_number in {first for first, _ in OUTAGES}:
                broker.crash()
            if round_number in {last for _, last in OUTAGES}:
                broker.start()
                restarted_at = timezone.now()
                restarts += 1
                if round_number < TURNS:
                    # The turns after a restart are for the workers to fold: wait until they are
                    # back (their reconnect backoff is 2 s, then 4 s). Without this, a fast turn
                    # loop ran the rounds before the next outage in about 3 s, no worker folded
                    # a sliding-window chat, and the turns folded them all synchronously at
                    # their bound, leaving nothing stranded for the sweep.
                    assert wait_until(
                        partial(all_reconnected, workers, restarts),
                        timeout=30,
                    ), [worker.log()[-3000:] for worker in workers]
            if round_number == TURNS:
                break
            for chat_id in chat_ids:
                sent = time.monotonic()
                response = api.post(
                    f"/api/v1/chats/{chat_id}/turns/",
                    {"content": f"chat {chat_id} round {round_number}: decided option A."},
                    format="json",
                )
                assert response.status_code == 201, (round_number, response.content)
                acknowledged[chat_id] += 1
                if redis_down(round_number):
                    down_latencies.append(time.monotonic() - sent)
        turns_seconds = time.monotonic() - started
        # Queued tasks, locks and pending marks died with Redis: only the sweep finds these.
        stranded = [chat.pk for chat in Chat.objects.filter(pk__in=chat_ids) if fold_due(chat)]
        assert stranded, "no chat was left with a fold due: the sweep was not put to the test"
        assert wait_until(lambda: converged(chat_ids), timeout=60, interval=1.0), [
            worker.log()[-3000:] for worker in workers
        ]
        converge_seconds = time.monotonic() - started - turns_seconds
    finally:
        for worker in workers:
            worker.stop()
    # While Redis was down, turns that made a fold due failed to queue it, fast, and said so.
    # Fast: no turn waits on the broker's connect timeout (or a retry). About half the turns
    # while it is down try to enqueue (each failure is logged), so a turn path that waited would
    # put hundreds of turns over it; a stray scheduling stall on a busy machine is one turn, not
    # 1 % of them. The allowance stays far below the failed enqueues, or the check proves nothing.
    # A turn that waited on the request timeout more than once (a retry, a second call) or on a
    # worker's longer broker timeout; one wait of 0.25 s is a busy machine's ordinary turn.
    connect_timeout = 4 * settings.REDIS_REQUEST_TIMEOUT_SECONDS
    slow_turns = sorted(latency for latency in down_latencies if latency >= connect_timeout)
    allowed_slow = len(down_latencies) // 100
    assert failed_enqueues(caplog) > 10 * allowed_slow, failed_enqueues(caplog)
    assert len(slow_turns) <= allowed_slow, (len(down_latencies), slow_turns)
    # The workers, not the turns' synchronous folds, folded the stranded chats after the restart.
    assert set(
        Consolidation.objects.filter(
            chat_id__in=stranded, status="succeeded", synchronous=False, started_at__gt=restarted_at
        )
        .exclude(worker=fold_ledger.WORKER_NAME)
        .values_list("chat_id", flat=True)
    ) == set(stranded)
    for chat_id in chat_ids:
        # Nothing lost: every acknowledged turn is stored (user + assistant), numbered 1..n.
        assert Message.objects.filter(chat_id=chat_id).count() == 2 * acknowledged[chat_id]
        assert chat_violations(chat_id) == []
    assert sum(acknowledged.values()) == CHATS * TURNS
    print(
        f"\n{CHATS}x{TURNS} turns in {turns_seconds:.1f} s, {len(stranded)} chats stranded "
        f"(turn latency while Redis was down: max {max(down_latencies) * 1000:.0f} ms, "
        f"{len(slow_turns)} of {len(down_latencies)} over {connect_timeout} s), "
        f"converged {converge_seconds:.1f} s after the last turn"
    )


def failed_enqueues(caplog) -> int:  # type: ignore[no-untyped-def]
    return sum(1 for record in caplog.records if getattr(record, "event", "") == "enqueue_failed")


class StalledRedis:
    """A "Redis" that accepts connections and reads what it is sent, and never answers: what a
    hung or overloaded server looks like to a client (a refused port fails at once instead)."""

    def __init__(self) -> None:
        self.listener = socket.create_server(("127.0.0.1", 0))
        self.url = f"redis://127.0.0.1:{self.listener.getsockname()[1]}/0"
        self.connections: list[socket.socket] = []
        self.stopped = threading.Event()
        threading.Thread(target=self.accept, daemon=True).start()

    def accept(self) -> None:
        while not self.stopped.is_set():
            try:
                connection, _ = self.listener.accept()
            except OSError:
                return
            self.connections.append(connection)
            threading.Thread(target=self.swallow, args=(connection,), daemon=True).start()

    @staticmethod
    def swallow(connection: socket.socket) -> None:
        with contextlib.suppress(OSError):
            while connection.recv(65536):
                pass

    def stop(self) -> None:
        self.stopped.set()
        self.listener.close()
        for connection in self.connections:
            with contextlib.suppress(OSError):
                connection.close()


def point_web_at(settings, url: str) -> None:  # type: ignore[no-untyped-def]
    """The web side (this process: throttle cache, queued markers, the broker) uses ``url``."""
    settings.REDIS_URL = url
    settings.CACHES = {
        "default": {
            "BACKEND": "django.core.cache.backends.redis.RedisCache",
            "LOCATION": url,
            "OPTIONS": {
                "socket_connect_timeout": settings.REDIS_REQUEST_TIMEOUT_SECONDS,
                "socket_timeout": settings.REDIS_REQUEST_TIMEOUT_SECONDS,
            },
        }
    }
    point_celery_at(url)


def sample(name: str) -> float:
    return REGISTRY.get_sample_value(name) or 0.0


def test_a_stalled_redis_holds_no_turn_and_the_sweep_folds_every_chat_after_it_recovers(
    require_postgres, broker, settings, user
) -> None:  # type: ignore[no-untyped-def]
    """Turns while Redis accepts and never answers: each succeeds, the first one to meet the
    stall waits one request timeout, and then the breaker skips the throttle and the enqueue
    (counted) instead of waiting again, and marks each chat whose fold it could not queue. Once
    Redis is back the sweep's first tick has the worker fold every chat with a fold due."""
    settings.TURN_RATE_LIMIT = "1000/min"
    settings.REDIS_BREAKER_SECONDS = 30.0
    settings.REDIS_REQUEST_TIMEOUT_SECONDS = 0.25  # the default the suite raises
    reset_breaker()
    worker = Worker(broker.url, "stalled", env=FAST_DEADLINES)
    stalled = StalledRedis()
    api = client_for(user)
    chats = 4
    try:
        worker.wait_ready()
        chat_ids = [
            api.post("/api/v1/chats/", {"policy": "sliding-window"}, format="json").json()["id"]
            for _ in range(chats)
        ]
        point_web_at(settings, stalled.url)
        skipped_before = sample("chatmem_enqueue_skipped_total")
        throttle_before = sample("chatmem_throttle_skipped_total")
        due: set[int] = set()
        turns = 0
        while len(due) < chats and turns < 60 * chats:
            for chat_id in set(chat_ids) - due:
                response = api.post(
                    f"/api/v1/chats/{chat_id}/turns/",
                    {"content": f"turn {turns}: we decided on option A."},
                    format="json",
                )
                assert response.status_code == 201, response.content
                turns += 1
                if fold_due(Chat.objects.get(pk=chat_id)):
                    due.add(chat_id)
        assert due == set(chat_ids), "no fold came due"
        # Every turn after the first timeout skipped both calls, and said so in the metrics.
        assert sample("chatmem_throttle_skipped_total") - throttle_before >= turns - 1
        assert sample("chatmem_enqueue_skipped_total") - skipped_before >= 1
        assert Consolidation.objects.filter(chat_id__in=chat_ids).count() == 0
        missed = Brief.objects.filter(chat_id__in=chat_ids, enqueue_missed_at__isnull=False)
        assert set(missed.values_list("chat_id", flat=True)) == set(chat_ids)
        # Redis is back; the sweep runs in the worker, a process with its own (closed) breaker.
        stalled.stop()
        point_web_at(settings, broker.url)
        reset_breaker()
        recovered_at = timezone.now()
        # The missed enqueues are taken at the first tick, however recent a chat's last fold.
        settings.MEMORY_SWEEP_MIN_COOLDOWN_SECONDS = 3600
        tasks.sweep()
        wait_until(
            lambda: not any(fold_due(chat) for chat in Chat.objects.filter(pk__in=chat_ids)),
            timeout=10.0,
            interval=0.2,
        )
        left = [chat.pk for chat in Chat.objects.filter(pk__in=chat_ids) if fold_due(chat)]
        assert left == [], worker.log()[-3000:]
    finally:
        stalled.stop()
        worker.stop()
        reset_breaker()
    # The worker folded them, after the recovery: no turn folded on the request path.
    assert set(
        Consolidation.objects.filter(
            chat_id__in=chat_ids, status="succeeded", synchronous=False, started_at__gt=recovered_at
        ).values_list("chat_id", flat=True)
    ) == set(chat_ids)
    for chat_id in chat_ids:
        assert chat_violations(chat_id) == []
