"""Throughput against a stateless proxy: chatmem's turns per second at concurrency 16 beside a
minimal stateless view on the same stack that only forwards the message to the model, and beside the
floor: a turn that stores its messages as docs/design.md asks (data model, the turn) and does
nothing else.

    python -m bench.throughput [--concurrency 16] [--seconds 10] [--rounds 3]
                               [--model offline|fake-server] [--worker-class gthread|gevent]
                               [--database-url postgres://postgres@127.0.0.1:5432/chatmem_bench]
                               [--out bench/results/throughput.json]

One gunicorn server (``--workers`` processes of ``--threads`` threads, as docs/operations.md
runs it) serves ``POST /api/v1/chats/{id}/turns/``, ``POST /bench/proxy`` and ``POST
/bench/floor/{id}`` (see ``bench/proxy_urls.py``), on PostgreSQL and Redis as the broker (turns
enqueue folds; no worker consumes them during the run). Behind all three: the offline model
(instant, in process), or with ``--model fake-server`` the fake OpenAI-compatible server in its
own process, answering at once.
The load comes from ``--concurrency`` client threads of this process, each with its own
keep-alive connection and, for chatmem and the floor, its own chat (a chat takes one turn at a
time). Phases alternate proxy, chatmem, floor, proxy... so all see the same machine; figures are
medians over rounds.
"""

from __future__ import annotations

import argparse
import http.client
import json
import os
import socket
import statistics
import subprocess
import sys
import threading
import time
import uuid
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from datetime import UTC, datetime
from pathlib import Path
from typing import Any

from bench.common import (
    ensure_database,
    machine_line,
    start_fake_model,
    wait_for,
    write_report,
)
from bench.cpu import Groups, WindowSampler, median_usage, service_groups
from bench.turn_overhead import DEFAULT_DATABASE_URL

ROOT = Path(__file__).resolve().parent.parent


@dataclass
class Phase:
    name: str
    seconds: float
    latencies_ms: list[float] = field(default_factory=list)
    # Seconds from the phase's start at which each counted request finished (same order).
    finished_at: list[float] = field(default_factory=list)
    errors: int = 0
    cpu: dict[str, Any] | None = None  # where the machine's CPU went (bench.cpu), if sampled

    def finished_within(self, start: float, end: float) -> list[float]:
        """Latencies of the requests that finished from ``start`` to ``end`` seconds into the
        phase. The clients stop sending at the phase's end, but the requests then in flight
        finish after it: counted, they inflated a rate taken over the phase's length (with 400
        clients waiting 1 s on the model, by about 400 turns a minute)."""
        return [
            latency
            for finished, latency in zip(self.finished_at, self.latencies_ms, strict=True)
            if start <= finished < end
        ]

    @property
    def per_second(self) -> float:
        return len(self.finished_within(0.0, self.seconds)) / self.seconds


def free_port() -> int:
    with socket.socket() as probe:
        probe.bind(("127.0.0.1", 0))
        return int(probe.getsockname()[1])


def model_env(model_port: int | None) -> dict[str, str]:
    """Where both sides' model (and the turns' synchronous folds' summarizer) lives: in process
    (``offline``), or the fake OpenAI-compatible server on ``model_port``."""
    if model_port is None:
        return {"CHAT_BACKEND": "offline", "MEMORY_SUMMARIZER_BACKEND": "offline"}
    return {
        "CHAT_BACKEND": "openai",
        "MEMORY_SUMMARIZER_BACKEND": "chat",
        "OPENAI_API_KEY": "bench",
        "OPENAI_BASE_URL": f"http://127.0.0.1:{model_port}/v1",
        "CHAT_MODEL": "fake-chat",
    }


def server_env(database_url: str, redis_url: str, model_port: int | None = None) -> dict[str, str]:
    return {
        **os.environ,
        "DJANGO_SETTINGS_MODULE": "bench.settings_proxy",
        "DATABASE_URL": database_url,
        "REDIS_URL": redis_url,
        **model_env(model_port),
        "LOG_LEVEL": "WARNING",
        # The throttle stays on (its cost, two Redis calls, is part of a turn), never reached.
        "TURN_RATE_LIMIT": "100000000/min",
        "ALLOWED_HOSTS": "127.0.0.1,localhost",
        "PYTHONPATH": str(ROOT),
    }


def prepare(env: dict[str, str], clients: int) -> tuple[str, list[int]]:
    """Migrate, then a user, a token and ``clients`` chats. Returns (token, chat ids)."""
    python = sys.executable
    subprocess.run([python, "manage.py", "migrate", "-v", "0"], cwd=ROOT, env=env, check=True)
    script = (
        "import django, json, uuid; django.setup();"
        "from django.contrib.auth import get_user_model;"
        "from rest_framework.authtoken.models import Token;"
        "from conversations.services.chats import create_chat;"
        "user = get_user_model().objects.create_user(username='bench-' + uuid.uuid4().hex[:8]);"
        f"chats = [create_chat(user, title='bench').pk for _ in range({clients})];"
        "print(json.dumps({'token': Token.objects.create(user=user).key, 'chats': chats}))"
    )
    out = subprocess.run(
        [python, "-c", script], cwd=ROOT, env=env, check=True, capture_output=True, text=True
    )
    made = json.loads(out.stdout.strip().splitlines()[-1])
    return made["token"], made["chats"]


WORKER_CLASSES = ("gthread", "gevent")


def concurrency_options(worker_class: str, threads: int) -> list[str]:
    """gunicorn's options for ``threads`` requests in flight per process: threads (gthread) or
    greenlets (gevent: ``--worker-connections``)."""
    if worker_class == "gevent":
        return ["--worker-class", "gevent", "--worker-connections", str(threads)]
    return ["--worker-class", "gthread", "--threads", str(threads)]


def server_description(workers: int, threads: int, worker_class: str) -> str:
    options = concurrency_options(worker_class, threads)
    return " ".join(["gunicorn --workers", str(workers), *options])


def gunicorn_command(port: int, workers: int, threads: int, worker_class: str) -> list[str]:
    """This virtualenv's gunicorn serving chatmem on 127.0.0.1:``port``."""
    return [
        str(Path(sys.executable).parent / "gunicorn"),
        "chatmem_project.wsgi:application",
        "--bind",
        f"127.0.0.1:{port}",
        "--workers",
        str(workers),
        *concurrency_options(worker_class, threads),
    ]


def start_server(
    env: dict[str, str], port: int, workers: int, threads: int, worker_class: str = "gthread"
) -> subprocess.Popen:
    command = [*gunicorn_command(port, workers, threads, worker_class), "--log-level", "warning"]
    log_path = ROOT / "artifacts" / "bench-throughput-gunicorn.log"
    log = open(log_path, "w")  # noqa: SIM115
    server = subprocess.Popen(command, cwd=ROOT, env=env, stdout=log, stderr=log)
    deadline = time.monotonic() + 30
    while time.monotonic() < deadline:
        if server.poll() is not None:  # it refused to start (a check error, a bad option...)
            tail = log_path.read_text().strip().splitlines()[-5:]
            raise SystemExit("gunicorn exited at start:\n" + "\n".join(tail))
        try:
            connection = http.client.HTTPConnection("127.0.0.1", port, timeout=2)
            connection.request("GET", "/healthz")
            if connection.getresponse().status == 200:
                return server
        except OSError:
            time.sleep(0.2)  # the server is still starting: poll until the deadline
    server.kill()
    raise SystemExit("gunicorn did not answer /healthz within 30 s")


Request = Callable[[http.client.HTTPConnection, int], int]


def post(path: str, token: str) -> Callable[[http.client.HTTPConnection, int], int]:
    headers = {"Authorization": f"Token {token}", "Content-Type": "application/json"}

    def send(connection: http.client.HTTPConnection, number: int) -> int:
        body = json.dumps({"content": f"Message {number}: what is the next step?"})
        connection.request("POST", path, body=body, headers=headers)
        response = connection.getresponse()
        response.read()
        return response.status

    return send


def run_phase(name: str, port: int, paths: Sequence[str], token: str, seconds: float) -> Phase:
    phase = Phase(name, seconds)
    lock = threading.Lock()
    phase_start = time.monotonic()
    stop_at = phase_start + seconds

    def client(path: str) -> None:
        connection = http.client.HTTPConnection("127.0.0.1", port, timeout=30)
        send = post(path, token)
        number = 0
        while time.monotonic() < stop_at:
            number += 1
            started = time.perf_counter()
            try:
                status = send(connection, number)
            except (OSError, http.client.HTTPException):
                status = 0
                connection.close()
                connection = http.client.HTTPConnection("127.0.0.1", port, timeout=30)
            elapsed = (time.perf_counter() - started) * 1000
            with lock:
                if status == 201:
                    phase.latencies_ms.append(elapsed)
                    phase.finished_at.append(time.monotonic() - phase_start)
                else:
                    phase.errors += 1
        connection.close()

    threads = [threading.Thread(target=client, args=(path,)) for path in paths]
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join()
    return phase


def sampled_phase(
    name: str,
    port: int,
    paths: Sequence[str],
    token: str,
    seconds: float,
    groups: Groups,
    warmup: float = 0.0,
) -> Phase:
    """run_phase for ``warmup`` + ``seconds``, with the CPU each process group took during the
    last ``seconds`` per request finished in them (bench.cpu)."""
    sampler = WindowSampler(groups, warmup, seconds).start()
    phase = run_phase(name, port, paths, token, warmup + seconds)
    phase.cpu = sampler.result(len(phase.finished_within(warmup, warmup + seconds)))
    return phase


def percentile(values: Sequence[float], share: float) -> float:
    ordered = sorted(values)
    return ordered[min(int(share * len(ordered)), len(ordered) - 1)] if ordered else 0.0


def describe(phases: Sequence[Phase]) -> dict[str, Any]:
    latencies = [value for phase in phases for value in phase.finished_within(0.0, phase.seconds)]
    return {
        "turns_per_second_median": round(statistics.median(p.per_second for p in phases), 1),
        "turns_per_second_rounds": [round(p.per_second, 1) for p in phases],
        "p50_ms": round(percentile(latencies, 0.50), 2),
        "p99_ms": round(percentile(latencies, 0.99), 2),
        "requests": len(latencies),
        "errors": sum(p.errors for p in phases),
        "cpu": median_usage([p.cpu for p in phases if p.cpu is not None]),
    }


def parse_args(argv: Sequence[str] | None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(prog="python -m bench.throughput")
    parser.add_argument("--concurrency", type=int, default=16)
    parser.add_argument("--seconds", type=float, default=10.0, help="per phase")
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument("--workers", type=int, default=2)
    parser.add_argument("--threads", type=int, default=8, help="requests in flight per process")
    parser.add_argument("--worker-class", choices=WORKER_CLASSES, default="gthread")
    parser.add_argument("--database-url", default=DEFAULT_DATABASE_URL)
    parser.add_argument("--redis-url", default="redis://127.0.0.1:6379/9")
    parser.add_argument(
        "--model",
        choices=["offline", "fake-server"],
        default="offline",
        help="offline: in process (the strictest reading: the proxy does next to nothing); "
        "fake-server: the fake OpenAI-compatible server in its own process, answering at once",
    )
    parser.add_argument("--out", default="bench/results/throughput.json")
    return parser.parse_args(argv)


def synchronous_folds(database_url: str, chat_ids: Sequence[int]) -> int | None:
    """Folds the turns ran themselves: with no worker consuming, a chat's unfolded tail reaches the
    policy's hard bound and the next turn folds before calling the model (docs/design.md, the turn,
    step 4)."""
    if not database_url.startswith("postgres"):
        return None
    import psycopg

    url = database_url.replace("postgres://", "postgresql://", 1)
    with psycopg.connect(url) as connection:
        found = connection.execute(
            "SELECT count(*) FROM conversations_consolidation "
            "WHERE synchronous AND chat_id = ANY(%s)",
            (list(chat_ids),),
        ).fetchone()
    return int(found[0]) if found else 0


def main(argv: Sequence[str] | None = None) -> int:
    args = parse_args(argv)
    ensure_database(args.database_url)
    (ROOT / "artifacts").mkdir(exist_ok=True)
    model_port = free_port() if args.model == "fake-server" else None
    env = server_env(args.database_url, args.redis_url, model_port)
    if args.worker_class == "gevent":
        # Required under gevent (chatmem.E005): as many connections as gthread's threads hold.
        env["DB_POOL_MAX_SIZE"] = str(args.threads)
    # One chat per client for chatmem's turns, and as many for the floor's.
    token, made = prepare(env, 2 * args.concurrency)
    chats, floor_chats = made[: args.concurrency], made[args.concurrency :]
    model = None
    if model_port is not None:  # answering at once, replies of its own length
        model = start_fake_model(model_port, 0, None, env, "bench-throughput-model.log")
        wait_for(model_port, "/v1/models")
    port = free_port()
    server = start_server(env, port, args.workers, args.threads, args.worker_class)
    proxy_paths = ["/bench/proxy"] * args.concurrency
    turn_paths = [f"/api/v1/chats/{chat}/turns/" for chat in chats]
    floor_paths = [f"/bench/floor/{chat}" for chat in floor_chats]
    sides = {"proxy": proxy_paths, "chatmem": turn_paths, "floor": floor_paths}
    results: dict[str, list[Phase]] = {side: [] for side in sides}
    try:
        for paths in sides.values():
            run_phase("warmup", port, paths, token, 2)
        groups = service_groups(server.pid, model=model.pid if model is not None else None)
        for _ in range(args.rounds):
            for side, paths in sides.items():
                phase = sampled_phase(side, port, paths, token, args.seconds, groups)
                results[side].append(phase)
    finally:
        for process in (server, model):
            if process is not None:
                process.terminate()
                process.wait(timeout=30)
        import redis

        redis.Redis.from_url(args.redis_url).flushdb()  # the folds nobody consumed
    proxy, chatmem = describe(results["proxy"]), describe(results["chatmem"])
    floor = describe(results["floor"])
    chatmem["synchronous_folds"] = synchronous_folds(args.database_url, chats)
    ratio = chatmem["turns_per_second_median"] / proxy["turns_per_second_median"]
    floor_ratio = floor["turns_per_second_median"] / proxy["turns_per_second_median"]
    report = {
        "command": "python -m bench.throughput " + " ".join(sys.argv[1:] if argv is None else argv),
        "date": datetime.now(UTC).strftime("%Y-%m-%d %H:%M UTC"),
        "machine": machine_line(),
        "server": server_description(args.workers, args.threads, args.worker_class),
        "model": args.model,
        "concurrency": args.concurrency,
        "proxy": proxy,
        "chatmem": chatmem,
        "floor": floor,
        "ratio_chatmem_to_proxy": round(ratio, 3),
        # A turn that stores its messages as docs/design.md asks and does nothing else, against the
        # proxy: what the 0.5 goal leaves the memory room for (bench/proxy_urls.py).
        "ratio_floor_to_proxy": round(floor_ratio, 3),
        "ratio_chatmem_to_floor": round(ratio / floor_ratio, 3),
        "goals": {
            "ratio >= 0.5": ratio >= 0.5,
            "chatmem >= 150 turns/s": chatmem["turns_per_second_median"] >= 150,
            "chatmem p50 <= 15 ms": chatmem["p50_ms"] <= 15,
        },
        "run_id": uuid.uuid4().hex[:8],
    }
    write_report(report, args.out)
    return 0


if __name__ == "__main__":
    sys.exit(main())
