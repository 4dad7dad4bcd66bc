"""A slow model and many clients: with the model answering in 1 s, do 400 concurrent
clients get 0.9 x 400 turns/s for 60 s with no errors, and does consolidation keep up
(lag from a fold becoming due to its commit, p95 < 5 s, no synchronous fold)?

    python -m bench.slow_model [--clients 400] [--model-latency 1.0] [--seconds 60]
                               [--workers 2] [--threads 200] [--worker-class gthread]
                               [--celery-workers 2]
                               [--database-url postgres://postgres@127.0.0.1:5432/chatmem_bench]
                               [--no-proxy] [--no-floor]
                               [--out bench/results/slow_model.json]

Runs, as subprocesses on this machine: the fake OpenAI-compatible server (chat replies after
``--model-latency`` seconds; summaries at once), chatmem under gunicorn (``--workers`` processes
of ``--threads`` threads, or with ``--worker-class gevent`` as many greenlets; a pooled database
connection per process that a turn hands back while the model talks) and ``--celery-workers``
real Celery workers folding with the Chat Completions summarizer against the fake server. Every
chat is on ``sliding-window``. Each of ``--clients`` client threads owns a chat and sends JSON
turns back to back on a keep-alive connection for ``--warmup`` + ``--seconds`` seconds; turns/s
and latency are counted over the last ``--seconds``. Each chat starts ``--history`` messages
long, so folds fall due during the run.
Consolidation lag comes from the ledger: ``finished_at - due_at`` of every fold a
turn asked for that committed during the measured window.

Each phase also reports where the machine's CPU went during its measured window, per process
group, in cores and in milliseconds per turn (``bench/cpu.py``).

Then, on the same server and model (unless ``--no-proxy``), the same clients run the same time
against ``/bench/proxy`` (``bench/proxy_urls.py``): a stateless view that only forwards the
message to the model. It is what this stack does on this machine with no memory at all, the
ceiling any memory service on it is measured against. Then (unless ``--no-floor``) the same
against ``/bench/floor/<chat id>`` on chats of its own as long as chatmem's: a turn that stores
its messages as docs/design.md asks and does nothing else, what storing a turn costs before any
memory work.
"""

from __future__ import annotations

import argparse
import os
import statistics
import sys
import uuid
from collections.abc import Sequence
from datetime import UTC, datetime, timedelta
from pathlib import Path
from typing import Any

from bench.common import (
    configure_django,
    ensure_database,
    insert_history,
    machine_line,
    start_fake_model,
    wait_for,
    write_report,
)
from bench.cpu import service_groups
from bench.throughput import (
    WORKER_CLASSES,
    Phase,
    free_port,
    percentile,
    sampled_phase,
    server_description,
    start_server,
)
from bench.turn_overhead import DEFAULT_DATABASE_URL
from tests.support.workers import Worker

ROOT = Path(__file__).resolve().parent.parent


def parse_args(argv: Sequence[str] | None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(prog="python -m bench.slow_model")
    parser.add_argument("--clients", type=int, default=400)
    parser.add_argument("--model-latency", type=float, default=1.0)
    parser.add_argument("--seconds", type=float, default=60.0)
    parser.add_argument("--warmup", type=float, default=10.0)
    parser.add_argument("--workers", type=int, default=2)
    parser.add_argument("--threads", type=int, default=200, help="requests in flight per process")
    parser.add_argument("--worker-class", choices=WORKER_CLASSES, default="gthread")
    parser.add_argument("--celery-workers", type=int, default=2)
    parser.add_argument(
        "--history", type=int, default=40, help="messages each chat holds before the run"
    )
    parser.add_argument("--pool-size", type=int, default=30, help="DB connections per process")
    parser.add_argument("--database-url", default=DEFAULT_DATABASE_URL)
    parser.add_argument("--redis-url", default="redis://127.0.0.1:6379/7")
    parser.add_argument(
        "--no-proxy", action="store_true", help="skip the stateless proxy phase after the run"
    )
    parser.add_argument(
        "--no-floor",
        action="store_true",
        help="skip the floor phase (bench/proxy_urls.py: storing turns and nothing else)",
    )
    parser.add_argument("--out", default="bench/results/slow_model.json")
    return parser.parse_args(argv)


def service_env(args: argparse.Namespace, model_port: int) -> dict[str, str]:
    return {
        "REDIS_URL": args.redis_url,
        "MEMORY_DISPATCH": "celery",
        "MEMORY_POLICY": "sliding-window",
        "DB_POOL_MAX_SIZE": str(args.pool_size),
        "CHAT_BACKEND": "openai",
        "MEMORY_SUMMARIZER_BACKEND": "chat",
        "OPENAI_API_KEY": "bench",
        "OPENAI_BASE_URL": f"http://127.0.0.1:{model_port}/v1",
        "CHAT_MODEL": "fake-chat",
        "MEMORY_DAILY_NOTES": "false",
        # The throttle stays on (its cost is part of a turn) with a limit the run never reaches.
        "TURN_RATE_LIMIT": "100000000/min",
        "LOG_LEVEL": "WARNING",
        "PYTHONPATH": str(ROOT),
    }


def make_clients(clients: int, history: int, *, floor: bool) -> tuple[str, list[int], list[int]]:
    """A user, a token and one chat per client, each chat already ``history`` messages long
    (none folded: at sliding-window's tail of 40, a fold falls due every 6 turns from the start,
    as in a chat in mid-life); with ``floor``, as many again for the floor phase. Returns (token,
    chatmem's chats, the floor's chats)."""
    from django.contrib.auth import get_user_model
    from rest_framework.authtoken.models import Token

    from conversations.services.chats import create_chat

    user = get_user_model().objects.create_user(username=f"bench-{uuid.uuid4().hex[:8]}")
    made = [
        create_chat(user, title="bench-slow").pk for _ in range(2 * clients if floor else clients)
    ]
    insert_history(
        made,
        history,
        lambda seq: f"Earlier message {seq}: the release plan has {seq % 9} open items.",
        tokens=16,
    )
    return Token.objects.create(user=user).key, made[:clients], made[clients:]


def fold_figures(chat_ids: Sequence[int], since: datetime, until: datetime) -> dict[str, Any]:
    from conversations.models import Consolidation
    from memory_worker.folding.ledger import lag_ms

    folds = Consolidation.objects.filter(
        chat_id__in=chat_ids, finished_at__gte=since, finished_at__lt=until
    )
    succeeded = folds.filter(status="succeeded")
    # The same figure as the chatmem_consolidation_lag_seconds metric.
    lags = [
        (lag_ms(due, finished) or 0) / 1000
        for due, finished in succeeded.values_list("due_at", "finished_at")
        if due is not None and finished is not None
    ]
    return {
        "folds_committed": succeeded.count(),
        "folds_with_due_time": len(lags),
        "folds_failed": folds.filter(status="failed").count(),
        "folds_superseded": folds.filter(status="superseded").count(),
        "synchronous_folds": Consolidation.objects.filter(
            chat_id__in=chat_ids, synchronous=True
        ).count(),
        "lag_p50_s": round(statistics.median(lags), 3) if lags else None,
        "lag_p95_s": round(percentile(lags, 0.95), 3) if lags else None,
        "lag_max_s": round(max(lags), 3) if lags else None,
    }


def backlog(chat_ids: Sequence[int]) -> dict[str, int]:
    from django.db.models import F, Max, Sum

    from conversations.models import Chat

    totals = Chat.objects.filter(pk__in=chat_ids).aggregate(
        unfolded=Sum(F("last_seq") - F("brief__last_consolidated")),
        worst=Max(F("last_seq") - F("brief__last_consolidated")),
    )
    return {"unfolded_messages": totals["unfolded"] or 0, "worst_chat": totals["worst"] or 0}


def in_window(phase: Phase, args: argparse.Namespace) -> list[float]:
    """Latencies of the requests that finished in the measured window, after the warm-up."""
    return phase.finished_within(args.warmup, args.warmup + args.seconds)


def proxy_figures(proxy: Phase, args: argparse.Namespace) -> dict[str, Any]:
    measured = in_window(proxy, args)
    return {
        "turns_per_second": round(len(measured) / args.seconds, 1),
        "latency_p50_ms": round(percentile(measured, 0.50), 1),
        "latency_p99_ms": round(percentile(measured, 0.99), 1),
        "errors": proxy.errors,
        "cpu": proxy.cpu,
    }


def main(argv: Sequence[str] | None = None) -> int:
    args = parse_args(argv)
    ensure_database(args.database_url)
    (ROOT / "artifacts").mkdir(exist_ok=True)
    model_port, server_port = free_port(), free_port()
    configure_django(args.database_url, service_env(args, model_port))
    import redis

    redis.Redis.from_url(args.redis_url).flushdb()
    token, chats, floor_chats = make_clients(args.clients, args.history, floor=not args.no_floor)
    env = {**os.environ, "DJANGO_SETTINGS_MODULE": "chatmem_project.settings"}
    # The server also mounts the stateless proxy (bench.proxy_urls); the workers need no more.
    server_env = {**env, "DJANGO_SETTINGS_MODULE": "bench.settings_proxy"}
    model = start_fake_model(model_port, args.model_latency, 60, env, "bench-slow-model.log")
    workers = [
        Worker(args.redis_url, f"bench-slow-{i}", env={"LOG_LEVEL": "INFO"})  # "ready." is INFO
        for i in range(args.celery_workers)
    ]
    server = None
    try:
        wait_for(model_port, "/v1/models")
        server = start_server(
            server_env, server_port, args.workers, args.threads, args.worker_class
        )
        for worker in workers:
            worker.wait_ready()
        paths = [f"/api/v1/chats/{chat_id}/turns/" for chat_id in chats]
        # One run: the warm-up part (connections, first tokenizer use, the initial burst of
        # 400 clients) is discarded by counting only the turns that finished after it.
        groups = service_groups(
            server.pid, workers=[worker.process.pid for worker in workers], model=model.pid
        )
        phase_started = datetime.now(UTC)
        phase = sampled_phase(
            "chatmem", server_port, paths, token, args.seconds, groups, args.warmup
        )
        phase_ended = datetime.now(UTC)
        window_start = phase_started + timedelta(seconds=args.warmup)
        folds = fold_figures(chats, window_start, phase_ended)
        left = backlog(chats)
        proxy = floor = None
        if not args.no_proxy:
            proxy_paths = ["/bench/proxy"] * args.clients
            proxy = sampled_phase(
                "proxy", server_port, proxy_paths, token, args.seconds, groups, args.warmup
            )
        if floor_chats:
            floor_paths = [f"/bench/floor/{chat_id}" for chat_id in floor_chats]
            floor = sampled_phase(
                "floor", server_port, floor_paths, token, args.seconds, groups, args.warmup
            )
    finally:
        if server is not None:
            server.terminate()
            server.wait(timeout=30)
        for worker in workers:
            worker.stop()
        model.terminate()
        model.wait(timeout=30)
    measured = in_window(phase, args)
    turns_per_second = len(measured) / args.seconds
    goal_rate = 0.9 * args.clients / args.model_latency
    report = {
        "command": "python -m bench.slow_model " + " ".join(sys.argv[1:] if argv is None else argv),
        "date": datetime.now(UTC).strftime("%Y-%m-%d %H:%M UTC"),
        "machine": machine_line(),
        "server": server_description(args.workers, args.threads, args.worker_class),
        "celery_workers": args.celery_workers,
        "clients": args.clients,
        "model_latency_s": args.model_latency,
        "seconds": args.seconds,
        "turns_per_second": round(turns_per_second, 1),
        "turn_latency_p50_ms": round(percentile(measured, 0.50), 1),
        "turn_latency_p99_ms": round(percentile(measured, 0.99), 1),
        "overhead_p50_ms": round(percentile(measured, 0.50) - args.model_latency * 1000, 1),
        "errors": phase.errors,
        "cpu": phase.cpu,
        "stateless_proxy": proxy_figures(proxy, args) if proxy else None,
        # Storing turns as docs/design.md asks and nothing else (bench/proxy_urls.py): what the
        # memory's cost is measured against.
        "floor": proxy_figures(floor, args) if floor else None,
        "ratio_to_proxy": (
            round(len(measured) / len(in_window(proxy, args)), 3)
            if proxy and in_window(proxy, args)
            else None
        ),
        "consolidation": folds,
        "backlog_at_end": left,
        "goals": {
            f"turns/s >= {goal_rate:g}": turns_per_second >= goal_rate,
            "no errors": phase.errors == 0,
            "lag p95 < 5 s": folds["lag_p95_s"] is not None and folds["lag_p95_s"] < 5,
            "no synchronous fold": folds["synchronous_folds"] == 0,
        },
    }
    write_report(report, args.out)
    return 0


if __name__ == "__main__":
    sys.exit(main())
