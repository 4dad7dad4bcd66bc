"""Many slow streams at once: N concurrent streamed turns against a model that takes
2 s before its first token; how much later than the model's own 2 s does each client see its
first byte and its first token?

    python -m bench.streams [--streams 200] [--model-latency 2.0] [--workers 4] [--spread 0]
                            [--database-url postgres://postgres@127.0.0.1:5432/chatmem_bench]
                            [--out bench/results/streams.json]

Runs the fake OpenAI-compatible server (``python -m tests.support.fake_openai``) and chatmem under
uvicorn (ASGI, ``--workers`` processes; docs/streaming.md says why ASGI for many open streams) as
subprocesses, with PostgreSQL (a pool per process, opened before the run) and Redis as in
production. After a warm-up of 4 streams per worker, each of ``--streams`` client threads owns a
chat and sends one streamed turn and reads the events: all released in the same instant
(``--spread 0``, a burst), or arriving evenly over ``--spread`` seconds (``--spread 2`` with the
model's 2 s: 100 arrivals a second, all 200 open at the peak; the report says how many were
open at once). Figures: time to first byte (the ``accepted`` event), time to the first
``delta`` minus the model's latency (the overhead chatmem adds to the first token), time to
``done``, errors.
"""

from __future__ import annotations

import argparse
import http.client
import json
import os
import statistics
import sys
import threading
import time
from collections.abc import Sequence
from dataclasses import dataclass
from datetime import UTC, datetime
from pathlib import Path
from typing import Any

from bench.common import (
    ensure_database,
    machine_line,
    start,
    start_fake_model,
    wait_for,
    write_report,
)
from bench.throughput import free_port, percentile, prepare
from bench.turn_overhead import DEFAULT_DATABASE_URL

ROOT = Path(__file__).resolve().parent.parent


@dataclass
class StreamResult:
    started: float = 0.0  # perf_counter() when the request went out
    first_byte: float | None = None
    first_delta: float | None = None
    done: float | None = None
    error: str = ""


def one_stream(
    port: int, token: str, chat_id: int, go: threading.Barrier, delay: float = 0.0
) -> StreamResult:
    result = StreamResult()
    body = json.dumps({"content": "Tell me about the release plan.", "stream": True})
    headers = {
        "Authorization": f"Token {token}",
        "Content-Type": "application/json",
        "Accept": "text/event-stream",
    }
    connection = http.client.HTTPConnection("127.0.0.1", port, timeout=60)
    go.wait()
    if delay:
        time.sleep(delay)  # this client's arrival time in a spread-out schedule
    started = result.started = time.perf_counter()
    try:
        connection.request("POST", f"/api/v1/chats/{chat_id}/turns/", body=body, headers=headers)
        response = connection.getresponse()
        if response.status != 200:
            result.error = f"HTTP {response.status}: {response.read()[:200]!r}"
            return result
        while line := response.readline():
            now = time.perf_counter() - started
            if result.first_byte is None:
                result.first_byte = now
            text = line.decode().strip()
            if text == "event: delta" and result.first_delta is None:
                result.first_delta = now
            elif text == "event: error":
                result.error = "error event"
            elif text == "event: done":
                result.done = now
                break
    except (OSError, http.client.HTTPException) as error:
        result.error = repr(error)
    finally:
        connection.close()
    return result


def run_streams(
    port: int, token: str, chats: Sequence[int], spread: float = 0.0
) -> list[StreamResult]:
    """All clients released together (``spread`` 0: a burst), or arriving evenly over
    ``spread`` seconds."""
    go = threading.Barrier(len(chats))
    results: list[StreamResult] = [StreamResult() for _ in chats]

    def client(index: int) -> None:
        delay = spread * index / len(chats)
        results[index] = one_stream(port, token, chats[index], go, delay)

    threads = [threading.Thread(target=client, args=(i,)) for i in range(len(chats))]
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join()
    return results


def most_open(results: Sequence[StreamResult]) -> int:
    """The largest number of streams open at the same moment (request sent, done not read)."""
    edges = [(r.started, 1) for r in results if r.done is not None] + [
        (r.started + r.done, -1) for r in results if r.done is not None
    ]
    open_now = most = 0
    for _, change in sorted(edges):
        open_now += change
        most = max(most, open_now)
    return most


def summary(values: Sequence[float]) -> dict[str, float]:
    if not values:
        return {}
    return {
        "p50_ms": round(statistics.median(values) * 1000, 1),
        "p99_ms": round(percentile(values, 0.99) * 1000, 1),
        "max_ms": round(max(values) * 1000, 1),
    }


def parse_args(argv: Sequence[str] | None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(prog="python -m bench.streams")
    parser.add_argument("--streams", type=int, default=200)
    parser.add_argument("--model-latency", type=float, default=2.0)
    parser.add_argument("--workers", type=int, default=4)
    parser.add_argument(
        "--spread",
        type=float,
        default=0.0,
        help="seconds over which the streams arrive evenly (0: all at once)",
    )
    parser.add_argument("--database-url", default=DEFAULT_DATABASE_URL)
    parser.add_argument("--redis-url", default="redis://127.0.0.1:6379/9")
    parser.add_argument("--out", default="bench/results/streams.json")
    return parser.parse_args(argv)


def main(argv: Sequence[str] | None = None) -> int:
    args = parse_args(argv)
    ensure_database(args.database_url)
    (ROOT / "artifacts").mkdir(exist_ok=True)
    model_port, server_port = free_port(), free_port()
    env: dict[str, Any] = {
        **os.environ,
        "DJANGO_SETTINGS_MODULE": "chatmem_project.settings",
        "DATABASE_URL": args.database_url,
        "REDIS_URL": args.redis_url,
        # ASGI: pooled connections, bounded so all processes together stay within 80 (PostgreSQL
        # allows 100).
        "DB_POOL_MAX_SIZE": str(80 // args.workers),
        "DB_POOL_MIN_SIZE": str(80 // args.workers),  # opened before the measured run
        "CHAT_BACKEND": "openai",
        "OPENAI_API_KEY": "bench",
        "OPENAI_BASE_URL": f"http://127.0.0.1:{model_port}/v1",
        "CHAT_MODEL": "fake-chat",
        "MEMORY_SUMMARIZER_BACKEND": "offline",
        "TURN_RATE_LIMIT": "100000000/min",
        "LOG_LEVEL": "WARNING",
        "ALLOWED_HOSTS": "127.0.0.1,localhost",
        "PYTHONPATH": str(ROOT),
    }
    warmup = 4 * args.workers
    token, chats = prepare(env, args.streams + warmup)
    python = sys.executable
    model = start_fake_model(model_port, args.model_latency, 40, env, "bench-streams-model.log")
    server = start(
        [
            python,
            "-m",
            "uvicorn",
            "chatmem_project.asgi:application",
            "--host",
            "127.0.0.1",
            "--port",
            str(server_port),
            "--workers",
            str(args.workers),
            "--log-level",
            "warning",
        ],
        env,
        "bench-streams-server.log",
    )
    try:
        wait_for(model_port, "/v1/models")
        wait_for(server_port, "/healthz")
        # First requests of a fresh process load the tokenizer, open the model client and the
        # database connection: not what is measured here.
        run_streams(server_port, token, chats[:warmup])
        started = time.perf_counter()
        results = run_streams(server_port, token, chats[warmup:], args.spread)
        wall = time.perf_counter() - started
    finally:
        for process in (server, model):
            process.terminate()
            process.wait(timeout=30)
    completed = [r for r in results if r.done is not None and not r.error]
    overheads = [r.first_delta - args.model_latency for r in completed if r.first_delta]
    errors = [r.error for r in results if r.error or r.done is None]
    p99_overhead = summary(overheads).get("p99_ms", float("inf"))
    report = {
        "command": "python -m bench.streams " + " ".join(sys.argv[1:] if argv is None else argv),
        "date": datetime.now(UTC).strftime("%Y-%m-%d %H:%M UTC"),
        "machine": machine_line(),
        "server": f"uvicorn chatmem_project.asgi:application --workers {args.workers}",
        "streams": args.streams,
        "arrivals": f"evenly over {args.spread:g} s" if args.spread else "all at once",
        "most_open_at_once": most_open(results),
        "model_latency_s": args.model_latency,
        "completed": len(completed),
        "errors": len(errors),
        "error_examples": errors[:5],
        "wall_s": round(wall, 2),
        "time_to_first_byte": summary([r.first_byte for r in completed if r.first_byte]),
        "first_token_overhead": summary(overheads),
        "time_to_done": summary([r.done for r in completed if r.done]),
        "goal": "all complete, p99 first-token overhead < 100 ms",
        "met": not errors and p99_overhead < 100,
    }
    write_report(report, args.out)
    return 0


if __name__ == "__main__":
    sys.exit(main())
