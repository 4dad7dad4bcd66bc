"""Review of the beat sweep and the fold's bookkeeping: a chat deleted (or failing) while the
sweep judges it, the sweep's own queue, the failure count under concurrent failures, and the
summarizer calls a fold's ledger row records."""

import json
import logging
import re
import shlex
from collections.abc import Iterator
from datetime import timedelta
from types import SimpleNamespace
from typing import Any, cast

import pytest
from django.core.cache import cache
from django.utils import timezone

from conversations.models import Brief, Chat, Consolidation
from memory_worker import folds, retries, sweep, tasks
from memory_worker.chat_summarizer import ChatCompletionsSummarizer
from memory_worker.dispatch import RequestTrigger
from memory_worker.locks import LocalChatLock
from tests.conftest import contract_chat_after_turns
from tests.workers import ROOT, Worker, point_celery_at, wait_until


def new_chat(api, **body: Any) -> int:  # type: ignore[no-untyped-def]
    response = api.post("/api/v1/chats/", body, format="json")
    assert response.status_code == 201, response.content
    return int(response.json()["id"])


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
        tasks, "request_consolidation", lambda chat_id, trigger: seen["requested"].append(chat_id)
    )
    monkeypatch.setattr(tasks.hooks, "replay_missed_daily_notes", seen["replayed"].append)
    yield seen
    cache.delete(sweep.SWEEP_CURSOR_KEY)


# --- 1. one chat cannot cancel the sweep ------------------------------------------------------


@pytest.mark.django_db
def test_a_chat_deleted_while_the_sweep_judges_it_is_skipped(api, monkeypatch, sweep_recorder):  # type: ignore[no-untyped-def]
    """It raised Chat.DoesNotExist out of the sweep: the retry-due and pending chats already
    chosen were never queued and the daily-notes replay was skipped."""
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
    for chat_id in (first, second):  # runs whose workers died, longer ago than any lock TTL
        ledger = Consolidation.objects.create(
            chat_id=chat_id, trigger="turn", from_seq=1, to_seq=2, base_version=0
        )
        Consolidation.objects.filter(pk=ledger.pk).update(started_at=now - timedelta(days=1))
    real = retries.fail_brief

    def fail_brief(ledger, *args):  # type: ignore[no-untyped-def]
        if ledger.chat_id == first:
            raise RuntimeError("brief update blew up")
        return real(ledger, *args)

    monkeypatch.setattr(sweep, "fail_brief", fail_brief)
    tasks.sweep()
    statuses = dict(Consolidation.objects.values_list("chat_id", "status"))
    # The run whose count failed stays running, so the next sweep counts it: marked failed
    # alone, no sweep would have counted it again.
    assert statuses == {first: "running", second: "failed"}
    assert Brief.objects.get(chat_id=first).consecutive_failures == 0
    assert Brief.objects.get(chat_id=second).consecutive_failures == 1
    assert failing in sweep_recorder["requested"]
    assert len(sweep_recorder["replayed"]) == 1


# --- 2. the sweep's own queue -----------------------------------------------------------------


def test_the_sweep_is_routed_to_its_own_queue_which_memory_workers_consume() -> None:
    from celery.app.amqp import Queues

    from chatmem_project.celery import app, consume_the_sweep_queue

    options = app.conf.beat_schedule["chatmem-sweep"]["options"]
    assert options["queue"] == "memory-sweep"
    assert app.amqp.router.route(dict(options), "chatmem.sweep")["queue"].name == "memory-sweep"
    assert app.amqp.router.route({}, "chatmem.sweep")["queue"].name == "memory-sweep"
    assert app.amqp.router.route({}, "chatmem.consolidate_chat")["queue"].name == "memory"
    # A worker started with `-Q memory` (docker-compose.yml, docs, tests/workers.py, README)
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
    """Beat's sweep used to join the FIFO memory queue behind every fold task: behind more than
    one interval of backlog it expired before a worker reached it, every minute, exactly while
    the workers were catching up. On its own queue, a worker (as tests/workers.py and
    docker-compose.yml start it: `-Q memory`) takes it after at most one fold task."""
    from chatmem_project.celery import app

    backlog = 30
    for number in range(backlog):  # chats that do not exist: each task is a quick "nothing"
        tasks.consolidate_chat.apply_async(args=(10**9 + number, "turn"))
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


# --- 3. the failure count ---------------------------------------------------------------------


@pytest.mark.django_db
def test_two_failures_of_the_same_version_count_two(api, monkeypatch) -> None:  # type: ignore[no-untyped-def]
    """fail_brief read the count, then wrote read + 1: a second failure of the same version
    landing in between (a crash and the sweep's abandonment, two workers) wrote the same N + 1."""
    chat_id = new_chat(api)
    now = timezone.now()
    ledger = Consolidation(chat_id=chat_id, trigger="turn", from_seq=1, to_seq=2)
    real = retries.retry_plan
    nested: list[int] = []

    def retry_plan(kind: str, failures: int) -> retries.RetryPlan:
        if not nested:  # the other failure lands between this one's read and its write
            nested.append(failures)
            retries.fail_brief(ledger, 0, "second", "timeout", now)
        return real(kind, failures)

    monkeypatch.setattr(retries, "retry_plan", retry_plan)
    retries.fail_brief(ledger, 0, "first", "timeout", now)
    brief = Brief.objects.get(chat_id=chat_id)
    assert brief.consecutive_failures == 2
    # The backoff is the second failure's (30 s x 2, +-20 %), not overwritten by the first's.
    assert brief.next_attempt_at is not None
    assert 48 <= (brief.next_attempt_at - now).total_seconds() <= 72


# --- 4. summarizer calls on the ledger --------------------------------------------------------

LONG = "## Facts / Constraints\n" + "\n".join(f"- fact number {n} is here" for n in range(20))
SHORT = "## Facts / Constraints\n- fact\n## Goals / Preferences\n- None\n## Decisions\n- None"


@pytest.mark.django_db
def test_the_ledger_counts_the_stricter_retry_of_an_over_cap_summary(api, monkeypatch) -> None:  # type: ignore[no-untyped-def]
    """The ledger always said one summarizer call, and a fold whose first summary was over the
    cap made two (both paid for)."""
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
        "memory_worker.chat_summarizer.create_chat_completion", create_chat_completion
    )
    summarizer = ChatCompletionsSummarizer(cast(Any, None), "gpt-test", cap_tokens=40)
    monkeypatch.setattr(folds, "get_summarizer", lambda cap=None: summarizer)
    outcome = folds.consolidate_once(chat_id, RequestTrigger.MANUAL)
    assert outcome.status == "succeeded" and outcome.ledger_id is not None, outcome
    row = Consolidation.objects.get(pk=outcome.ledger_id)
    assert (row.summarizer_calls, row.input_tokens, row.output_tokens) == (2, 300, 100)
    assert Brief.objects.get(chat_id=chat_id).summary == SHORT
