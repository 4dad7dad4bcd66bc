"""The beat sweep (memory_worker/scheduling/sweep.py and the sweep task): the chats it queues
(retries due, chats whose fold could not be queued, cooled chats with a fold due, chats marked
pending whose run died), its rotation through every chat, the runs a killed worker left "running",
one chat unable to cancel the sweep (deleted or failing while judged), and the sweep's own queue,
which memory workers consume."""

import json
import logging
import re
import shlex
import threading
import time
from collections.abc import Iterator
from datetime import timedelta
from types import SimpleNamespace
from typing import Any

import pytest
from django.core.cache import cache
from django.db import connection
from django.db.models.functions import Now
from django.utils import timezone

from conversations.models import Brief, Chat, Consolidation
from conversations.rows import database_now
from memory_worker import tasks
from memory_worker.coordination import deadlines, request_redis
from memory_worker.coordination.dispatch import RequestReason
from memory_worker.coordination.locks import LocalChatLock
from memory_worker.folding import execute as folds
from memory_worker.folding import ledger as fold_ledger
from memory_worker.folding import retries
from memory_worker.scheduling import runs, sweep
from memory_worker.summaries.contract import SummaryResult
from tests.conftest import contract_chat_after_turns
from tests.support.workers import ROOT, Worker, point_celery_at, wait_until
from tests.test_fold_guard import room_for_one_more, rules_only
from tests.test_folds import new_chat, turns


def turn(api, chat_id: int) -> None:  # type: ignore[no-untyped-def]
    response = api.post(f"/api/v1/chats/{chat_id}/turns/", {"content": "hi"}, format="json")
    assert response.status_code == 201, response.content


def cooled_due_chat(api, now):  # type: ignore[no-untyped-def]
    """A chat the sweep queues: 4 messages beyond a 2-message tail, last fold an hour ago."""
    chat_id = new_chat(api, policy="sliding-window", policy_overrides={"tail_messages": 2})
    turn(api, chat_id)
    turn(api, chat_id)
    hour_ago = now - timedelta(hours=1)
    Chat.objects.filter(pk=chat_id).update(created_at=hour_ago)
    Brief.objects.filter(chat_id=chat_id).update(last_consolidated_at=hour_ago)
    return chat_id


@pytest.fixture
def sweep_recorder(monkeypatch) -> Iterator[dict[str, list[Any]]]:  # type: ignore[no-untyped-def]
    """tasks.sweep with a local lock, recording what it queues and whether it replayed the
    daily-notes hooks."""
    cache.delete(sweep.SWEEP_CURSOR_KEY)
    lock = LocalChatLock(ttl_seconds=30)
    monkeypatch.setattr(tasks, "chat_lock", lambda: lock)
    seen: dict[str, list[Any]] = {"requested": [], "replayed": [], "lock": [lock]}
    monkeypatch.setattr(
        tasks, "request_fold", lambda chat_id, trigger: seen["requested"].append(chat_id)
    )
    monkeypatch.setattr(tasks.hooks, "replay_missed_daily_notes", seen["replayed"].append)
    yield seen
    cache.delete(sweep.SWEEP_CURSOR_KEY)


# --- The chats it queues ------------------------------------------------------------------


@pytest.mark.django_db
def test_sweep_finds_cooled_due_and_stranded_chats(api, settings) -> None:  # type: ignore[no-untyped-def]
    lock = LocalChatLock(ttl_seconds=30)
    now = timezone.now()
    cooled = new_chat(api)  # sliding-window: 42 messages = backlog 2, cooldown 900 s
    turns(api, cooled, 21)
    quiet = new_chat(api)  # 4 messages: nothing beyond the 40-message tail
    turns(api, quiet, 2)
    failing = new_chat(api)
    Brief.objects.filter(chat_id=failing).update(next_attempt_at=now - timedelta(seconds=1))
    stranded = new_chat(api)
    lock.mark_pending(stranded)  # its run died after marking a rerun
    Chat.objects.filter(pk=cooled).update(created_at=now - timedelta(seconds=901))
    found = sweep.sweep_candidates(now, lock, limit=100)
    assert sorted(found) == sorted([cooled, failing, stranded])
    # Not yet cooled down: not a candidate.
    Chat.objects.filter(pk=cooled).update(created_at=now - timedelta(seconds=899))
    assert cooled not in sweep.sweep_candidates(now, lock, limit=100)
    # Folds paused by the owner: neither its cooldown nor its retry is the sweep's.
    Chat.objects.filter(pk=cooled).update(created_at=now - timedelta(seconds=901))
    Chat.objects.filter(pk__in=[cooled, failing]).update(folds_paused=True)
    cache.delete(sweep.SWEEP_CURSOR_KEY)
    lock.mark_pending(stranded)  # the first sweep took its mark; stranded again
    assert sweep.sweep_candidates(now, lock, limit=100) == [stranded]


@pytest.mark.django_db
def test_a_fold_that_could_not_be_queued_is_swept_at_the_next_tick_whatever_its_last_folds_age(  # type: ignore[no-untyped-def]
    api, settings
):
    """A turn whose enqueue the breaker skipped (Redis timed out) marks its chat; the sweep takes
    it at once, though its last fold is younger than MEMORY_SWEEP_MIN_COOLDOWN_SECONDS, and
    clears the mark. A marked chat with nothing due is cleared and not queued; a miss marked
    after the sweep began stays for the next tick."""
    settings.MEMORY_DISPATCH, settings.MEMORY_SWEEP_MIN_COOLDOWN_SECONDS = "off", 60
    lock = LocalChatLock(ttl_seconds=30)
    # No cooldown: 8 messages, 2 over its tail of 6 (over tail + buffer, under the bound).
    due = new_chat(api, policy="contract", policy_overrides={"overflow_buffer": 1})
    turns(api, due, 4)
    Brief.objects.filter(chat_id=due).update(last_consolidated_at=Now())
    quiet = new_chat(api)
    settings.MEMORY_DISPATCH = "celery"
    assert sweep.sweep_candidates(database_now(), lock, limit=100) == []
    request_redis.trip_if_timeout(TimeoutError("Redis stalled"))
    assert not runs.request_fold(due, RequestReason.TURN)
    assert not runs.request_fold(quiet, RequestReason.TURN)
    assert Brief.objects.get(chat_id=due).enqueue_missed_at is not None
    request_redis.reset_breaker()

    assert sweep.sweep_candidates(database_now(), lock, limit=100) == [due]
    assert not Brief.objects.filter(enqueue_missed_at__isnull=False).exists()
    before = database_now()
    Brief.objects.filter(chat_id=due).update(enqueue_missed_at=Now())
    sweep.missed_enqueues(before, limit=100)
    assert Brief.objects.get(chat_id=due).enqueue_missed_at is not None


@pytest.mark.django_db
def test_the_sweep_reaches_every_chat_however_many_have_nothing_due(api) -> None:  # type: ignore[no-untyped-def]
    """Chats with unfolded messages and nothing due (most chats: a tail not yet full) do not
    fill every sweep's batch, never-folded ones first: the sweep rotates through the chats, so
    a chat whose fold fell due after its turns (a failed enqueue, a cooldown) is reached."""
    cache.delete(sweep.SWEEP_CURSOR_KEY)
    lock = LocalChatLock(ttl_seconds=30)
    now = timezone.now()
    idle = []
    for _ in range(12):
        idle.append(new_chat(api))
        turns(api, idle[-1], 1)  # 2 messages: nothing due, never folded
    due = new_chat(api)  # the highest id: the rotation reaches it last
    turns(api, due, 21)  # 42 messages: the cooldown fold is due once 900 s have passed
    long_ago = now - timedelta(seconds=1000)
    Chat.objects.filter(pk=due).update(created_at=long_ago)
    Brief.objects.filter(chat_id=due).update(last_consolidated_at=long_ago)
    sweeps = [sweep.sweep_candidates(now, lock, limit=5) for _ in range(3)]
    assert sweeps[:2] == [[], []]
    assert sweeps[2] == [due]
    # The third sweep wrapped around to the two lowest ids: the next goes on from there.
    assert sweep.next_cooled_candidates(now, 5) == idle[2:7]
    # Chats whose retry is due take the batch first; the rotation judges only what fits after
    # them (a due chat judged and cut off would wait a whole round), and stays where it was.
    Brief.objects.filter(chat_id__in=idle[:4]).update(next_attempt_at=now - timedelta(seconds=1))
    assert sorted(sweep.sweep_candidates(now, lock, limit=5)) == sorted(idle[:4])
    Brief.objects.filter(chat_id__in=idle[:5]).update(next_attempt_at=now - timedelta(seconds=1))
    assert sorted(sweep.sweep_candidates(now, lock, limit=5)) == sorted(idle[:5])
    assert sweep.next_cooled_candidates(now, 5) == [*idle[8:12], due]


# --- Runs whose worker died --------------------------------------------------------------


def running_row(
    chat_id: int, *, age: float = 0.0, beating: bool = False, **fields: Any
) -> Consolidation:
    """A ledger row left "running", started ``age`` seconds ago; its heartbeat stopped then,
    older than the bound (a dead fold's), unless ``beating`` (a live fold's, renewed just now)."""
    values = {"trigger": "turn", "from_seq": 1, "to_seq": 2, "base_version": 0, **fields}
    row = Consolidation.objects.create(chat_id=chat_id, **values)
    started_at = timezone.now() - timedelta(seconds=age)
    stopped = timezone.now() - timedelta(
        seconds=max(age, deadlines.fold_heartbeat_stale_after() + 1)
    )
    Consolidation.objects.filter(pk=row.pk).update(
        started_at=started_at, heartbeat_at=timezone.now() if beating else stopped
    )
    return row


def status_of(row: Consolidation) -> str:
    row.refresh_from_db()
    return row.status


@pytest.mark.django_db
def test_a_running_row_whose_heartbeat_stopped_is_interrupted_and_refolded_at_once(api) -> None:  # type: ignore[no-untyped-def]
    """A live fold renews its row's heartbeat before each summarizer call: a running row whose
    heartbeat is older than the bound died with its worker, whether or not the chat's lock is
    held (another run may have taken it since). It is not the chat's failure: no count, no
    backoff, and the chat is folded again at once (a manual fold stays manual)."""
    lock = LocalChatLock(ttl_seconds=30)
    dead, live, manual = new_chat(api), new_chat(api), new_chat(api)
    dead_row = running_row(dead)
    live_row = running_row(live, beating=True)
    manual_row = running_row(manual, trigger="manual")
    assert lock.acquire_or_mark_pending(manual, "a-later-run")
    now = timezone.now()
    refolds = sweep.recover_dead_runs(now)
    assert refolds == [
        sweep.Refold(dead, RequestReason.SWEEP),
        sweep.Refold(manual, RequestReason.MANUAL),
    ]
    assert (status_of(dead_row), status_of(live_row), status_of(manual_row)) == (
        "interrupted",
        "running",
        "interrupted",
    )
    assert dead_row.error == "interrupted: worker died" and dead_row.finished_at is not None
    brief = Brief.objects.get(chat_id=dead)
    assert (brief.consecutive_failures, brief.next_attempt_at, brief.degraded) == (0, None, False)
    assert brief.last_error == ""
    # Once its heartbeat stops (the run died without finishing its row), the live row too.
    stopped = Now() - timedelta(seconds=deadlines.fold_heartbeat_stale_after() + 1)
    Consolidation.objects.filter(pk=live_row.pk).update(heartbeat_at=stopped)
    assert sweep.recover_dead_runs(timezone.now()) == [sweep.Refold(live, RequestReason.SWEEP)]


@pytest.mark.django_db
def test_a_turns_fold_whose_heartbeat_stopped_is_interrupted_and_left_to_the_next_turn(  # type: ignore[no-untyped-def]
    api,
):
    """A turn's fold, which may fold without the lock, is judged by its heartbeat too, in
    database time; one that died with its web process is not the background's to redo. A row
    from before heartbeats is judged by its start."""
    bound = deadlines.fold_heartbeat_stale_after()
    chat_id = new_chat(api)
    young_turn = running_row(chat_id, synchronous=True, beating=True)
    old_turn = running_row(chat_id, age=bound + 5, synchronous=True)
    old_unstamped = running_row(chat_id, age=bound + 5)
    young_unstamped = running_row(chat_id, age=bound - 5)
    Consolidation.objects.filter(pk__in=[old_unstamped.pk, young_unstamped.pk]).update(
        heartbeat_at=None
    )
    assert sweep.recover_dead_runs(timezone.now()) == [sweep.Refold(chat_id, RequestReason.SWEEP)]
    assert [status_of(row) for row in (young_turn, old_turn, old_unstamped, young_unstamped)] == [
        "running",
        "interrupted",
        "interrupted",
        "running",
    ]
    assert Brief.objects.get(chat_id=chat_id).consecutive_failures == 0


@pytest.mark.django_db
def test_a_fold_that_kills_its_worker_three_times_in_a_row_counts_as_a_crash(api) -> None:  # type: ignore[no-untyped-def]
    """Out of memory on every attempt: retried at once twice, then counted on the brief like a
    crash (backoff, then degraded) instead of being retried at once for ever. A committed or
    failed fold between the deaths starts the count again."""
    chat_id = new_chat(api)
    for _ in range(retries.CRASH_AFTER_INTERRUPTIONS - 1):
        running_row(chat_id)
        assert sweep.recover_dead_runs(timezone.now()) == [
            sweep.Refold(chat_id, RequestReason.SWEEP)
        ]
    third = running_row(chat_id)
    now = timezone.now()
    assert sweep.recover_dead_runs(now) == []
    assert (status_of(third), third.error) == ("failed", "abandoned: worker died")
    brief = Brief.objects.get(chat_id=chat_id)
    assert (brief.consecutive_failures, brief.last_error) == (1, third.error)
    assert brief.next_attempt_at is not None and brief.next_attempt_at > now
    fourth = running_row(chat_id)  # still dying: still counted
    assert sweep.recover_dead_runs(timezone.now()) == []
    assert status_of(fourth) == "failed"
    assert Brief.objects.get(chat_id=chat_id).consecutive_failures == 2
    # A fold that finished (here: failed on the model) ends the streak; a turn's fold that
    # died with its web process neither counts nor ends it.
    Consolidation.objects.create(
        chat_id=chat_id, trigger="turn", from_seq=1, to_seq=2, base_version=0, status="failed"
    )
    running_row(chat_id, age=10_000, synchronous=True)
    fifth = running_row(chat_id)
    assert sweep.recover_dead_runs(timezone.now()) == [sweep.Refold(chat_id, RequestReason.SWEEP)]
    assert status_of(fifth) == "interrupted"


@pytest.mark.django_db
def test_a_run_that_finishes_or_beats_while_the_recovery_looks_keeps_its_outcome(  # type: ignore[no-untyped-def]
    api, monkeypatch
):
    """The recovery reads the stale rows, then marks each with a conditional UPDATE: a run that
    commits in between keeps its outcome, and one that renews its heartbeat in between (alive
    after all) stays running."""
    finished, beat = new_chat(api), new_chat(api)
    finished_row, beat_row = running_row(finished), running_row(beat)
    real = sweep.interrupt_run

    def meanwhile(ledger, now):  # type: ignore[no-untyped-def]
        if ledger.pk == finished_row.pk:
            Consolidation.objects.filter(pk=ledger.pk).update(status="succeeded")
        else:
            assert fold_ledger.beat(ledger)
        return real(ledger, now)

    monkeypatch.setattr(sweep, "interrupt_run", meanwhile)
    assert sweep.recover_dead_runs(timezone.now()) == []
    assert (status_of(finished_row), status_of(beat_row)) == ("succeeded", "running")


@pytest.mark.django_db
def test_the_recovery_task_queues_the_dead_runs_chats(api, sweep_recorder) -> None:  # type: ignore[no-untyped-def]
    chat_id = new_chat(api)
    running_row(chat_id)
    assert tasks.recover_runs() == 1
    assert sweep_recorder["requested"] == [chat_id]
    assert tasks.sweep() == 0  # the row is marked: the sweep has nothing more to recover


# --- One chat cannot cancel the sweep ----------------------------------------------------


@pytest.mark.django_db
def test_a_chat_deleted_while_the_sweep_judges_it_is_skipped(api, monkeypatch, sweep_recorder):  # type: ignore[no-untyped-def]
    """A Chat.DoesNotExist raised out of the sweep would leave the retry-due and pending chats
    already chosen unqueued and skip the daily-notes replay: the deleted chat is skipped, the
    rest queued."""
    now = timezone.now()
    failing = new_chat(api)  # its retry is due
    Brief.objects.filter(chat_id=failing).update(next_attempt_at=now - timedelta(seconds=1))
    stranded = new_chat(api)
    sweep_recorder["lock"][0].mark_pending(stranded)  # its run died after marking a rerun
    doomed = cooled_due_chat(api, now)
    due = cooled_due_chat(api, now)
    real = sweep.next_cooled_candidates

    def candidates_then_delete(at, limit):  # type: ignore[no-untyped-def]
        found = real(at, limit)
        assert found == [doomed, due]
        Chat.objects.filter(pk=doomed).delete()  # DELETE /api/v1/chats/{id}/ lands here
        return found

    monkeypatch.setattr(sweep, "next_cooled_candidates", candidates_then_delete)
    assert tasks.sweep() == 3
    assert sorted(sweep_recorder["requested"]) == sorted([failing, stranded, due])
    assert len(sweep_recorder["replayed"]) == 1


@pytest.mark.django_db
def test_an_error_judging_one_chat_is_logged_and_skips_only_that_chat(  # type: ignore[no-untyped-def]
    api, monkeypatch, sweep_recorder, caplog
):
    now = timezone.now()
    failing = new_chat(api)
    Brief.objects.filter(chat_id=failing).update(next_attempt_at=now - timedelta(seconds=1))
    broken = cooled_due_chat(api, now)  # the lower id: judged first
    due = cooled_due_chat(api, now)
    real = folds.decide_for_chat

    def decide(chat, snapshot, at, **kwargs):  # type: ignore[no-untyped-def]
        if chat.pk == broken:
            raise RuntimeError("policy blew up on this chat")
        return real(chat, snapshot, at, **kwargs)

    monkeypatch.setattr(sweep, "decide_for_chat", decide)
    with caplog.at_level(logging.ERROR, logger="chatmem.fold"):
        assert tasks.sweep() == 2
    assert sorted(sweep_recorder["requested"]) == sorted([failing, due])
    assert len(sweep_recorder["replayed"]) == 1
    [record] = [r for r in caplog.records if getattr(r, "event", "") == "sweep_error"]
    assert getattr(record, "chat_id", None) == broken
    assert record.exc_info is not None


@pytest.mark.django_db
def test_an_error_abandoning_one_run_does_not_cancel_the_sweep(  # type: ignore[no-untyped-def]
    api, monkeypatch, sweep_recorder
):
    now = timezone.now()
    failing = new_chat(api)
    Brief.objects.filter(chat_id=failing).update(next_attempt_at=now - timedelta(seconds=1))
    first, second = new_chat(api), new_chat(api)
    dead = {}
    for chat_id in (first, second):  # a fold that killed its worker a third time in a row
        for _ in range(retries.CRASH_AFTER_INTERRUPTIONS - 1):
            Consolidation.objects.create(
                chat_id=chat_id,
                trigger="turn",
                from_seq=1,
                to_seq=2,
                base_version=0,
                status="interrupted",
            )
        dead[chat_id] = running_row(chat_id, age=86_400)
    real = retries.fail_brief

    def fail_brief(ledger, *args):  # type: ignore[no-untyped-def]
        if ledger.chat_id == first:
            raise RuntimeError("brief update blew up")
        return real(ledger, *args)

    monkeypatch.setattr(sweep, "fail_brief", fail_brief)
    tasks.sweep()
    # The run whose count failed stays running, so the next sweep counts it: marked failed
    # alone, no sweep would have counted it again.
    assert (status_of(dead[first]), status_of(dead[second])) == ("running", "failed")
    assert Brief.objects.get(chat_id=first).consecutive_failures == 0
    assert Brief.objects.get(chat_id=second).consecutive_failures == 1
    assert failing in sweep_recorder["requested"]
    assert len(sweep_recorder["replayed"]) == 1


# --- The sweep's own queue ---------------------------------------------------------------


def test_the_sweep_is_routed_to_its_own_queue_which_memory_workers_consume() -> None:
    from celery.app.amqp import Queues

    from chatmem_project.celery import app, consume_the_sweep_queue

    options = app.conf.beat_schedule["chatmem-sweep"]["options"]
    assert options["queue"] == "memory-sweep"
    assert app.amqp.router.route(dict(options), "chatmem.sweep")["queue"].name == "memory-sweep"
    assert app.amqp.router.route({}, "chatmem.sweep")["queue"].name == "memory-sweep"
    assert app.amqp.router.route({}, "chatmem.consolidate_chat")["queue"].name == "memory"
    # A worker started with `-Q memory` (docker-compose.yml, docs, tests/support/workers.py, README)
    # consumes the sweep's queue too; a worker of some other queue is left alone.
    for selected, expected in ((["memory"], {"memory", "memory-sweep"}), (["other"], {"other"})):
        queues = Queues(create_missing=True)
        queues.select(selected)
        consume_the_sweep_queue(
            instance=SimpleNamespace(app=SimpleNamespace(amqp=SimpleNamespace(queues=queues)))
        )
        assert set(queues.consume_from) == expected
    compose = (ROOT / "docker-compose.yml").read_text()
    [worker] = [
        shlex.split(line)
        for line in re.findall(r"^\s+command: (celery .* worker .+)$", compose, re.M)
    ]
    assert "memory" in worker[worker.index("-Q") + 1].split(",")


@pytest.fixture
def celery_broker(settings, clean_redis):  # type: ignore[no-untyped-def]
    """Publish from the test process to the test Redis, as beat and the web process would."""
    previous = point_celery_at(clean_redis)
    settings.REDIS_URL = clean_redis
    settings.MEMORY_DISPATCH = "celery"
    yield clean_redis
    point_celery_at(previous)


def received_task_names(worker: Worker) -> list[str]:
    names = []
    for line in worker.log().splitlines():
        try:
            record = json.loads(line)
        except ValueError:
            continue
        if record.get("logger") == "celery.worker.strategy" and "received" in record["msg"]:
            names.append(record["data"]["name"])
    return names


@pytest.mark.postgres
@pytest.mark.redis
@pytest.mark.worker
def test_a_worker_reaches_the_sweep_before_draining_the_fold_backlog(  # type: ignore[no-untyped-def]
    require_postgres, celery_broker
):
    """On the FIFO memory queue, beat's sweep would wait behind every fold task: behind more
    than one interval of backlog it would expire before a worker reached it, every minute,
    exactly while the workers catch up. On its own queue, a worker (as tests/support/workers.py and
    docker-compose.yml start it: `-Q memory`) takes it after at most one fold task."""
    from chatmem_project.celery import app

    backlog = 30
    for number in range(backlog):  # chats that do not exist: each task is a quick "nothing"
        tasks.fold_chat.apply_async(args=(10**9 + number, "turn"))
    tasks.sweep.apply_async(**app.conf.beat_schedule["chatmem-sweep"]["options"])  # as beat does
    worker = Worker(celery_broker, "sweepq")
    try:
        worker.wait_ready()
        assert wait_until(lambda: len(received_task_names(worker)) == backlog + 1, 30), worker.log()
        names = received_task_names(worker)
        assert names.index("chatmem.sweep") <= 1, names
        assert wait_until(
            lambda: "chatmem.sweep[" in worker.log() and '"event": "sweep"' in worker.log(), 10
        ), worker.log()
    finally:
        worker.stop()


# --- Catching up when the provider recovers (memory_worker/scheduling/recovery.py) ------------


def failed_an_hour_ago(api, now, kind: str, minutes_ago: int):  # type: ignore[no-untyped-def]
    """A chat whose last fold failed with ``kind`` and waits an hour for its retry."""
    chat_id = new_chat(api)
    Brief.objects.filter(chat_id=chat_id).update(
        failure_kind=kind,
        consecutive_failures=3,
        degraded=True,
        next_attempt_at=now + timedelta(hours=1),
        updated_at=now - timedelta(minutes=minutes_ago),
    )
    return chat_id


def succeeded_fold(chat_id: int, finished_at, trigger: str = "window") -> None:  # type: ignore[no-untyped-def]
    Consolidation.objects.create(
        chat_id=chat_id, trigger=trigger, status="succeeded", from_seq=1, to_seq=2,
        base_version=0, finished_at=finished_at, summarizer_calls=1,
    )  # fmt: skip


@pytest.mark.django_db
def test_provider_wide_failures_retry_once_a_model_fold_succeeds_and_content_ones_wait(
    api, sweep_recorder
) -> None:  # type: ignore[no-untyped-def]
    now = timezone.now()
    quota = failed_an_hour_ago(api, now, "quota", minutes_ago=10)
    outage = failed_an_hour_ago(api, now, "server_error", minutes_ago=5)
    malformed = failed_an_hour_ago(api, now, "malformed", minutes_ago=20)
    # No model fold has succeeded since: one probe, the provider-wide failure waiting longest.
    assert tasks.sweep() == 1
    assert sweep_recorder["requested"] == [quota]
    # A fallback's success is the offline summarizer's: the provider may still be down.
    Brief.objects.filter(chat_id=quota).update(next_attempt_at=now + timedelta(hours=1))
    succeeded_fold(malformed, now - timedelta(minutes=1), trigger="summarizer_fallback")
    sweep_recorder["requested"].clear()
    tasks.sweep()
    assert sweep_recorder["requested"] == [quota]  # the probe again, not everyone
    # A model fold succeeded after both provider failures: both retry now; the content failure
    # keeps its ladder (another chat's success says nothing about its input).
    Brief.objects.filter(chat_id=quota).update(next_attempt_at=now + timedelta(hours=1))
    succeeded_fold(malformed, now - timedelta(minutes=1))
    sweep_recorder["requested"].clear()
    tasks.sweep()
    assert sorted(sweep_recorder["requested"]) == sorted([quota, outage])
    waiting = Brief.objects.get(chat_id=malformed).next_attempt_at
    assert waiting is not None and waiting > timezone.now()


def failed_in_a_row(api, now, *kinds: str, minutes_ago: int) -> int:  # type: ignore[no-untyped-def]
    """A chat whose last folds failed with ``kinds`` (oldest first) and waits an hour."""
    chat_id = failed_an_hour_ago(api, now, kinds[-1], minutes_ago)
    for kind in kinds:
        Consolidation.objects.create(
            chat_id=chat_id, trigger="window", status="failed", from_seq=1, to_seq=2,
            base_version=0, error_kind=kind, finished_at=now - timedelta(minutes=minutes_ago),
        )  # fmt: skip
    Brief.objects.filter(chat_id=chat_id).update(consecutive_failures=len(kinds))
    return chat_id


@pytest.mark.django_db
def test_once_the_provider_answers_every_chat_behind_the_outage_retries_whatever_its_last_kind(
    api, sweep_recorder
) -> None:  # type: ignore[no-untyped-def]
    """A chat whose last failure came amid the outage (a crash, a truncated answer after a
    429) is behind the provider as much as one whose last failure was the 429: once a model
    fold succeeds, it retries now. While none has, one probe a sweep. The same failure of the
    chat's own twice in a row keeps its ladder."""
    now = timezone.now()
    crashed = failed_in_a_row(api, now, "rate_limit", "crash", minutes_ago=30)
    truncated = failed_in_a_row(api, now, "server_error", "rate_limit", "truncated", minutes_ago=20)
    limited = failed_in_a_row(api, now, "rate_limit", minutes_ago=10)
    persistent = failed_in_a_row(api, now, "rate_limit", "malformed", "malformed", minutes_ago=25)
    crashing = failed_in_a_row(api, now, "crash", "crash", minutes_ago=40)
    assert tasks.sweep() == 1
    assert sweep_recorder["requested"] == [crashed]  # the probe: waiting longest
    Brief.objects.filter(chat_id=crashed).update(next_attempt_at=now + timedelta(hours=1))
    succeeded_fold(limited, now - timedelta(minutes=1))
    sweep_recorder["requested"].clear()
    tasks.sweep()
    assert sorted(sweep_recorder["requested"]) == sorted([crashed, truncated, limited])
    for chat_id in (persistent, crashing):
        waiting = Brief.objects.get(chat_id=chat_id).next_attempt_at
        assert waiting is not None and waiting > timezone.now()


@pytest.mark.django_db
def test_a_summary_edit_during_an_outage_is_not_the_provider_recovering(
    api, sweep_recorder
) -> None:  # type: ignore[no-untyped-def]
    """An edit's ledger row (trigger ``edit``, no summarizer call) succeeds without the
    provider: the chats waiting on it keep to the one probe a sweep, not all retried at once."""
    from memory_worker.folding.summary_edit import edit_summary

    now = timezone.now()
    first = failed_an_hour_ago(api, now, "server_error", minutes_ago=10)
    second = failed_an_hour_ago(api, now, "rate_limit", minutes_ago=5)
    edited = new_chat(api)
    edit_summary(Chat.objects.get(pk=edited), "- Call me Sam", 0, editor="someone")
    assert Consolidation.objects.filter(chat_id=edited, status="succeeded").exists()
    assert tasks.sweep() == 1
    assert sweep_recorder["requested"] == [first]  # the probe only
    waiting = Brief.objects.get(chat_id=second).next_attempt_at
    assert waiting is not None and waiting > timezone.now()


@pytest.mark.django_db
def test_the_sweep_deletes_old_ledger_rows_that_prove_nothing(api, settings) -> None:  # type: ignore[no-untyped-def]
    """Failed, superseded, interrupted and nothing-to-fold rows older than the retention go;
    succeeded rows (they prove coverage), running rows and recent rows stay."""
    settings.MEMORY_LEDGER_RETENTION_DAYS = 30
    chat_id = new_chat(api)
    old, recent = timezone.now() - timedelta(days=31), timezone.now() - timedelta(days=29)
    kept: list[int] = []
    pruned: list[int] = []
    for status in ("succeeded", "failed", "superseded", "interrupted", "nothing_to_fold"):
        for finished_at in (old, recent):
            row = Consolidation.objects.create(
                chat_id=chat_id,
                trigger="window",
                status=status,
                from_seq=1,
                to_seq=2,
                base_version=0,
                finished_at=finished_at,
            )
            (pruned if status != "succeeded" and finished_at == old else kept).append(row.pk)
    running = Consolidation.objects.create(
        chat_id=chat_id, trigger="window", from_seq=1, to_seq=2, base_version=0
    )
    settings.MEMORY_LEDGER_RETENTION_DAYS = 0  # keep everything
    assert fold_ledger.prune_ledger() == 0
    settings.MEMORY_LEDGER_RETENTION_DAYS = 30
    assert fold_ledger.prune_ledger() == len(pruned) == 4
    assert set(Consolidation.objects.values_list("pk", flat=True)) == {*kept, running.pk}


@pytest.mark.django_db
def test_the_sweep_leaves_a_held_chats_pending_mark_to_its_holder(api, monkeypatch) -> None:  # type: ignore[no-untyped-def]
    """A live holder serves its chat's mark when it releases; the sweep takes only the marks
    no run holds, once, so the rerun is asked for once, by whoever takes the mark first."""
    from memory_worker.scheduling import runs

    lock = LocalChatLock(ttl_seconds=30)
    now = timezone.now()
    held, stranded = new_chat(api), new_chat(api)
    assert lock.acquire_or_mark_pending(held, "its-run")
    lock.mark_pending(held)  # a request during the run
    lock.mark_pending(stranded)  # its run died after marking a rerun
    assert sweep.sweep_candidates(now, lock, limit=100) == [stranded]
    assert sweep.sweep_candidates(now, lock, limit=100) == []  # taken: not asked for twice
    asked: list[tuple[int, str]] = []

    def request(chat_id: int, trigger: str, due_at: object) -> bool:
        asked.append((chat_id, trigger))
        return True

    monkeypatch.setattr(runs, "request_fold", request)
    assert lock.release(held, "its-run")
    runs.hand_on_pending(held, lock, RequestReason.RERUN, None)  # the holder's exit
    runs.hand_on_pending(held, lock, RequestReason.RERUN, None)
    assert asked == [(held, "rerun")]
    assert sweep.sweep_candidates(now, lock, limit=100) == []


# --- Host clocks -----------------------------------------------------------------------------


def skew_clock(monkeypatch, seconds: float) -> None:  # type: ignore[no-untyped-def]
    """This process's clock ``seconds`` off, as the preload
    tests/support/skewed_clock/sitecustomize.py makes a whole subprocess's
    (tests/test_host_clocks.py: web servers, workers, sweeps)."""
    monkeypatch.setattr(timezone, "now", lambda: REAL_NOW() + timedelta(seconds=seconds))


REAL_NOW = timezone.now


@pytest.mark.django_db
def test_a_live_fold_stamped_by_a_slow_clock_is_not_abandoned_by_a_fast_one(  # type: ignore[no-untyped-def]
    api, settings, monkeypatch
):
    """A turn's fold on a host 5 minutes slow, judged by a sweep on a host 5 minutes fast: the
    row's start and heartbeat and the sweep's now are all the database's, so the live row
    stays running."""
    settings.MEMORY_LLM_TIMEOUT_SECONDS, settings.MEMORY_LOCK_TTL_SECONDS = 3, 3
    chat_id = new_chat(api)
    skew_clock(monkeypatch, -300)
    ledger = Consolidation(
        chat_id=chat_id, trigger="turn", from_seq=1, to_seq=2, base_version=0, synchronous=True
    )
    fold_ledger.record_running(ledger)
    skew_clock(monkeypatch, +300)
    assert sweep.recover_dead_runs(database_now()) == []
    assert status_of(ledger) == "running"
    assert abs((ledger.started_at - database_now()).total_seconds()) < 5
    assert abs((ledger.heartbeat_at - database_now()).total_seconds()) < 5


@pytest.mark.django_db
def test_backoff_counts_from_the_database_clock_whatever_the_hosts(  # type: ignore[no-untyped-def]
    api, monkeypatch
):
    """A failure recorded on a host 5 minutes fast: its retry is due one backoff step after
    the database's now, not 5 minutes later; the sweep of a host 5 minutes slow retries it then
    and not before."""
    chat_id = new_chat(api)
    skew_clock(monkeypatch, +300)
    ledger = running_row(chat_id)
    plan = retries.fail_brief(ledger, 0, "boom", "transient", database_now())
    brief = Brief.objects.get(chat_id=chat_id)
    wait = (brief.next_attempt_at - database_now()).total_seconds()
    assert abs(wait - plan.delay.total_seconds()) < 5
    skew_clock(monkeypatch, -300)
    lock = LocalChatLock(ttl_seconds=3)
    assert chat_id not in sweep.sweep_candidates(database_now(), lock, 100)
    Brief.objects.filter(chat_id=chat_id).update(next_attempt_at=Now() - timedelta(seconds=1))
    assert chat_id in sweep.sweep_candidates(database_now(), lock, 100)


# --- A live fold is told from a dead one by its heartbeat ---------------------------------


@pytest.mark.django_db
def test_a_live_fold_whose_lock_lapsed_is_not_interrupted_while_its_heartbeat_is_fresh(  # type: ignore[no-untyped-def]
    api,
):
    """Redis restarted without persistence, a worker cut off from it past the lock TTL, a
    process stall: the chat's lock is gone under a fold that is still alive. The recovery tells
    a live fold from a dead one by the heartbeat its ledger row carries (database time, stamped
    at its start and renewed before each summarizer call), not by the lock: sweep after sweep
    it neither interrupts the fold nor counts a death against the chat. A row whose heartbeat
    is older than the staleness bound is dead, whatever the lock says."""
    lock = LocalChatLock(ttl_seconds=30)  # holds nothing: every lock lapsed
    chat_id = new_chat(api)
    live = running_row(chat_id, beating=True)
    for _ in range(retries.CRASH_AFTER_INTERRUPTIONS):
        assert sweep.recover_dead_runs(database_now()) == []
    assert status_of(live) == "running"
    brief = Brief.objects.get(chat_id=chat_id)
    assert (brief.consecutive_failures, brief.next_attempt_at, brief.last_error) == (0, None, "")
    # Its heartbeat stops (the process died): dead once older than the bound, lock or none.
    assert lock.acquire_or_mark_pending(chat_id, "a-later-run")
    stopped = deadlines.fold_heartbeat_stale_after() + 1
    Consolidation.objects.filter(pk=live.pk).update(heartbeat_at=Now() - timedelta(seconds=stopped))
    assert sweep.recover_dead_runs(database_now()) == [sweep.Refold(chat_id, RequestReason.SWEEP)]
    assert (status_of(live), live.error) == ("interrupted", sweep.INTERRUPTED)


@pytest.mark.django_db
def test_a_fold_renews_its_heartbeat_before_each_summarizer_call(api, monkeypatch) -> None:  # type: ignore[no-untyped-def]
    """One chunk, two summarizer calls (the fold guard asks for a repair: two rules the draft
    dropped do not both fit the cap): the row's heartbeat is stamped when the fold starts and
    renewed before the second call, in database time, so a fold of several slow calls never
    looks dead."""
    chat_id = contract_chat_after_turns(api, 6)
    old, zulu = rules_only(5), "Never use zulu on 1025."
    draft = rules_only(5, start=2) + f"\n- {zulu}"
    cap = room_for_one_more(draft, "Never use bravo on 1001.")
    Brief.objects.filter(chat_id=chat_id).update(summary=old)
    Chat.objects.filter(pk=chat_id).update(policy_overrides={"summary_token_cap": cap})
    beats: list[Any] = []

    class SlowRepairing:
        name = "slow-repairing"

        def __init__(self, cap_tokens: int | None = None) -> None:
            self.texts = [draft, draft]  # the repair ignores the request

        def _call(self) -> SummaryResult:
            beats.append(
                Consolidation.objects.filter(chat_id=chat_id, status="running")
                .values_list("started_at", "heartbeat_at")
                .get()
            )
            time.sleep(0.3)
            return SummaryResult(self.texts.pop(0), 100, 10, self.name)

        def summarize(self, current_summary, messages):  # type: ignore[no-untyped-def]
            return self._call()

        def repair(self, current_summary, messages, draft, keep):  # type: ignore[no-untyped-def]
            return self._call()

    monkeypatch.setattr(folds, "get_summarizer", SlowRepairing)
    outcome = folds.fold_once(chat_id, RequestReason.MANUAL)
    assert outcome.status == "succeeded", outcome
    [(started, first), (_, second)] = beats
    assert first == started
    assert (second - first).total_seconds() >= 0.3


def database_connections() -> int:
    """Connections to the test database now, the asking one included."""
    with connection.cursor() as cursor:
        cursor.execute("SELECT count(*) FROM pg_stat_activity WHERE datname = current_database()")
        return int(cursor.fetchone()[0])


class SleepingSummarizer:
    """One summarizer call of ``seconds``, during which ``during`` runs (the recovery's pass,
    as beat would run it on another host meanwhile)."""

    name = "sleeping"

    def __init__(self, seconds: float, during: Any) -> None:
        self.seconds, self.during = seconds, during

    def __call__(self, cap_tokens: int | None = None) -> "SleepingSummarizer":
        return self

    def summarize(self, current_summary, messages):  # type: ignore[no-untyped-def]
        time.sleep(self.seconds)
        self.during()
        return SummaryResult("- Folded.", 100, 10, self.name)


@pytest.mark.django_db(transaction=True)
def test_a_summarizer_call_longer_than_the_bound_keeps_its_folds_heartbeat_fresh(  # type: ignore[no-untyped-def]
    require_postgres, api, settings, monkeypatch
):
    """One summarizer call outlasts the heartbeat's staleness bound: a thread of the fold's
    process renews the row's heartbeat meanwhile, so the recovery leaves the live fold running
    and it commits; between beats the thread holds no database connection (it would double a
    fold's share of the pool); once the fold ends, no thread beats for it."""
    settings.MEMORY_LOCK_TTL_SECONDS = 1
    chat_id = contract_chat_after_turns(api, 6)
    seen: list[Any] = []
    before = database_connections()

    def recovery_pass() -> None:
        seen.append(sweep.recover_dead_runs(database_now()))
        row = Consolidation.objects.get(chat_id=chat_id, status="running")
        assert row.heartbeat_at is not None
        seen.append((database_now() - row.heartbeat_at).total_seconds())
        deadline = time.monotonic() + deadlines.fold_heartbeat_stale_after()
        while database_connections() > before:
            assert time.monotonic() < deadline, "the heartbeat's thread kept its connection"
            time.sleep(0.01)

    summarizer = SleepingSummarizer(deadlines.fold_heartbeat_stale_after() * 2, recovery_pass)
    monkeypatch.setattr(folds, "get_summarizer", summarizer)
    assert folds.fold_once(chat_id, RequestReason.MANUAL).status == "succeeded"
    refolds, age = seen
    assert refolds == [] and age < deadlines.fold_heartbeat_stale_after()
    assert not [t for t in threading.enumerate() if t.name.startswith("chatmem-heartbeat")]


@pytest.mark.django_db(transaction=True)
def test_a_fold_stuck_in_a_call_past_its_deadline_is_taken_for_dead(  # type: ignore[no-untyped-def]
    api, settings, monkeypatch
):
    """The heartbeat's thread beats only for as long as the call in flight can last at its
    slowest (deadlines.call_lifetime): a process alive but stuck in a call past that stops
    beating, and the recovery marks its fold interrupted and refolds the chat, as for a killed
    worker. The stuck fold's late commit still goes through the fence: nothing folded
    meanwhile here, so it lands, once."""
    settings.MEMORY_LOCK_TTL_SECONDS, settings.MEMORY_LLM_TIMEOUT_SECONDS = 1, 0.1
    chat_id = contract_chat_after_turns(api, 6)
    version = Brief.objects.get(chat_id=chat_id).version
    seen: list[Any] = []

    def recovery_pass() -> None:
        seen.append(sweep.recover_dead_runs(database_now()))

    stuck = deadlines.call_lifetime() + deadlines.fold_heartbeat_stale_after() + 0.5
    monkeypatch.setattr(folds, "get_summarizer", SleepingSummarizer(stuck, recovery_pass))
    assert folds.fold_once(chat_id, RequestReason.MANUAL).status == "succeeded"
    assert seen == [[sweep.Refold(chat_id, RequestReason.MANUAL)]]
    assert Brief.objects.get(chat_id=chat_id).version == version + 1
