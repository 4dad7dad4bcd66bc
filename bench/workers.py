"""Consolidation workers scale: folds per second with 1 and with 2 worker processes,
and a worker's resident memory over many folds.

    python -m bench.workers [--chats 500] [--folds-per-chat 25] [--seconds 20] [--rounds 3]
                            [--database-url postgres://postgres@127.0.0.1:5432/chatmem_bench]
                            [--redis-url redis://127.0.0.1:6379/8]
                            [--out bench/results/workers.json]

Each phase gets fresh chats on the default preset (``sliding-window``: tail 40, window 12) whose
history is inserted in bulk with ``--folds-per-chat`` folds due, then one consolidation task per
chat is queued and real ``celery worker`` processes (prefork, one child each) drain it with the
offline summarizer (no network: an instant summarizer). A task folds, re-judges and chains
reruns as in production. Folds per second are counted from the ledger (succeeded rows) over the
steady part of the phase; the worker children's resident memory (VmRSS) is sampled as folds
accumulate. Phases alternate 1 worker, 2 workers, 1 worker, ... and start and end with 1 worker
(``--rounds`` 2-worker phases): each 2-worker phase is compared with the mean of the 1-worker
phases just before and after it, which cancels a drift of the machine's speed that is steady
over the three, and the scaling figure is the median of those ratios. This machine's speed
drifts by tens of percent within minutes: two phases one after the other took that drift for
scaling (1.28 to 2.07 on the same code). Then 1 worker until ``--rss-folds`` folds for the
memory figure.
"""

from __future__ import annotations

import argparse
import statistics
import sys
import time
import uuid
from collections.abc import Sequence
from datetime import UTC, datetime
from pathlib import Path
from typing import Any

from bench.common import (
    configure_django,
    ensure_database,
    insert_history,
    machine_line,
    write_report,
)
from bench.turn_overhead import DEFAULT_DATABASE_URL
from tests.support.workers import Worker

ROOT = Path(__file__).resolve().parent.parent
TAIL, WINDOW = 40, 12
# Workers get this process's environment (configure_django set it) plus this; they log at INFO
# so that "ready." shows (and each fold, as in production).
# The tests' harness closes the database connection after every task (DB_CONN_MAX_AGE=0, so test
# databases can be dropped); production keeps it (the default, 60 s), and so does this bench.
WORKER_ENV = {"LOG_LEVEL": "INFO", "DB_CONN_MAX_AGE": "60"}


def make_chats(owner: Any, chats: int, folds_per_chat: int) -> list[int]:
    from conversations.models import Brief
    from conversations.services.chats import create_chat

    length = TAIL + WINDOW * folds_per_chat
    # sliding-window folds its whole backlog at once; capping a fold at 6 turns (12 messages)
    # gives each chat folds_per_chat folds in a row, chained by reruns as in production.
    overrides: dict[str, object] = {"max_fold_turns": WINDOW // 2}
    ids = [
        create_chat(owner, title="bench-workers", policy_overrides=overrides).pk
        for _ in range(chats)
    ]
    insert_history(
        ids,
        length,
        lambda seq: f"Message {seq}: the release of version {seq % 7} is planned for Friday.",
        tokens=16,
    )
    Brief.objects.filter(chat_id__in=ids).update(last_consolidated=0)
    settle_tables()
    return ids


def settle_tables() -> None:
    """After a bulk insert, let PostgreSQL vacuum and analyze now rather than during the measured
    window: a service's tables grow a turn at a time, not by 170,000 rows in a second, and
    autovacuum working through those in the window took CPU from the workers on these 2 cores."""
    from django.db import connection

    from conversations.models import Brief, Chat, Consolidation, Message

    if connection.vendor != "postgresql":
        return
    quote = connection.ops.quote_name
    tables = ", ".join(
        quote(model._meta.db_table) for model in (Message, Chat, Brief, Consolidation)
    )
    with connection.cursor() as cursor:
        cursor.execute(f"VACUUM (ANALYZE) {tables}")


def folds_done(chat_ids: Sequence[int]) -> int:
    from conversations.models import Consolidation

    return Consolidation.objects.filter(chat_id__in=chat_ids, status="succeeded").count()


def start_workers(count: int, tag: str, redis_url: str) -> list[Worker]:
    """Real workers (prefork, one child each), ready to take tasks."""
    workers = [Worker(redis_url, f"bench-{tag}-{i}", env=WORKER_ENV) for i in range(count)]
    for worker in workers:
        worker.wait_ready()
    return workers


def stop(workers: Sequence[Worker]) -> None:
    for worker in workers:
        worker.stop()


def children_rss_kib(workers: Sequence[Worker]) -> list[int]:
    """VmRSS of each worker's pool child (the process that folds)."""
    sizes = []
    for worker in workers:
        parent = worker.process.pid
        children = Path(f"/proc/{parent}/task/{parent}/children")
        for child in children.read_text().split() if children.exists() else []:
            for line in Path(f"/proc/{child}/status").read_text().splitlines():
                if line.startswith("VmRSS:"):
                    sizes.append(int(line.split()[1]))
    return sizes


def queue_all(chat_ids: Sequence[int]) -> None:
    from memory_worker.tasks import fold_chat

    for chat_id in chat_ids:
        fold_chat.apply_async(args=(chat_id, "sweep"))


def empty_broker(redis_url: str) -> None:
    """Drop what an earlier phase left queued: its chats were not drained, and a phase whose
    workers also folded those would count only its own chats' folds (the first version of this
    benchmark did, and under-counted 2 workers by half)."""
    import redis

    redis.Redis.from_url(redis_url).flushdb()


def measure_phase(owner: Any, workers: int, args: argparse.Namespace) -> dict[str, Any]:
    empty_broker(args.redis_url)
    chat_ids = make_chats(owner, args.chats, args.folds_per_chat)
    total = len(chat_ids) * args.folds_per_chat
    processes = start_workers(workers, f"w{workers}", args.redis_url)
    try:
        queue_all(chat_ids)
        # The measured window starts after the first 3 s (first connections, first tasks) and
        # lasts --seconds: a rate over a fixed window, read from the ledger at both ends.
        time.sleep(3)
        start_folds, started = folds_done(chat_ids), time.monotonic()
        time.sleep(args.seconds)
        end_folds, ended = folds_done(chat_ids), time.monotonic()
    finally:
        stop(processes)
    rate = (end_folds - start_folds) / (ended - started)
    return {
        "workers": workers,
        "folds_per_second": round(rate, 1),
        "folds_in_window": end_folds - start_folds,
        "window_seconds": round(ended - started, 1),
        "folds_due": total,
        "drained": end_folds >= total,
    }


def measure_sandwiched(owner: Any, args: argparse.Namespace) -> list[dict[str, Any]]:
    """Phases 1, 2, 1, 2, ..., 1 worker(s) (``args.rounds`` 2-worker phases); for each 2-worker
    phase, its ratio to the mean of its two 1-worker neighbours."""
    ones = [measure_phase(owner, 1, args)]
    rounds = []
    for _ in range(args.rounds):
        two = measure_phase(owner, 2, args)
        ones.append(measure_phase(owner, 1, args))
        before, after = ones[-2]["folds_per_second"], ones[-1]["folds_per_second"]
        baseline = (before + after) / 2
        rounds.append(
            {
                "one_worker_before": ones[-2],
                "two_workers": two,
                "one_worker_after": ones[-1],
                "ratio": round(two["folds_per_second"] / baseline, 3) if baseline else 0.0,
            }
        )
    return rounds


def measure_rss(owner: Any, args: argparse.Namespace) -> dict[str, Any]:
    per_chat = 25
    empty_broker(args.redis_url)
    chat_ids = make_chats(owner, max(args.rss_folds // per_chat, 1), per_chat)
    processes = start_workers(1, "rss", args.redis_url)
    samples: list[tuple[int, int]] = []
    try:
        queue_all(chat_ids)
        deadline = time.monotonic() + args.rss_timeout
        while time.monotonic() < deadline:
            done = folds_done(chat_ids)
            sizes = children_rss_kib(processes)
            if sizes:
                samples.append((done, sizes[0]))
            if done >= args.rss_folds:
                break
            time.sleep(2)  # sampling period of the memory figure, not synchronisation
    finally:
        stop(processes)
    after_warmup = [rss for done, rss in samples if done >= 500]
    first, last = (after_warmup[0], after_warmup[-1]) if after_warmup else (0, 0)
    return {
        "folds": samples[-1][0] if samples else 0,
        "rss_kib_after_500_folds": first,
        "rss_kib_at_end": last,
        "rss_change": round(last / first - 1, 3) if first else None,
        "samples": samples[:: max(len(samples) // 20, 1)],
    }


def parse_args(argv: Sequence[str] | None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(prog="python -m bench.workers")
    parser.add_argument("--chats", type=int, default=500)
    parser.add_argument("--folds-per-chat", type=int, default=25)
    parser.add_argument("--seconds", type=float, default=20.0, help="measured, per phase")
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument("--rss-folds", type=int, default=10_000)
    parser.add_argument("--rss-timeout", type=float, default=300.0)
    parser.add_argument("--database-url", default=DEFAULT_DATABASE_URL)
    parser.add_argument("--redis-url", default="redis://127.0.0.1:6379/8")
    parser.add_argument("--out", default="bench/results/workers.json")
    return parser.parse_args(argv)


def main(argv: Sequence[str] | None = None) -> int:
    args = parse_args(argv)
    ensure_database(args.database_url)
    (ROOT / "artifacts").mkdir(exist_ok=True)
    service = {
        "REDIS_URL": args.redis_url,
        "MEMORY_DISPATCH": "celery",
        "CHAT_BACKEND": "offline",
        "MEMORY_SUMMARIZER_BACKEND": "offline",
        "MEMORY_DAILY_NOTES": "false",
        "MEMORY_POLICY": "sliding-window",
        "LOG_LEVEL": "WARNING",
    }
    configure_django(args.database_url, service)
    from django.contrib.auth import get_user_model

    owner = get_user_model().objects.create_user(username=f"bench-{uuid.uuid4().hex[:8]}")
    rounds = measure_sandwiched(owner, args)
    memory = measure_rss(owner, args)
    empty_broker(args.redis_url)
    ratios = [one_round["ratio"] for one_round in rounds]
    scaling = statistics.median(ratios)
    report = {
        "command": "python -m bench.workers " + " ".join(sys.argv[1:] if argv is None else argv),
        "date": datetime.now(UTC).strftime("%Y-%m-%d %H:%M UTC"),
        "machine": machine_line(),
        "one_worker_folds_per_second_median": round(
            statistics.median(
                phase["folds_per_second"]
                for phase in [
                    rounds[0]["one_worker_before"],
                    *(r["one_worker_after"] for r in rounds),
                ]
            ),
            1,
        ),
        "two_workers_folds_per_second_median": round(
            statistics.median(r["two_workers"]["folds_per_second"] for r in rounds), 1
        ),
        "scaling": round(scaling, 2),
        "scaling_per_round": ratios,
        "rounds": rounds,
        "memory": memory,
        "goals": {
            "2 workers >= 1.7 x 1 worker": scaling >= 1.7,
            "worker RSS flat (+-10%) over 10,000 folds": memory["rss_change"] is not None
            and abs(memory["rss_change"]) <= 0.10
            and memory["folds"] >= 10_000,
        },
    }
    write_report(report, args.out)
    return 0


if __name__ == "__main__":
    sys.exit(main())
