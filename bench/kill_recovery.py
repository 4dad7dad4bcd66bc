"""How long a chat whose worker is killed mid-fold waits for its fold, on the production path:
real ``celery worker`` processes and a real ``celery beat`` with the default lock TTL, recovery
interval and sweep, PostgreSQL, a private Redis and the fake model server.

    python -m bench.kill_recovery [--kills 20] [--workers 3] [--summarize-latency 2]
                                  [--locked-phase] [--out bench/results/kill_recovery.json]

For each kill: a new ``contract`` chat with a fold due (12 unfolded messages) is queued at a
random point of beat's recovery period (``--locked-phase``: at once, which puts every lapse
just after a recovery's tick, near the worst case). Once its fold's summarizer call is in
flight, the worker running it is killed with SIGKILL to its process group (an out-of-memory
kill, a drained node: no message is handed back, the broker keeps it until its visibility
timeout) and replaced by a fresh worker, as an orchestrator would. Measured: the time from the
kill to the chat's fold committing (the brief's version moving), done by another worker; and
what the chat's brief and ledger say afterwards (failures counted, degraded, the killed run's
row).

Needs PostgreSQL: ``--database-url`` (default ``$DATABASE_URL``) names the server; a fresh
database is created there and dropped at the end. Worker and beat logs go to ``artifacts/``.
"""

from __future__ import annotations

import argparse
import random
import shlex
import signal
import statistics
import subprocess
import sys
import time
from collections import Counter
from datetime import UTC, datetime
from pathlib import Path
from typing import Any

from bench.chaos import private_or_given_redis, scratch_database
from bench.common import ROOT, configure_django, machine_info, save_report

# The defaults of everything under test (lock TTL, recovery interval, sweep, deadlines); only
# the model is fake, and the cooled-chat sweep is off so it cannot fold a chat first.
RUN_ENV = {
    "MEMORY_DISPATCH": "celery",
    "CHAT_BACKEND": "openai",
    "MEMORY_SUMMARIZER_BACKEND": "chat",
    "OPENAI_API_KEY": "kill-recovery",
    "MEMORY_SUMMARIZER_MODEL": "fake-summarizer",
    "MEMORY_DAILY_NOTES": "false",
}
BACKLOG = 12  # a contract chat (K = 6, B = 4): one overflow fold due


def new_chat_with_fold_due(client: Any, number: int) -> int:
    from bench.common import create_chat, insert_history

    chat_id = create_chat(client, f"killed {number}", "contract", {})
    insert_history([chat_id], BACKLOG, lambda seq: f"fact {seq}: the code is {seq * 7919}.", 20)
    return chat_id


def wait(predicate: Any, timeout: float, interval: float = 0.1) -> bool:
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        if predicate():
            return True
        time.sleep(interval)  # poll until the deadline
    return bool(predicate())


def start_beat(redis_url: str, schedule: Path) -> subprocess.Popen:
    from tests.support.workers import worker_env

    log = (ROOT / "artifacts" / "kill-recovery-beat.log").open("w")
    command = [sys.executable, "-m", "celery", "-A", "chatmem_project", "beat"]
    command += ["--loglevel", "INFO", "--schedule", str(schedule)]
    return subprocess.Popen(
        command,
        cwd=ROOT,
        env=worker_env(redis_url, LOG_LEVEL="INFO"),
        stdout=log,
        stderr=subprocess.STDOUT,
    )


def run(args: argparse.Namespace, database_url: str) -> dict[str, Any]:
    from tests.support.fake_openai import FakeOpenAI

    with (
        FakeOpenAI(summarize_latency=args.summarize_latency) as model,
        private_or_given_redis(args.redis_url) as redis_url,
    ):
        configure_django(
            database_url, {**RUN_ENV, "REDIS_URL": redis_url, "OPENAI_BASE_URL": model.base_url}
        )
        from tests.support.workers import Worker

        generation = Counter[str]()

        def make(slot: int) -> Worker:
            generation[str(slot)] += 1
            name = f"killrec{slot}g{generation[str(slot)]}"
            return Worker(redis_url, name, env={"LOG_LEVEL": "INFO"})  # its "ready." line

        fleet = [make(slot) for slot in range(args.workers)]
        beat = start_beat(redis_url, ROOT / "artifacts" / f"kill-recovery-beat-{time.time_ns()}")
        try:
            for worker in fleet:
                worker.wait_ready(timeout=180)  # three start at once, on a shared machine
            return measure(args, model, fleet, make)
        finally:
            beat.terminate()
            beat.wait(timeout=20)
            for worker in fleet:
                worker.stop()


def measure(args: argparse.Namespace, model: Any, fleet: list[Any], make: Any) -> dict[str, Any]:
    from django.conf import settings

    from bench.common import api_client
    from conversations.models import Brief, Consolidation
    from memory_worker.coordination.dispatch import RequestReason
    from memory_worker.scheduling.runs import request_fold
    from tests.support.invariants import chat_violations

    client = api_client()
    rng = random.Random(args.seed)
    kills: list[dict[str, Any]] = []
    for number in range(args.kills):
        chat_id = new_chat_with_fold_due(client, number)
        if not args.locked_phase:
            # Each kill at another point of beat's recovery period: without it every fold would
            # start just after the previous recovery's tick, and every lapse land just after
            # the next tick (the near-worst case, --locked-phase).
            time.sleep(rng.uniform(0, settings.MEMORY_RECOVERY_INTERVAL_SECONDS))
        seen = [len(worker.log()) for worker in fleet]
        assert request_fold(chat_id, RequestReason.TURN)
        in_flight = wait(
            lambda chat_id=chat_id: (
                model.counters()["in_flight"] >= 1
                and Consolidation.objects.filter(chat_id=chat_id, status="running").exists()
            ),
            timeout=60,
            interval=0.05,
        )
        assert in_flight, "the fold never started"
        [slot] = [
            slot
            for slot, worker in enumerate(fleet)
            if "Task chatmem.consolidate_chat[" in worker.log()[seen[slot] :]
        ]
        time.sleep(rng.uniform(0, args.summarize_latency / 2))  # somewhere in the call
        victim = fleet[slot]
        victim.signal(signal.SIGKILL)
        killed_at = time.monotonic()
        victim.process.wait(timeout=10)
        victim.stop()
        fleet[slot] = make(slot)  # restarted, as an orchestrator would
        committed = wait(
            lambda chat_id=chat_id: Brief.objects.get(chat_id=chat_id).version >= 1,
            timeout=args.timeout,
        )
        seconds = time.monotonic() - killed_at
        brief = Brief.objects.get(chat_id=chat_id)
        statuses = Counter(
            Consolidation.objects.filter(chat_id=chat_id).values_list("status", flat=True)
        )
        kills.append(
            {
                "chat_id": chat_id,
                "seconds_to_commit": round(seconds, 1) if committed else None,
                "consecutive_failures": brief.consecutive_failures,
                "degraded": brief.degraded,
                "ledger": dict(statuses),
                "violations": chat_violations(chat_id),
            }
        )
        print(f"kill {number + 1}: {kills[-1]}", file=sys.stderr)
        fleet[slot].wait_ready(timeout=180)
    # The last killed run's row is marked by the next recovery once its lock is free.
    wait(
        lambda: not Consolidation.objects.filter(status="running").exists(),
        timeout=60,
        interval=0.5,
    )
    times = [kill["seconds_to_commit"] for kill in kills if kill["seconds_to_commit"] is not None]
    ledger: Counter[str] = Counter()
    for kill in kills:
        ledger.update(kill["ledger"])
    final = Counter(Consolidation.objects.values_list("status", flat=True))
    return {
        "kills": len(kills),
        "committed_by_another_worker": len(times),
        "seconds_to_commit": {
            "median": round(statistics.median(times), 1) if times else None,
            "p90": round(sorted(times)[int(0.9 * (len(times) - 1))], 1) if times else None,
            "max": max(times) if times else None,
            "min": min(times) if times else None,
        },
        "within_60_s": sum(1 for seconds in times if seconds <= 60),
        "failures_counted": sum(kill["consecutive_failures"] for kill in kills),
        "degraded_chats": sum(1 for kill in kills if kill["degraded"]),
        "ledger_at_end": dict(final),
        "violations": sum(len(kill["violations"]) for kill in kills),
        "per_kill": kills,
    }


def parse_args(argv: list[str] | None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(
        prog="python -m bench.kill_recovery", description=(__doc__ or "").split("\n")[0]
    )
    parser.add_argument("--kills", type=int, default=20)
    parser.add_argument("--workers", type=int, default=3, help="celery worker processes")
    parser.add_argument("--summarize-latency", type=float, default=2.0, help="seconds per call")
    parser.add_argument("--timeout", type=float, default=180.0, help="per kill, seconds")
    parser.add_argument("--seed", type=int, default=29)
    parser.add_argument(
        "--locked-phase",
        action="store_true",
        help="queue each fold as soon as the previous one committed (near the worst case)",
    )
    parser.add_argument("--database-url", default=None, help="the PostgreSQL server to use")
    parser.add_argument("--redis-url", default=None, help="default: a private redis-server")
    parser.add_argument("--out", default="bench/results/kill_recovery.json")
    args = parser.parse_args(argv)
    if args.workers < 2:
        parser.error("--workers must be at least 2: another worker does the fold")
    return args


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    given = sys.argv[1:] if argv is None else argv
    command = shlex.join(["python", "-m", "bench.kill_recovery", *given])
    started = time.monotonic()
    with scratch_database(args.database_url) as database_url:
        figures = run(args, database_url)
    from django.conf import settings

    report = {
        "command": command,
        "date": datetime.now(UTC).strftime("%Y-%m-%d %H:%M UTC"),
        "machine": machine_info(),
        "settings": {
            key: getattr(settings, key)
            for key in (
                "MEMORY_LOCK_TTL_SECONDS",
                "MEMORY_RECOVERY_INTERVAL_SECONDS",
                "MEMORY_SWEEP_INTERVAL_SECONDS",
                "MEMORY_TASK_TIME_LIMIT",
                "BROKER_VISIBILITY_TIMEOUT",
            )
        },
        "wall_seconds": round(time.monotonic() - started, 1),
        **figures,
    }
    print(f"wrote {save_report(report, args.out)}", file=sys.stderr)
    ok = figures["committed_by_another_worker"] == figures["kills"] and not figures["violations"]
    return 0 if ok else 1


if __name__ == "__main__":
    sys.exit(main())
