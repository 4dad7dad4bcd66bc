"""Hosts whose clocks disagree (issue 27): real gunicorn web servers, a real ``celery worker`` and a
sweep process (tests/support/clock_sweeper.py), each started with its wall clock 5 minutes off by
the preload in tests/support/skewed_clock, against one PostgreSQL and one Redis. Every time one host
compares with another's (a turn's slot, a running fold's age, a retry's due time, a cooldown's
start) is the database's, so no skew steals a slot, abandons a live fold or moves a backoff or a
cooldown. The in-process versions of these checks are in tests/test_sweep.py (Host clocks)."""

import http.client
import json
import os
import subprocess
import sys
import threading
from collections.abc import Iterator
from contextlib import contextmanager
from datetime import datetime, timedelta
from typing import Any

import pytest
from django.contrib.auth import get_user_model
from rest_framework.authtoken.models import Token

from chatmem_project.celery import app
from conversations.models import Brief, Chat, Consolidation, Message
from conversations.rows import database_now
from conversations.services.chats import create_chat
from tests.conftest import contract_chat_after_turns
from tests.support.fake_openai import FakeOpenAI
from tests.support.http_turns import serving_gunicorn
from tests.support.workers import FAST_DEADLINES, ROOT, Worker, wait_until, worker_env

PASS = "PASS "  # tests/support/clock_sweeper.py's line for each pass
SLOW, FAST = -300.0, +300.0  # seconds off the true time: ±5 minutes, as the acceptance
SKEWED_CLOCK = ROOT / "tests" / "support" / "skewed_clock"
DEADLINE = 30.0  # seconds; every wait polls up to this and then fails
SKEW_TOLERANCE = 5.0  # seconds: a process's start-up, a loaded machine


def skewed_env(offset: float, redis_url: str, model: FakeOpenAI, **extra: str) -> dict[str, str]:
    """A worker's environment (test database, test Redis, celery dispatch) on a host whose clock
    is ``offset`` seconds off, its model and summarizer the fake server."""
    return worker_env(
        redis_url,
        PYTHONPATH=os.pathsep.join([str(SKEWED_CLOCK), str(ROOT)]),
        CHATMEM_CLOCK_OFFSET_SECONDS=str(offset),
        OPENAI_BASE_URL=model.base_url,
        OPENAI_API_KEY="test-key",
        CHAT_BACKEND="openai",
        CHAT_MODEL="fake-chat",
        MEMORY_SUMMARIZER_BACKEND="chat",
        MEMORY_SUMMARIZER_MODEL="fake-summarizer",
        MEMORY_SUMMARIZER_FALLBACK="",
        TURN_RATE_LIMIT="",
        ALLOWED_HOSTS="127.0.0.1,localhost",
        **FAST_DEADLINES,
        **extra,
    )


@contextmanager
def skewed_web(offset: float, redis_url: str, model: FakeOpenAI) -> Iterator[int]:
    # Quiet: serving_gunicorn reads its output only if it exits.
    env = skewed_env(offset, redis_url, model, LOG_LEVEL="WARNING")
    with serving_gunicorn(env, "gthread", 4, DEADLINE) as port:
        yield port


@contextmanager
def skewed_worker(
    name: str, offset: float, redis_url: str, model: FakeOpenAI, **extra: str
) -> Iterator[Worker]:
    env = skewed_env(offset, redis_url, model, **extra)
    worker = Worker(redis_url, f"{name}{int(offset):+d}", env=env)
    try:
        yield worker
    finally:
        worker.stop()


class Sweeper:
    """tests/support/clock_sweeper.py in a process of its own: recovery and sweep passes every 0.2
    s."""

    def __init__(self, env: dict[str, str]) -> None:
        self.passes: list[dict[str, Any]] = []
        self.process = subprocess.Popen(
            [sys.executable, "-m", "tests.support.clock_sweeper", "0.2"],
            cwd=ROOT,
            env=env,
            stdin=subprocess.PIPE,
            stdout=subprocess.PIPE,
            stderr=subprocess.STDOUT,
            text=True,
        )
        self.output: list[str] = []
        self._reader = threading.Thread(target=self._read, daemon=True)
        self._reader.start()

    def _read(self) -> None:
        for line in self.process.stdout:  # type: ignore[union-attr]
            self.output.append(line)
            if line.startswith(PASS):
                record = json.loads(line.removeprefix(PASS))
                record["db_now"] = datetime.fromisoformat(record["db_now"])
                self.passes.append(record)

    def stop(self) -> None:
        self.process.stdin.close()  # type: ignore[union-attr]
        try:
            self.process.wait(DEADLINE)
        except subprocess.TimeoutExpired:
            self.process.kill()  # never leave it running behind a failed test
            self.process.wait(DEADLINE)
        self._reader.join(DEADLINE)

    def between(self, start: datetime, end: datetime) -> list[dict[str, Any]]:
        return [record for record in self.passes if start <= record["db_now"] <= end]


@contextmanager
def skewed_sweeper(offset: float, redis_url: str, model: FakeOpenAI) -> Iterator[Sweeper]:
    sweeper = Sweeper(skewed_env(offset, redis_url, model))
    try:
        assert wait_until(lambda: len(sweeper.passes) > 0, DEADLINE), "".join(sweeper.output)
        yield sweeper
    finally:
        sweeper.stop()
    # The preload was in effect: this process's clock was the offset off the database's.
    assert all(abs(p["skew"] - offset) < SKEW_TOLERANCE for p in sweeper.passes), sweeper.passes


@pytest.fixture
def token(require_postgres: None) -> str:
    user = get_user_model().objects.create_user(username="clocks")
    return str(Token.objects.create(user=user).key)


def request(port: int, token: str, method: str, path: str, body: dict[str, Any]) -> Any:
    client = http.client.HTTPConnection("127.0.0.1", port, timeout=DEADLINE)
    headers = {"Authorization": f"Token {token}", "Content-Type": "application/json"}
    client.request(method, path, body=json.dumps(body), headers=headers)
    response = client.getresponse()
    return response.status, json.loads(response.read() or b"null")


def send_into(answers: list[int], port: int, token: str, path: str, content: str) -> None:
    answers.append(request(port, token, "POST", path, {"content": content})[0])


def ledger(chat_id: int) -> list[Consolidation]:
    return list(Consolidation.objects.filter(chat_id=chat_id).order_by("pk"))


def statuses(chat_id: int) -> list[str]:
    return [row.status for row in ledger(chat_id)]


def host_skew_of_messages(chat_id: int, stored_by_db_time: datetime) -> float:
    """How far the web host's clock was off: a message's created_at is its host's time."""
    newest = Message.objects.filter(chat_id=chat_id).order_by("-seq").first()
    assert newest is not None
    return (newest.created_at - stored_by_db_time).total_seconds()


# --- The preload --------------------------------------------------------------------------------


def test_the_preload_puts_a_subprocess_s_every_wall_clock_off_by_the_offset() -> None:
    """time.time, time.time_ns, datetime.now and Django's timezone.now all read the skewed clock
    (logging, Celery's ETAs and kombu's timestamps use the first two)."""
    env = {
        **os.environ,
        "PYTHONPATH": os.pathsep.join([str(SKEWED_CLOCK), str(ROOT)]),
        "CHATMEM_CLOCK_OFFSET_SECONDS": str(SLOW),
        "DJANGO_SETTINGS_MODULE": "chatmem_project.settings",
    }
    code = (
        "import datetime, time, django; django.setup(); "
        "from django.utils import timezone; "
        "print(time.time(), time.time_ns() / 1e9, datetime.datetime.now().timestamp(), "
        "timezone.now().timestamp())"
    )
    before = datetime.now().timestamp()
    readings = subprocess.run(
        [sys.executable, "-W", "error", "-c", code],
        cwd=ROOT,
        env=env,
        capture_output=True,
        text=True,
        check=True,
        timeout=DEADLINE,
    ).stdout.split()
    after = datetime.now().timestamp()
    for reading in map(float, readings):
        assert before + SLOW <= reading <= after + SLOW, (readings, before, after)


# --- a. Turn slots ------------------------------------------------------------------------------


@pytest.mark.postgres
@pytest.mark.redis
def test_no_turn_slot_is_stolen_between_web_hosts_ten_minutes_apart(  # type: ignore[no-untyped-def]
    token, clean_redis, fake_openai
):
    """A turn in progress on a web host 5 minutes slow, and the same chat's next turn sent to a
    host 5 minutes fast (and the other way round): the second is a 409 every time, never a second
    turn at the model; the chat's messages keep gap-free seqs. A slot judged stale by the hosts'
    clocks (10 minutes apart, TURN_SLOT_STALE_SECONDS is 34 s here) would be taken at once."""
    rounds = 6
    fake_openai.latency = 0.5
    user = Token.objects.get(key=token).user
    chat = create_chat(user, title="clocks")
    with (
        skewed_web(SLOW, clean_redis, fake_openai) as slow,
        skewed_web(FAST, clean_redis, fake_openai) as fast,
    ):
        path = f"/api/v1/chats/{chat.pk}/turns/"
        stolen = 0
        for number in range(rounds):
            first, second = (slow, fast) if number % 2 == 0 else (fast, slow)
            answered: list[int] = []
            at_model = len(fake_openai.chat_requests())
            sender = threading.Thread(
                target=send_into, args=(answered, first, token, path, f"first {number}")
            )
            sender.start()
            # The first turn holds the slot once its request reached the model.
            reached = at_model + 1
            assert wait_until(lambda: len(fake_openai.chat_requests()) >= reached, DEADLINE)  # noqa: B023
            status, body = request(second, token, "POST", path, {"content": f"second {number}"})
            stolen += status != 409
            sender.join(DEADLINE)
            assert answered == [201], answered
        sent_at = database_now()
        assert stolen == 0, f"{stolen} of {rounds} slots stolen; last answer {status} {body}"
    assert len(fake_openai.chat_requests()) == rounds  # no second turn ever reached the model
    seqs = list(Message.objects.filter(chat=chat).order_by("seq").values_list("seq", flat=True))
    assert seqs == list(range(1, 2 * rounds + 1))
    # The last turn was stored by the fast host: its clock was indeed 5 minutes ahead.
    assert abs(host_skew_of_messages(chat.pk, sent_at) - FAST) < SKEW_TOLERANCE


# --- b. Live folds ------------------------------------------------------------------------------


@pytest.mark.postgres
@pytest.mark.redis
@pytest.mark.worker
def test_a_live_fold_on_a_slow_worker_is_not_abandoned_by_a_fast_sweep(  # type: ignore[no-untyped-def]
    require_postgres, api, settings, clean_redis, fake_openai
):
    """A fold taking 3 s in a worker 5 minutes slow while a process 5 minutes fast runs the
    recovery and the sweep every 0.2 s: its ledger row ends succeeded, nothing is interrupted,
    abandoned or counted as a failure, and the summarizer is called once. Judged by the hosts'
    clocks the row would have looked 10 minutes old, past any lock's hold (9 s here)."""
    fake_openai.summarize_latency = 3.0
    chat_id = contract_chat_after_turns(api, 6)  # 12 unfolded messages: one overflow fold due
    with (
        skewed_worker("live", SLOW, clean_redis, fake_openai) as worker,
        skewed_sweeper(FAST, clean_redis, fake_openai) as sweeper,
    ):
        worker.wait_ready()
        assert wait_until(lambda: "succeeded" in statuses(chat_id), DEADLINE), worker.log()
        row = ledger(chat_id)[-1]
        # A few more passes after the fold: a recovery that was about to abandon it would have.
        after = lambda: sum(p["db_now"] > row.finished_at for p in sweeper.passes)  # noqa: E731
        assert wait_until(lambda: after() >= 3, DEADLINE), "".join(sweeper.output)
    during = sweeper.between(row.started_at, row.finished_at)
    assert len(during) >= 5, sweeper.passes  # the recovery looked at the live row many times
    assert all(record["recovered"] == 0 for record in sweeper.passes), sweeper.passes
    assert statuses(chat_id) == ["succeeded"]
    brief = Brief.objects.get(chat_id=chat_id)
    assert brief.consecutive_failures == 0 and brief.next_attempt_at is None
    assert len(fake_openai.summarize_requests()) == 1


def worker_clock_skew(worker: Worker, row: Consolidation) -> float:
    """How far the worker's clock was off: its log line for the fold's outcome is stamped by its
    host's clock, the ledger row's finish by the database's."""
    for line in worker.log().splitlines():
        if line.startswith("{") and '"logger": "chatmem.fold"' in line:
            logged = datetime.fromisoformat(json.loads(line)["ts"])
            assert row.finished_at is not None
            return (logged - row.finished_at).total_seconds()
    raise AssertionError(worker.log())


# --- c. Backoff ---------------------------------------------------------------------------------

# The first invalid output's retry, jittered by ±20 % (retries.retry_plan): past half the
# visibility timeout (FAST_DEADLINES: 10 s), so the worker queues no delayed retry of its own and
# the sweep retries. An invalid output keeps its ladder; a provider-wide failure (a 500) would
# be probed early by design (scheduling.recovery).
BACKOFF = 6.5


@pytest.mark.postgres
@pytest.mark.redis
@pytest.mark.worker
def test_a_failed_fold_is_retried_one_backoff_step_later_by_database_time(  # type: ignore[no-untyped-def]
    require_postgres, api, clean_redis, fake_openai
):
    """A fold failing (an empty summary) in a worker 5 minutes fast is due again one backoff
    step after the database's now, not 5 minutes later; a sweep 5 minutes slow starts no fold
    before it is due and retries it within a few passes after. By the hosts' clocks the retry
    would come 10 minutes late."""
    fake_openai.queue_faults("summarize", ["empty"])
    chat_id = contract_chat_after_turns(api, 6)  # one overflow fold due
    backoff = {"MEMORY_INVALID_OUTPUT_RETRY_SECONDS": str(BACKOFF)}
    with (
        skewed_worker("backoff", FAST, clean_redis, fake_openai, **backoff) as worker,
        skewed_sweeper(SLOW, clean_redis, fake_openai) as sweeper,
    ):
        worker.wait_ready()
        backing_off = Brief.objects.filter(chat_id=chat_id, next_attempt_at__isnull=False)
        assert wait_until(backing_off.exists, DEADLINE), worker.log()
        seen, due = database_now(), backing_off.get().next_attempt_at
        assert wait_until(lambda: statuses(chat_id) == ["failed", "succeeded"], DEADLINE), (
            statuses(chat_id),
            worker.log(),
        )
    failed, retry = ledger(chat_id)
    assert due is not None and failed.finished_at is not None
    assert abs(worker_clock_skew(worker, failed) - FAST) < SKEW_TOLERANCE
    step = (due - failed.started_at).total_seconds()
    assert 0.8 * BACKOFF - 1 <= step <= 1.2 * BACKOFF + 1, step
    # The slow sweep's passes while the chat backed off started no fold (a pass may still queue
    # the chat for a pending mark: the worker then finds it backing off, by database time).
    assert sweeper.between(seen, due), sweeper.passes
    assert due <= retry.started_at, (due, retry.started_at)
    assert (retry.started_at - due).total_seconds() < 3, (due, retry.started_at)
    assert len(fake_openai.summarize_requests()) == 2


# --- d. Cooldown --------------------------------------------------------------------------------

COOLDOWN = 4.0  # seconds


@pytest.mark.postgres
@pytest.mark.redis
@pytest.mark.worker
def test_a_cooldown_counts_from_database_time_whatever_the_creating_host_s_clock(  # type: ignore[no-untyped-def]
    token, clean_redis, fake_openai
):
    """A chat created and talked to on a web host 5 minutes slow, whose policy folds after a
    4 s cooldown, judged by a worker and a sweep 5 minutes fast: its first fold comes once 4 s of
    database time have passed since its creation, not at once (before its first fold the
    cooldown counts from the chat's creation, which the web host stamps)."""
    overrides = {"tail_messages": 2, "window": 20, "hard_limit": 40, "cooldown_seconds": COOLDOWN}
    with (
        skewed_worker("cooldown", FAST, clean_redis, fake_openai) as worker,
        skewed_sweeper(FAST, clean_redis, fake_openai) as sweeper,
        skewed_web(SLOW, clean_redis, fake_openai) as slow,
    ):
        worker.wait_ready()
        before = database_now()
        body = {"policy": "sliding-window", "policy_overrides": overrides}
        status, chat = request(slow, token, "POST", "/api/v1/chats/", body)
        assert status == 201, chat
        after = database_now()
        for number in range(2):  # two turns: a backlog of one turn beyond the tail
            path = f"/api/v1/chats/{chat['id']}/turns/"
            status, answer = request(slow, token, "POST", path, {"content": f"fact {number}"})
            assert status == 201, answer
        talked = database_now()
        assert wait_until(lambda: "succeeded" in statuses(chat["id"]), DEADLINE), worker.log()
    (fold,) = ledger(chat["id"])
    assert fold.trigger == "cooldown"
    waited = (fold.started_at - before).total_seconds()
    assert COOLDOWN <= waited < COOLDOWN + 5, waited
    created_at = Chat.objects.get(pk=chat["id"]).created_at
    assert before <= created_at <= after  # the database's time, not the slow host's
    assert abs(host_skew_of_messages(chat["id"], talked) - SLOW) < SKEW_TOLERANCE
    assert sweeper.between(created_at, created_at + timedelta(seconds=COOLDOWN)), sweeper.passes


# --- Beat's passes ------------------------------------------------------------------------------


def trace_lines(worker: Worker, task: str) -> list[str]:
    return [line for line in worker.log().splitlines() if f"Task {task}[" in line]


@pytest.mark.postgres
@pytest.mark.redis
@pytest.mark.worker
def test_beat_s_passes_run_on_a_worker_whose_clock_is_ahead_of_beat_s(  # type: ignore[no-untyped-def]
    require_postgres, broker, fake_openai
):
    """The sweep and the recovery, queued as beat queues them by a host with the true time, run
    on a worker 5 minutes fast: a Celery expiry (stamped by beat's clock, judged by the
    worker's) would have discarded every one. A backlog of passes (no worker ran for a while)
    costs one pass: the others, less than half an interval later by database time, skip."""
    backlog = 3
    for entry in ("chatmem-sweep", "chatmem-recover-runs"):
        schedule = app.conf.beat_schedule[entry]
        for _ in range(backlog):  # as beat sends them
            app.send_task(schedule["task"], kwargs=schedule.get("kwargs"), **schedule["options"])
    with skewed_worker("beat", FAST, broker, fake_openai) as worker:
        worker.wait_ready()
        for task in ("chatmem.sweep", "chatmem.recover_runs"):
            done = lambda: len(trace_lines(worker, task)) >= 2 * backlog  # noqa: E731, B023
            assert wait_until(done, DEADLINE), worker.log()  # received and succeeded, each
    assert not [line for line in worker.log().splitlines() if "revoked" in line.lower()]
    assert worker.log().count('"event": "sweep"') == 1, worker.log()
