"""Turn latency while Redis accepts connections and never answers, and how long after it recovers
every chat has folded, on the production path: chatmem under gunicorn whose Redis (broker and
throttle) is a TCP proxy that either forwards to the real Redis or stalls (accepts, reads, never
answers); ``celery beat`` through the same proxy; a real ``celery worker`` on the real Redis;
PostgreSQL; the fake model server.

    python -m bench.stalled_redis [--chats 20] [--turns 200] [--sweep-interval 60]
                                  [--overflow-buffer 1 --context-size 40]
                                  [--redis-url URL] [--database-url URL]
                                  [--out bench/results/stalled_redis.json]

Chats are ``contract`` chats (tail 6, buffer 4): a fold comes due every few turns; with
``--overflow-buffer 1 --context-size 40`` a fold is due from 8 unfolded messages and a turn
folds synchronously only past 40, so the stalled phase ends with every chat due. Phase
"healthy": ``--turns`` turns over HTTP, one at a time, round-robin over the chats, the proxy
forwarding; the worker folds what they queue. Then the proxy stalls (beat, which reaches Redis
through it too, cannot queue its sweeps) and phase "stalled" takes ``--turns`` more turns on the
same chats. Then the proxy forwards again, and the report gives the time from that recovery
until no chat has a fold due, beside the limit of two sweep intervals. The sweep's
MEMORY_SWEEP_MIN_COOLDOWN_SECONDS keeps its default (60 s). Latency is measured at the client
(p50, p99 per phase).

Needs PostgreSQL (``--database-url``, default ``$DATABASE_URL``: a fresh database on that server,
dropped at the end) and a ``redis-server`` binary (a private one) unless ``--redis-url``.
"""

from __future__ import annotations

import argparse
import contextlib
import os
import shlex
import socket
import sys
import threading
import time
from collections import Counter
from collections.abc import Sequence
from datetime import UTC, datetime
from typing import Any

from bench.chaos import private_or_given_redis, scratch_database
from bench.common import ROOT, configure_django, machine_info, start, write_report
from bench.kill_recovery import start_beat, wait
from bench.slow_model import service_env
from bench.throughput import free_port, gunicorn_command, percentile
from bench.topology import Api, make_token
from tests.support.fake_openai import FakeOpenAI
from tests.support.workers import Worker

GUNICORN_LOG = "bench-stalled-redis-gunicorn.log"


class StallingProxy:
    """A TCP proxy to Redis that forwards, or (``stall()``) accepts connections, reads what it
    is sent and never answers, on new and open connections alike. ``forward()`` closes the
    connections that stalled (their replies were dropped: a client reconnects) and forwards
    again."""

    def __init__(self, upstream_port: int) -> None:
        self.upstream_port = upstream_port
        self.listener = socket.create_server(("127.0.0.1", 0))
        self.port = int(self.listener.getsockname()[1])
        self.stalled = threading.Event()
        self.pairs: list[tuple[socket.socket, socket.socket | None]] = []
        self.guard = threading.Lock()
        threading.Thread(target=self.accept, daemon=True).start()

    def url(self, db: int) -> str:
        return f"redis://127.0.0.1:{self.port}/{db}"

    def accept(self) -> None:
        while True:
            try:
                client, _ = self.listener.accept()
            except OSError:
                return
            upstream = None
            if not self.stalled.is_set():
                with contextlib.suppress(OSError):
                    upstream = socket.create_connection(("127.0.0.1", self.upstream_port))
            with self.guard:
                self.pairs.append((client, upstream))
            threading.Thread(target=self.pump, args=(client, upstream), daemon=True).start()
            if upstream is not None:
                threading.Thread(target=self.pump, args=(upstream, client), daemon=True).start()

    def pump(self, source: socket.socket, target: socket.socket | None) -> None:
        with contextlib.suppress(OSError):
            while data := source.recv(65536):
                if target is not None and not self.stalled.is_set():
                    target.sendall(data)
        for end in (source, target):
            if end is not None:
                with contextlib.suppress(OSError):
                    end.close()

    def stall(self) -> None:
        self.stalled.set()

    def forward(self) -> None:
        with self.guard:
            pairs, self.pairs = self.pairs, []
        self.stalled.clear()
        for pair in pairs:
            for end in pair:
                if end is not None:
                    with contextlib.suppress(OSError):
                        end.close()

    def close(self) -> None:
        self.listener.close()
        self.forward()


def folds_due(chat_ids: Sequence[int]) -> list[int]:
    from django.utils import timezone

    from conversations.models import Chat
    from memory_worker.folding.execute import decide_for_chat
    from memory_worker.folding.snapshot import load_snapshot

    now = timezone.now()
    return [
        chat.pk
        for chat in Chat.objects.filter(pk__in=chat_ids)
        if decide_for_chat(chat, load_snapshot(chat.pk), now) is not None
    ]


def play(api: Api, chat_ids: Sequence[int], turns: int, phase: str) -> dict[str, Any]:
    """``turns`` turns, one at a time, round-robin over the chats; client-side latency."""
    seconds: list[float] = []
    refused: Counter[int] = Counter()
    # A fresh connection: gunicorn closes one idle past its keep-alive (2 s) between phases, and
    # the first turn would then fail at the client (status 0) without reaching the server.
    api.close()
    for number in range(turns):
        chat_id = chat_ids[number % len(chat_ids)]
        body = {"content": f"{phase} turn {number}: we agreed the code is {number * 7919}."}
        started = time.perf_counter()
        status, _ = api.call("POST", f"/api/v1/chats/{chat_id}/turns/", body)
        seconds.append(time.perf_counter() - started)
        if status != 201:
            refused[status] += 1
    return {
        "turns": turns,
        "not_201": dict(refused),
        "p50_ms": round(percentile(seconds, 0.50) * 1000, 1),
        "p99_ms": round(percentile(seconds, 0.99) * 1000, 1),
        "max_ms": round(max(seconds) * 1000, 1),
        "chats_with_fold_due_after": len(folds_due(chat_ids)),
    }


def start_web(env: dict[str, str], port: int) -> Any:
    command = [*gunicorn_command(port, 2, 4, "gthread"), "--log-level", "warning"]
    server = start(command, env, GUNICORN_LOG)
    deadline = time.monotonic() + 60
    while time.monotonic() < deadline:
        probe = Api(port, "")
        answered = probe.call("GET", "/healthz")[0] == 200
        probe.close()
        if answered:
            return server
        if server.poll() is not None:
            break
        time.sleep(0.2)  # still starting: poll until the deadline
    server.kill()
    raise SystemExit(f"gunicorn did not start; see artifacts/{GUNICORN_LOG}")


def run(args: argparse.Namespace, database_url: str) -> dict[str, Any]:
    (ROOT / "artifacts").mkdir(exist_ok=True)
    with (
        FakeOpenAI() as model,
        private_or_given_redis(args.redis_url) as redis_url,
    ):
        real_port = int(redis_url.split(":")[2].split("/")[0])
        db = int(redis_url.rsplit("/", 1)[1] or 0)
        proxy = StallingProxy(real_port)
        model_port = int(model.base_url.split(":")[2].split("/")[0])
        shared = argparse.Namespace(redis_url=redis_url, pool_size=4)
        timing = {
            "MEMORY_SWEEP_INTERVAL_SECONDS": str(args.sweep_interval),
            "MEMORY_SUMMARIZER_MODEL": "fake-summarizer",
        }
        configure_django(database_url, {**service_env(shared, model_port), **timing})
        web_env = {
            **os.environ,
            "REDIS_URL": proxy.url(db),
            "ALLOWED_HOSTS": "127.0.0.1,localhost",
            "MEMORY_POLICY": "contract",
        }
        worker = Worker(redis_url, "stalledbench", env={"LOG_LEVEL": "INFO"})
        # Beat reaches Redis through the proxy, as the web does: its ticks during the stall fail.
        beat = start_beat(
            proxy.url(db), ROOT / "artifacts" / f"stalled-redis-beat-{time.time_ns()}"
        )
        port = free_port()
        server = start_web(web_env, port)
        try:
            worker.wait_ready(timeout=180)
            return measure(args, port, proxy)
        finally:
            server.terminate()
            server.wait(timeout=20)
            beat.terminate()
            worker.stop()
            proxy.close()


def measure(args: argparse.Namespace, port: int, proxy: StallingProxy) -> dict[str, Any]:
    api = Api(port, make_token())
    chat_ids = []
    overrides = {
        knob: value
        for knob, value in (
            ("overflow_buffer", args.overflow_buffer),
            ("context_size", args.context_size),
        )
        if value is not None
    }
    for number in range(args.chats):
        status, body = api.call(
            "POST",
            "/api/v1/chats/",
            {"title": f"stalled {number}", "policy": "contract", "policy_overrides": overrides},
        )
        assert status == 201, body
        chat_ids.append(int(body["id"]))
    play(api, chat_ids, len(chat_ids) * 2, "warm-up")
    healthy = play(api, chat_ids, args.turns, "healthy")
    wait(lambda: not folds_due(chat_ids), timeout=120, interval=0.5)
    proxy.stall()
    stalled = play(api, chat_ids, args.turns, "stalled")
    due_at_recovery = len(folds_due(chat_ids))
    proxy.forward()
    recovered = time.monotonic()
    patience = args.timeout or 3 * args.sweep_interval
    folded = wait(lambda: not folds_due(chat_ids), timeout=patience, interval=0.2)
    seconds = time.monotonic() - recovered
    limit = 2 * args.sweep_interval
    return {
        "healthy": healthy,
        "stalled": stalled,
        "p99_difference_ms": round(stalled["p99_ms"] - healthy["p99_ms"], 1),
        "chats": len(chat_ids),
        "chats_with_fold_due_at_recovery": due_at_recovery,
        "all_folded": folded,
        "seconds_to_fold_all_after_recovery": round(seconds, 1),
        "two_sweep_intervals_s": limit,
        "within_two_sweep_intervals": folded and seconds <= limit,
        "still_due": folds_due(chat_ids),
    }


def parse_args(argv: Sequence[str] | None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(prog="python -m bench.stalled_redis")
    parser.add_argument("--chats", type=int, default=20)
    parser.add_argument("--turns", type=int, default=200, help="per phase")
    parser.add_argument("--sweep-interval", type=float, default=60.0, help="default: as deployed")
    parser.add_argument("--overflow-buffer", type=int, default=None, help="contract's B")
    parser.add_argument("--context-size", type=int, default=None, help="contract's bound")
    parser.add_argument(
        "--timeout", type=float, default=None, help="for the folds; default 3 sweep intervals"
    )
    parser.add_argument("--redis-url", default=None, help="default: a private redis-server")
    parser.add_argument("--database-url", default=None)
    parser.add_argument("--out", default="bench/results/stalled_redis.json")
    return parser.parse_args(argv)


def main(argv: Sequence[str] | None = None) -> int:
    args = parse_args(argv)
    command = ["python", "-m", "bench.stalled_redis", *(sys.argv[1:] if argv is None else argv)]
    with scratch_database(args.database_url) as database_url:
        figures = run(args, database_url)
    report = {
        "command": shlex.join(command),
        "date": datetime.now(UTC).strftime("%Y-%m-%d %H:%M UTC"),
        "machine": machine_info(),
        **figures,
    }
    write_report(report, args.out)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
