"""Chaos run of distributed consolidation: real celery workers killed with SIGKILL and
restarted, the summarizer failing on a share of its calls, many chats talking at once; then the
faults stop and every chat must converge with its ledger intact.

    python -m bench.chaos [--chats 20] [--turns 30] [--workers 3] [--kills 6]
                          [--fault-rate 0.3] [--out bench/results/chaos.json]

What runs:

- the fake OpenAI-compatible server (``tests.support.fake_openai``, in this process), injecting
  ``--faults`` (default: every transient and non-transient kind) into ``--fault-rate`` of the
  summarize calls; chat calls never fail;
- a private ``redis-server`` on a free port (``--redis-url`` to use another Redis instead; the
  run only uses the ``memory`` queue and the ``chatmem:`` keys there);
- ``--workers`` real ``celery worker`` processes (``tests.support.workers.Worker``, prefork,
  one child);
- the sweep, called directly every ``--sweep-interval`` seconds (what beat runs every minute);
- ``--clients`` threads sending ``--turns`` turns to each of ``--chats`` chats through the real
  API (DRF, in process), each chat's turns in order.

Meanwhile a worker chosen at random is killed (SIGKILL to its process group) every
``--kill-every`` seconds and replaced, ``--kills`` times. Then the faults stop and the run waits,
up to ``--converge-timeout`` seconds, until no chat has a fold due and none is degraded.

Checks, per chat, from the database (``ledger_violations``, a pure function): the succeeded folds
are contiguous, disjoint and cover 1..W exactly once; each committed on the version after the
previous one and W only grew, in commit order and in time; every acknowledged (201) turn is
stored, numbered without gaps; the brief's version counts the folds. W is also sampled while the
run goes on and must never decrease. Any violation makes the exit status 1.

Needs PostgreSQL: ``--database-url`` (default ``$DATABASE_URL``, else
``postgres://postgres@127.0.0.1:5432/postgres``) names the server; a fresh database
``chatmem_chaos_<random>`` is created there, migrated, and dropped at the end unless
``--keep-database``. Worker logs go to ``artifacts/worker-chaos*.log``.
"""

from __future__ import annotations

import argparse
import json
import logging
import os
import random
import shlex
import signal
import sys
import threading
import time
import uuid
from collections import Counter
from collections.abc import Callable, Iterable, Iterator, Sequence
from concurrent.futures import ThreadPoolExecutor
from contextlib import contextmanager
from dataclasses import dataclass, field
from datetime import UTC, datetime
from itertools import pairwise
from pathlib import Path
from typing import Any
from urllib.parse import urlsplit, urlunsplit

from bench.common import machine_info

DEFAULT_FAULTS = ("429", "500", "timeout", "insufficient_quota", "400", "truncated", "empty")
FALLBACK_DATABASE_URL = "postgres://postgres@127.0.0.1:5432/postgres"
# --timeouts short: short, correctly ordered deadlines (chatmem.E001) so a killed worker's lock
# and message come back within the run, and a short failure ladder so degraded chats are retried
# before the deadline. The fault server's "timeout" answers after timeout_sleep > the LLM deadline.
SHORT_TIMEOUTS = {
    "MEMORY_LLM_TIMEOUT_SECONDS": "3",
    "MEMORY_TASK_SOFT_TIME_LIMIT": "5",
    "MEMORY_TASK_TIME_LIMIT": "6",
    "MEMORY_LOCK_TTL_SECONDS": "3",
    "BROKER_VISIBILITY_TIMEOUT": "10",
    "MEMORY_FAILURE_BACKOFF_SECONDS": "0.5",
    "MEMORY_FAILURE_BACKOFF_MAX_SECONDS": "5",
    "MEMORY_SWEEP_MIN_COOLDOWN_SECONDS": "0",
    "TURN_SLOT_STALE_SECONDS": "10",
    "LLM_TIMEOUT_SECONDS": "5",
}
# --timeouts deployed: every deadline, lock, backoff and cooldown at the settings' defaults, as
# an operator runs it (use --sweep-interval 60, what beat runs).
DEPLOYED_TIMEOUTS: dict[str, str] = {}
# A client thread sends far more than a person would; the per-user limit is not under test.
ALWAYS_ENV = {"TURN_RATE_LIMIT": "1000000/min"}


def run_env(timeouts: str) -> dict[str, str]:
    return {**(SHORT_TIMEOUTS if timeouts == "short" else DEPLOYED_TIMEOUTS), **ALWAYS_ENV}


def timeout_sleep(env: dict[str, str]) -> float:
    """How long the "timeout" fault waits: past the summarizer's deadline."""
    return float(env.get("MEMORY_LLM_TIMEOUT_SECONDS", "60")) + 1.0


# --------------------------------------------------------------------------------------------
# The checker: pure functions over what the database holds


@dataclass(frozen=True)
class LedgerRow:
    status: str
    from_seq: int
    to_seq: int
    base_version: int
    finished_at: float | None  # seconds since the epoch


@dataclass(frozen=True)
class ChatRecord:
    chat_id: int
    acknowledged_turns: int  # turns answered 201
    message_seqs: tuple[int, ...]
    last_seq: int
    watermark: int  # the brief's last_consolidated (W)
    version: int
    ledger: tuple[LedgerRow, ...]


def ledger_violations(chat: ChatRecord) -> list[str]:
    return [
        f"chat {chat.chat_id}: {problem}"
        for problem in (*stored_problems(chat), *coverage_problems(chat), *order_problems(chat))
    ]


def stored_problems(chat: ChatRecord) -> Iterator[str]:
    if list(chat.message_seqs) != list(range(1, chat.last_seq + 1)):
        yield f"messages are not numbered 1..{chat.last_seq}"
    if len(chat.message_seqs) != 2 * chat.acknowledged_turns:
        yield (
            f"{chat.acknowledged_turns} turns acknowledged, {len(chat.message_seqs)} messages "
            "stored (expected two per turn)"
        )


def succeeded(chat: ChatRecord) -> list[LedgerRow]:
    return [row for row in chat.ledger if row.status == "succeeded"]


def coverage_problems(chat: ChatRecord) -> Iterator[str]:
    """Committed fold ranges are contiguous and disjoint and cover 1..W exactly once."""
    expected = 1
    for row in sorted(succeeded(chat), key=lambda row: row.from_seq):
        if row.to_seq < row.from_seq:
            yield f"fold {row.from_seq}..{row.to_seq} is empty"
        elif row.from_seq < expected:
            yield f"fold {row.from_seq}..{row.to_seq} overlaps 1..{expected - 1}"
        elif row.from_seq > expected:
            yield f"gap: {expected}..{row.from_seq - 1} was never folded"
        expected = max(expected, row.to_seq + 1)
    if expected - 1 != chat.watermark:
        yield f"folds cover 1..{expected - 1} but W = {chat.watermark}"
    if chat.watermark > chat.last_seq:
        yield f"W = {chat.watermark} is beyond the last message {chat.last_seq}"


def order_problems(chat: ChatRecord) -> Iterator[str]:
    """Each fold committed on the version after the previous one, and W only grew."""
    folds = succeeded(chat)
    by_version = sorted(folds, key=lambda row: row.base_version)
    if [row.base_version for row in by_version] != list(range(len(folds))):
        yield f"fold base versions {[row.base_version for row in by_version]} are not 0..n-1"
    if chat.version != len(folds):
        yield f"version {chat.version} != {len(folds)} succeeded folds"
    yield from decreases("W in commit order", [row.to_seq for row in by_version])
    timed = sorted(
        (row for row in folds if row.finished_at is not None), key=lambda row: row.finished_at or 0
    )
    yield from decreases("W in time", [row.to_seq for row in timed])


def decreases(what: str, values: Sequence[int]) -> Iterator[str]:
    for before, after in pairwise(values):
        if after <= before:
            yield f"{what} went from {before} to {after}"


def sampled_decreases(samples: Iterable[dict[int, int]]) -> list[str]:
    """W of each chat, sampled while the run went on, must never decrease."""
    highest: dict[int, int] = {}
    problems: list[str] = []
    for sample in samples:
        for chat_id, watermark in sample.items():
            if watermark < highest.get(chat_id, 0):
                problems.append(f"chat {chat_id}: W sampled {highest[chat_id]} then {watermark}")
            highest[chat_id] = max(watermark, highest.get(chat_id, 0))
    return problems


# --------------------------------------------------------------------------------------------
# Setup: database, environment, Django


def database_urls(server_url: str) -> tuple[str, str, str]:
    """(admin URL, run URL, run database name) on the server ``server_url`` names."""
    parts = urlsplit(server_url)
    name = f"chatmem_chaos_{uuid.uuid4().hex[:8]}"
    admin = urlunsplit((parts.scheme, parts.netloc, "/postgres", parts.query, ""))
    run = urlunsplit((parts.scheme, parts.netloc, f"/{name}", parts.query, ""))
    return admin, run, name


def run_sql(admin_url: str, statement: str) -> None:
    import psycopg

    with psycopg.connect(admin_url.replace("postgres://", "postgresql://", 1)) as connection:
        connection.autocommit = True
        connection.execute(statement)  # type: ignore[arg-type]


def configure_django(
    database_url: str, redis_url: str, model_url: str, env: dict[str, str]
) -> None:
    os.environ.update(
        {
            "DJANGO_SETTINGS_MODULE": "chatmem_project.settings",
            "DATABASE_URL": database_url,
            "REDIS_URL": redis_url,
            "MEMORY_DISPATCH": "celery",
            "CHAT_BACKEND": "openai",
            "MEMORY_SUMMARIZER_BACKEND": "chat",
            "OPENAI_API_KEY": "chaos",
            "OPENAI_BASE_URL": model_url,
            "CHAT_MODEL": "fake-chat",
            "MEMORY_SUMMARIZER_MODEL": "fake-summarizer",
            "ALLOWED_HOSTS": "testserver,127.0.0.1,localhost",
            **env,
        }
    )
    # Failures are counted in the results; the app's own log lines would drown them.
    os.environ.setdefault("LOG_LEVEL", "CRITICAL")
    import django

    django.setup()
    from django.core.management import call_command

    # Refused turns (503) are counted; one log line each would bury the report.
    logging.getLogger("django.request").setLevel(logging.CRITICAL)
    call_command("migrate", verbosity=0, interactive=False)


def worker_extra_env(env: dict[str, str]) -> dict[str, str]:
    keys = (
        "DATABASE_URL",
        "OPENAI_BASE_URL",
        "OPENAI_API_KEY",
        "CHAT_BACKEND",
        "MEMORY_SUMMARIZER_BACKEND",
        "MEMORY_SUMMARIZER_MODEL",
        *env,
    )
    return {key: os.environ[key] for key in keys} | {"LOG_LEVEL": "INFO"}


@contextmanager
def private_or_given_redis(url: str | None) -> Iterator[str]:
    if url:
        yield url
        return
    from tests.support.private_redis import PrivateRedis

    server = PrivateRedis()
    server.start()
    try:
        yield server.url
    finally:
        server.stop()


# --------------------------------------------------------------------------------------------
# The moving parts


@dataclass
class Tally:
    lock: threading.Lock = field(default_factory=threading.Lock)
    statuses: Counter[int] = field(default_factory=Counter)
    acknowledged: Counter[int] = field(default_factory=Counter)
    kills: int = 0
    restarts: int = 0
    sweeps: int = 0
    sweep_errors: int = 0
    samples: list[dict[int, int]] = field(default_factory=list)

    def turn(self, chat_id: int, status: int) -> None:
        with self.lock:
            self.statuses[status] += 1
            if status == 201:
                self.acknowledged[chat_id] += 1


class Fleet:
    """``size`` worker slots; a killed worker is replaced by a fresh process in its slot."""

    def __init__(self, redis_url: str, size: int, env: dict[str, str]) -> None:
        from tests.support.workers import Worker

        self._make = lambda name: Worker(redis_url, name, env=env)
        self._generation = 0
        self.workers = [self._make(f"chaos{slot}g0") for slot in range(size)]

    def wait_ready(self) -> None:
        for worker in self.workers:
            worker.wait_ready()

    def kill_and_replace(self, rng: random.Random) -> None:
        slot = rng.randrange(len(self.workers))
        victim = self.workers[slot]
        victim.signal(signal.SIGKILL)  # the whole process group: main process and its child
        victim.process.wait(timeout=10)
        victim.stop()  # closes its log
        self._generation += 1
        self.workers[slot] = self._make(f"chaos{slot}g{self._generation}")
        self.workers[slot].wait_ready()

    def stop(self) -> None:
        for worker in self.workers:
            worker.stop()


def closing_db(function: Callable[..., None]) -> Callable[..., None]:
    """Thread bodies: each thread's database connection is closed when it ends."""

    def run(*args: Any) -> None:
        from django.db import connection

        try:
            function(*args)
        finally:
            connection.close()

    return run


def new_client() -> Any:
    from django.contrib.auth import get_user_model
    from rest_framework.authtoken.models import Token
    from rest_framework.test import APIClient

    user = get_user_model().objects.create_user(username=f"chaos-{uuid.uuid4().hex[:10]}")
    client = APIClient()
    client.credentials(HTTP_AUTHORIZATION=f"Token {Token.objects.create(user=user).key}")
    return client


@closing_db
def talk(client: Any, chat_ids: list[int], turns: int, tally: Tally) -> None:
    """One client: round after round over its chats, so each chat's turns stay in order."""
    for number in range(turns):
        for chat_id in chat_ids:
            response = client.post(
                f"/api/v1/chats/{chat_id}/turns/",
                {"content": f"chat {chat_id} turn {number}: we decided to use option {number}."},
                format="json",
            )
            tally.turn(chat_id, response.status_code)


def create_chats(client: Any, count: int, policy: str) -> list[int]:
    chat_ids = []
    for _ in range(count):
        response = client.post("/api/v1/chats/", {"policy": policy}, format="json")
        assert response.status_code == 201, response.content
        chat_ids.append(response.json()["id"])
    return chat_ids


@closing_db
def sweeper(
    stop: threading.Event, interval: float, recovery: float, chat_ids: list[int], tally: Tally
) -> None:
    """What beat runs: the sweep every ``interval`` seconds, the recovery of dead runs every
    ``recovery`` seconds between them (the sweep runs it too)."""
    from conversations.models import Brief
    from memory_worker import tasks

    tick = min(interval, recovery)
    next_sweep = time.monotonic() + interval
    while not stop.wait(tick):
        sweeping = time.monotonic() >= next_sweep
        try:
            if sweeping:
                next_sweep += interval
                tasks.sweep()
                tally.sweeps += 1
            else:
                tasks.recover_runs()
        except Exception:  # Redis or PostgreSQL hiccup: the next tick tries again
            tally.sweep_errors += 1
        sample = dict(
            Brief.objects.filter(chat_id__in=chat_ids).values_list("chat_id", "last_consolidated")
        )
        tally.samples.append(sample)


def killer(
    fleet: Fleet, kills: int, every: float, stop: threading.Event, tally: Tally, seed: int
) -> None:
    """``kills`` kills, one every ``every`` seconds; with kills 0, until ``stop`` is set (at the
    end of the turns phase)."""
    rng = random.Random(seed)
    while (kills == 0 or tally.kills < kills) and not stop.wait(every):
        fleet.kill_and_replace(rng)
        tally.kills += 1
        tally.restarts += 1


def chats_still_busy(chat_ids: list[int]) -> list[int]:
    """Chats with a fold due (faults gone, the sweep should get to it) or still degraded."""
    from django.utils import timezone

    from conversations.models import Brief, Chat
    from memory_worker.folding.execute import decide_for_chat
    from memory_worker.folding.snapshot import load_snapshot

    degraded = set(
        Brief.objects.filter(chat_id__in=chat_ids, degraded=True).values_list("chat_id", flat=True)
    )
    due = {
        chat.pk
        for chat in Chat.objects.filter(pk__in=chat_ids)
        if decide_for_chat(chat, load_snapshot(chat.pk), timezone.now()) is not None
    }
    return sorted(degraded | due)


def wait_converged(chat_ids: list[int], timeout: float) -> tuple[bool, float, list[int]]:
    started = time.monotonic()
    busy = chats_still_busy(chat_ids)
    while busy and time.monotonic() - started < timeout:
        time.sleep(0.5)  # poll interval; the deadline is the loop condition
        busy = chats_still_busy(chat_ids)
    return not busy, time.monotonic() - started, busy


def load_records(chat_ids: list[int], acknowledged: Counter[int]) -> list[ChatRecord]:
    from conversations.models import Brief, Chat, Consolidation, Message

    records = []
    for chat in Chat.objects.filter(pk__in=chat_ids).order_by("pk"):
        brief = Brief.objects.get(chat_id=chat.pk)
        ledger = tuple(
            LedgerRow(
                str(row.status),
                row.from_seq,
                row.to_seq,
                row.base_version,
                row.finished_at.timestamp() if row.finished_at else None,
            )
            for row in Consolidation.objects.filter(chat_id=chat.pk).order_by("pk")
        )
        seqs = Message.objects.filter(chat_id=chat.pk).order_by("seq").values_list("seq", flat=True)
        records.append(
            ChatRecord(
                chat.pk,
                acknowledged[chat.pk],
                tuple(seqs),
                chat.last_seq,
                brief.last_consolidated,
                brief.version,
                ledger,
            )
        )
    return records


def ledger_counts(chat_ids: list[int]) -> dict[str, int]:
    from django.db.models import Count

    from conversations.models import Consolidation

    rows = (
        Consolidation.objects.filter(chat_id__in=chat_ids)
        .values("status")
        .annotate(n=Count("id"))
        .values_list("status", "n")
    )
    counts = {str(status): n for status, n in rows}
    counts["abandoned"] = Consolidation.objects.filter(
        chat_id__in=chat_ids, error__startswith="abandoned"
    ).count()
    counts["succeeded_synchronously"] = Consolidation.objects.filter(
        chat_id__in=chat_ids, synchronous=True, status="succeeded"
    ).count()
    counts["succeeded_by_workers"] = counts.get("succeeded", 0) - counts["succeeded_synchronously"]
    return counts


# --------------------------------------------------------------------------------------------
# The run


def split(items: list[int], parts: int) -> list[list[int]]:
    return [items[index::parts] for index in range(parts) if items[index::parts]]


def run(args: argparse.Namespace, database_url: str) -> dict[str, Any]:
    from tests.support.fake_openai import FakeOpenAI

    faults = [name for name in args.faults.split(",") if name]
    env = run_env(args.timeouts)
    with (
        FakeOpenAI(
            latency=args.model_latency,
            summarize_latency=args.summarize_latency,
            timeout_sleep=timeout_sleep(env),
        ) as model,
        private_or_given_redis(args.redis_url) as redis_url,
    ):
        configure_django(database_url, redis_url, model.base_url, env)
        fleet = Fleet(redis_url, args.workers, worker_extra_env(env))
        try:
            fleet.wait_ready()
            return drive(args, model, fleet, faults)
        finally:
            fleet.stop()


def drive(args: argparse.Namespace, model: Any, fleet: Fleet, faults: list[str]) -> dict[str, Any]:
    # One user per client thread, owning the chats that thread talks to.
    clients = [new_client() for _ in range(min(args.clients, args.chats))]
    shares = [len(part) for part in split(list(range(args.chats)), len(clients))]
    owned = [
        create_chats(client, n, args.policy) for client, n in zip(clients, shares, strict=True)
    ]
    chat_ids = [chat_id for part in owned for chat_id in part]
    tally = Tally()
    stop = threading.Event()
    turns_over = threading.Event()  # ends the kills when --kills 0
    model.set_faults("summarize", args.fault_rate, faults, seed=args.seed)
    started = time.monotonic()
    sweep_thread = threading.Thread(
        target=sweeper,
        args=(stop, args.sweep_interval, args.recovery_interval, chat_ids, tally),
        daemon=True,
    )
    kill_thread = threading.Thread(
        target=killer,
        args=(fleet, args.kills, args.kill_every, turns_over, tally, args.seed),
        daemon=True,
    )
    sweep_thread.start()
    kill_thread.start()
    with ThreadPoolExecutor(max_workers=len(clients)) as pool:
        talking = [
            pool.submit(talk, client, part, args.turns, tally)
            for client, part in zip(clients, owned, strict=True)
        ]
        for future in talking:
            future.result()
    turns_seconds = time.monotonic() - started
    if args.kills == 0:
        turns_over.set()
    kill_thread.join(timeout=args.kill_every * (args.kills + 1) + 120)
    injected = dict(model.counters()["faults"])
    model.clear_faults()
    converged, converge_seconds, busy = wait_converged(chat_ids, args.converge_timeout)
    stop.set()
    sweep_thread.join(timeout=30)
    from tests.support.invariants import chat_violations

    records = load_records(chat_ids, tally.acknowledged)
    violations = [problem for record in records for problem in ledger_violations(record)]
    violations += sampled_decreases(tally.samples)
    violations += [problem for chat_id in chat_ids for problem in chat_violations(chat_id)]
    return {
        "turns_sent": sum(tally.statuses.values()),
        "turns_acknowledged": sum(tally.acknowledged.values()),
        "turn_statuses": {str(status): n for status, n in sorted(tally.statuses.items())},
        "kills": tally.kills,
        "worker_restarts": tally.restarts,
        "summarize_calls": len(model.summarize_requests()),
        "faults_injected": sum(injected.values()),
        "faults_by_kind": injected,
        "ledger": ledger_counts(chat_ids),
        "sweeps": tally.sweeps,
        "sweep_errors": tally.sweep_errors,
        "w_samples": len(tally.samples),
        "turns_seconds": round(turns_seconds, 1),
        "converged": converged,
        "seconds_to_converge_after_faults_stopped": round(converge_seconds, 1),
        "still_busy": busy,
        "violations": len(violations),
        "violation_details": violations[:50],
    }


def parse_args(argv: Sequence[str] | None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(
        prog="python -m bench.chaos", description=(__doc__ or "").split("\n")[0]
    )
    parser.add_argument("--chats", type=int, default=20)
    parser.add_argument("--turns", type=int, default=30, help="turns per chat")
    parser.add_argument("--workers", type=int, default=3, help="celery worker processes")
    parser.add_argument(
        "--kills", type=int, default=6, help="SIGKILLs of a random worker (0: until turns end)"
    )
    parser.add_argument("--kill-every", type=float, default=2.0, help="seconds between kills")
    parser.add_argument("--fault-rate", type=float, default=0.3, help="share of summarize calls")
    parser.add_argument("--faults", default=",".join(DEFAULT_FAULTS))
    parser.add_argument("--summarize-latency", type=float, default=0.3, help="seconds per call")
    parser.add_argument("--model-latency", type=float, default=0.0, help="seconds per reply")
    parser.add_argument("--timeouts", choices=("short", "deployed"), default="short")
    parser.add_argument("--clients", type=int, default=4, help="threads sending turns")
    parser.add_argument("--policy", default="contract", help="memory preset of every chat")
    parser.add_argument("--sweep-interval", type=float, default=1.0)
    parser.add_argument(
        "--recovery-interval", type=float, default=10.0, help="beat's recover_runs (default 10 s)"
    )
    parser.add_argument("--converge-timeout", type=float, default=120.0)
    parser.add_argument("--seed", type=int, default=4)
    parser.add_argument("--database-url", default=None, help="the PostgreSQL server to use")
    parser.add_argument("--keep-database", action="store_true")
    parser.add_argument("--redis-url", default=None, help="default: a private redis-server")
    parser.add_argument("--out", default="bench/results/chaos.json")
    args = parser.parse_args(argv)
    if args.chats < 1 or args.turns < 1 or args.workers < 1:
        parser.error("--chats, --turns and --workers must be at least 1")
    return args


def server_url(given: str | None) -> str:
    url = given or os.environ.get("DATABASE_URL", "")
    return url if url.startswith(("postgres://", "postgresql://")) else FALLBACK_DATABASE_URL


@contextmanager
def scratch_database(given: str | None, keep: bool = False) -> Iterator[str]:
    """A fresh database on the PostgreSQL server ``given`` (or $DATABASE_URL's) for one run,
    dropped afterwards unless ``keep``. Yields its URL."""
    admin_url, database_url, name = database_urls(server_url(given))
    run_sql(admin_url, f'CREATE DATABASE "{name}"')
    try:
        yield database_url
    finally:
        if not keep:
            from django.db import connections

            connections.close_all()
            run_sql(admin_url, f'DROP DATABASE IF EXISTS "{name}" WITH (FORCE)')


def main(argv: Sequence[str] | None = None) -> int:
    args = parse_args(argv)
    command = shlex.join(["python", "-m", "bench.chaos", *(sys.argv[1:] if argv is None else argv)])
    started = time.monotonic()
    with scratch_database(args.database_url, keep=args.keep_database) as database_url:
        figures = run(args, database_url)
    report = {
        "command": command,
        "date": datetime.now(UTC).strftime("%Y-%m-%d %H:%M UTC"),
        "machine": machine_info(),
        "parameters": {
            key: value
            for key, value in vars(args).items()
            if key not in ("database_url", "redis_url", "out", "keep_database")
        },
        "run_env": run_env(args.timeouts),
        "wall_seconds": round(time.monotonic() - started, 1),
        **figures,
    }
    print(json.dumps(report, indent=2))
    out = Path(args.out)
    out.parent.mkdir(parents=True, exist_ok=True)
    out.write_text(json.dumps(report, indent=2) + "\n")
    print(f"wrote {out}", file=sys.stderr)
    return 0 if report["converged"] and report["violations"] == 0 else 1


if __name__ == "__main__":
    sys.exit(main())
