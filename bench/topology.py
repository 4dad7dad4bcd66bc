"""Memory cost on the deployed topology.

``bench/cost.py`` plays the Celery worker serially, in process, after every turn. This benchmark
measures the same figures on what users deploy, every part a process of its own on this machine:

- a fresh PostgreSQL database (created, migrated, dropped at the end unless --keep-database);
- Redis (``--redis-url``; only that database is flushed, at the start and at the end);
- chatmem under gunicorn (MEMORY_DISPATCH=celery, the Chat Completions model and summarizer);
- ``--celery-workers`` real ``celery worker`` processes on the memory queue;
- the fake OpenAI-compatible server (``tests.support.fake_openai``) in this process, recording every
  request: chat replies after ``--model-latency`` seconds, summaries after
  ``--summarizer-latency``, written with ``--summarizer-habits`` (a summarizer at its worst:
  ``pads`` keeps the newest facts in half its room and fills the rest with prose,
  ``ignores-repairs`` answers the fold guard's repair request with its draft).

    python -m bench.topology [--configs all|name,...] [--overrides JSON] [--chats 1]
                             [--turns 600] [--seed 7] [--celery-workers 2]
                             [--model-latency 0] [--summarizer-latency 0]
                             [--summarizer-habits pads,ignores-repairs]
                             [--redis-url redis://127.0.0.1:6379/11]
                             [--postgres-url postgres://postgres@127.0.0.1:5432]
                             [--keep-database] [--out bench/results/topology.json]

Each configuration gets ``--chats`` new chats. Each chat plays bench.cost's seeded synthetic
conversation (chat c with seed ``--seed`` + c) through the REST API over HTTP, one client thread
per chat, a turn sent when the previous one's answer arrived. The tags of chat c's messages are
its own, so every request at the fake server is attributed to its chat, and bench.cost's
measuring functions run on each chat's requests unchanged. A configuration is measured once the
workers are idle: nothing queued, nothing running.

Figures, per configuration (bench.cost's measured per chat, then summed or pooled over chats):
summarizer calls per 100 turns (summarize requests at the fake server, retries included), and
how many were the fold guard's repair calls; fold
attempts from the ledger and how many were superseded or failed; turns that folded synchronously
(distinct request ids of the web log's "sync_fold" lines) beside the ledger's synchronous rows;
amplification (summarizer input tokens / conversation tokens, split into folded messages and the
rest); the model's prompt tokens and verbatim history; drops without fold (a message that left
the model's context before any summarize request carried it; in parentheses, counting a
turn-digest reply's response summary as carrying it); the newest user message not verbatim;
turn latency at the client; turns whose history (summary + unfolded messages) passed the chat's
effective bound; the agent state's own model calls (turn-digest's response summaries).
"""

from __future__ import annotations

import argparse
import http.client
import json
import os
import shlex
import subprocess
import sys
import threading
import time
import uuid
from collections.abc import Iterable, Sequence
from dataclasses import dataclass, field
from datetime import UTC, datetime
from functools import partial
from typing import Any
from urllib.parse import urlparse

from bench import cost
from bench.common import (
    ROOT,
    configure_django,
    ensure_database,
    machine_line,
    save_report,
    start,
)
from bench.slow_model import service_env
from bench.throughput import free_port, gunicorn_command
from bench.topology_chats import ChatReplies, capped_summary, chat_workload
from bench.topology_measures import (
    ChatRun,
    ConfigRun,
    code_revision,
    markdown,
    measure_config,
    topology_line,
)
from tests.support.fake_openai import SUMMARY_HABITS, FakeOpenAI, content_text
from tests.support.workers import Worker

# A database of its own, flushed at the start and the end: the tests use 15, bench.slow_model 7,
# bench.workers 8, bench.throughput 9.
DEFAULT_REDIS_URL = "redis://127.0.0.1:6379/11"
DEFAULT_POSTGRES_URL = "postgres://postgres@127.0.0.1:5432"
GUNICORN_LOG = "bench-topology-gunicorn.log"
# Workers as in production: connections kept (tests/support/workers.py closes them after every task
# so that test databases can be dropped), INFO so that "ready." and every fold are logged.
WORKER_ENV = {"LOG_LEVEL": "INFO", "DB_CONN_MAX_AGE": "60"}
HTTP_TIMEOUT = 300.0  # a turn waits on the model, and maybe on a synchronous fold
IDLE_POLL_SECONDS = 0.2
IDLE_QUIET_POLLS = 3  # consecutive polls with nothing in flight and no new request

# --- configurations ------------------------------------------------------------------------

SEED002 = cost.BenchConfig(
    "seed002@4500+500", "token-budget", {"max_tokens": 4500, "max_summary_tokens": 500}
)
ALL_CONFIGS = (*(cost.BenchConfig(name, name) for name in cost.PRESET_NAMES), SEED002)


def select_configs(spec: str, overrides: str | None = None) -> list[cost.BenchConfig]:
    """``all``, or comma-separated names of ALL_CONFIGS; ``overrides`` (a JSON object of knob ->
    value) is applied on top of each, and names it."""
    names = [c.name for c in ALL_CONFIGS]
    wanted = names if spec == "all" else [p.strip() for p in spec.split(",") if p.strip()]
    unknown = [name for name in wanted if name not in names]
    if unknown or not wanted:
        raise SystemExit(f"unknown configuration(s) {unknown}; known: {', '.join(names)}")
    chosen = [c for name in wanted for c in ALL_CONFIGS if c.name == name]
    if not overrides:
        return chosen
    extra = json.loads(overrides)
    if not isinstance(extra, dict):
        raise SystemExit("--overrides must be a JSON object of knob -> value")
    suffix = json.dumps(extra, separators=(",", ":"), sort_keys=True)
    return [
        cost.BenchConfig(f"{c.name}+{suffix}", c.preset, {**c.overrides, **extra}) for c in chosen
    ]


# --- the services --------------------------------------------------------------------------


@dataclass
class Services:
    fake: FakeOpenAI
    database_url: str
    port: int
    token: str
    server: subprocess.Popen[bytes] | None = None
    workers: list[Worker] = field(default_factory=list)


def fresh_database_url(postgres_url: str) -> str:
    return f"{postgres_url.rstrip('/')}/chatmem_topology_{uuid.uuid4().hex[:8]}"


def drop_database(database_url: str) -> None:
    import psycopg
    from django.db import connections

    connections.close_all()
    parsed = urlparse(database_url)
    admin = parsed._replace(scheme="postgresql", path="/postgres").geturl()
    with psycopg.connect(admin, autocommit=True) as connection:
        connection.execute(f'DROP DATABASE IF EXISTS "{parsed.path.lstrip("/")}" WITH (FORCE)')


def flush_redis(redis_url: str) -> None:
    import redis

    redis.Redis.from_url(redis_url).flushdb()


def make_token() -> str:
    from django.contrib.auth import get_user_model
    from rest_framework.authtoken.models import Token

    user = get_user_model().objects.create_user(username=f"bench-{uuid.uuid4().hex[:10]}")
    return str(Token.objects.create(user=user).key)


def start_gunicorn(env: dict[str, str], port: int, args: argparse.Namespace) -> subprocess.Popen:
    command = gunicorn_command(port, args.workers, args.threads, "gthread")
    server = start([*command, "--log-level", "warning"], env, GUNICORN_LOG)
    deadline = time.monotonic() + 60
    while time.monotonic() < deadline:
        if server.poll() is not None:  # it refused to start (a check error, a bad option...)
            raise SystemExit(f"gunicorn exited at start; see artifacts/{GUNICORN_LOG}")
        probe = Api(port, "")
        answered = probe.call("GET", "/healthz")[0] == 200
        probe.close()
        if answered:
            return server
        time.sleep(0.2)  # still starting: poll until the deadline
    server.kill()
    raise SystemExit("gunicorn did not answer /healthz within 60 s")


def service_environment(args: argparse.Namespace, model_port: int) -> dict[str, str]:
    """bench.slow_model's services (dispatch to Celery, the fake model and summarizer, no daily
    notes, a throttle never reached), at this run's Redis database and pool size."""
    shared = argparse.Namespace(redis_url=args.redis_url, pool_size=args.pool_size)
    return {**service_env(shared, model_port), "MEMORY_SUMMARIZER_MODEL": "fake-summarizer"}


def start_services(args: argparse.Namespace) -> Services:
    (ROOT / "artifacts").mkdir(exist_ok=True)
    database_url = fresh_database_url(args.postgres_url)
    ensure_database(database_url)
    model_port = free_port()
    fake = FakeOpenAI(
        port=model_port,
        latency=args.model_latency,
        summarize_latency=args.summarizer_latency,
        summary_fn=partial(capped_summary, habits=args.summarizer_habits),
    ).start()
    services = Services(fake, database_url, free_port(), "")
    try:
        configure_django(database_url, service_environment(args, model_port))
        flush_redis(args.redis_url)
        services.token = make_token()
        # The web processes log at INFO: their "sync_fold" lines name the turn (request id).
        web_env = {**os.environ, "DJANGO_SETTINGS_MODULE": "chatmem_project.settings"}
        services.server = start_gunicorn({**web_env, "LOG_LEVEL": "INFO"}, services.port, args)
        services.workers = [
            Worker(args.redis_url, f"bench-topology-{index}", env=WORKER_ENV)
            for index in range(args.celery_workers)
        ]
        for worker in services.workers:
            worker.wait_ready()
    except BaseException:
        stop_services(services, args)
        raise
    return services


def stop_services(services: Services, args: argparse.Namespace) -> None:
    for worker in services.workers:
        worker.stop()
    if services.server is not None:
        services.server.terminate()
        services.server.wait(timeout=30)
    services.fake.stop()
    flush_redis(args.redis_url)
    if not args.keep_database:
        drop_database(services.database_url)


# --- HTTP ----------------------------------------------------------------------------------


class Api:
    """JSON over one keep-alive connection to chatmem, authenticated with ``token``."""

    def __init__(self, port: int, token: str) -> None:
        self.port, self.token = port, token
        self.connection = http.client.HTTPConnection("127.0.0.1", port, timeout=HTTP_TIMEOUT)

    def call(
        self, method: str, path: str, body: Any = None, request_id: str | None = None
    ) -> tuple[int, Any]:
        """(status, decoded body); status 0 when the connection failed."""
        headers = {"Content-Type": "application/json"}
        if self.token:
            headers["Authorization"] = f"Token {self.token}"
        if request_id:
            headers["X-Request-ID"] = request_id
        payload = None if body is None else json.dumps(body)
        try:
            self.connection.request(method, path, body=payload, headers=headers)
            response = self.connection.getresponse()
            raw = response.read()
        except (OSError, http.client.HTTPException):
            self.connection.close()  # the next call reconnects
            return 0, None
        try:
            return response.status, json.loads(raw) if raw else None
        except ValueError:
            return response.status, None

    def get(self, path: str) -> Any:
        status, body = self.call("GET", path)
        if status == 0:
            # gunicorn closes a keep-alive connection idle for 2 s (as this one was while the
            # clients played): once more on a new connection. A GET changes nothing; a turn is
            # never sent twice.
            status, body = self.call("GET", path)
        if status != 200:
            raise SystemExit(f"GET {path}: HTTP {status} {body}")
        return body

    def close(self) -> None:
        self.connection.close()


# --- running one configuration -------------------------------------------------------------


def create_chat(
    api: Api, config: cost.BenchConfig, ordinal: int, workload: list[cost.Turn]
) -> ChatRun:
    body = {
        "title": f"{config.name} #{ordinal}",
        "policy": config.preset,
        "policy_overrides": config.overrides,
    }
    status, made = api.call("POST", "/api/v1/chats/", body)
    if status != 201:
        raise SystemExit(f"{config.name}: creating a chat failed: HTTP {status} {made}")
    return ChatRun(ordinal, int(made["id"]), workload, dict(made["effective_policy"]))


def play_chat(port: int, token: str, chat: ChatRun, replies: ChatReplies) -> None:
    """One client: the chat's turns in order, each sent when the previous one's answer came.
    The request id names the turn, so the web log's sync_fold lines can be counted per turn."""
    api = Api(port, token)
    path = f"/api/v1/chats/{chat.chat_id}/turns/"
    for turn in chat.workload:
        replies.sending(chat.ordinal, turn.number)
        started = time.perf_counter()
        status, body = api.call("POST", path, {"content": turn.user}, turn_request_id(chat, turn))
        chat.latencies_ms.append((time.perf_counter() - started) * 1000)
        chat.statuses.append(status)
        if not 200 <= status < 300:
            chat.failed.append(turn.number)
            if len(chat.errors) < cost.FAILURES_SHOWN:
                detail = body.get("detail", body) if isinstance(body, dict) else body
                chat.errors.append(f"turn {turn.number}: HTTP {status} {detail}")
    api.close()


def turn_request_id(chat: ChatRun, turn: cost.Turn) -> str:
    return f"topology-{chat.chat_id}-{turn.number}"


def play_all(port: int, token: str, chats: Sequence[ChatRun], replies: ChatReplies) -> None:
    threads = [
        threading.Thread(target=play_chat, args=(port, token, chat, replies)) for chat in chats
    ]
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join()


def broker_backlog(redis_url: str) -> int:
    """Tasks queued (every list in this Redis database is a queue) or delivered and not yet
    acknowledged (late ack: running or prefetched), and chat locks held (a fold running)."""
    import redis

    client = redis.Redis.from_url(redis_url)
    queued = sum(int(client.llen(key)) for key in client.scan_iter() if client.type(key) == b"list")
    locks = sum(1 for _ in client.scan_iter(match="chatmem:lock:*"))
    return queued + int(client.hlen("unacked")) + locks


def running_folds(chat_ids: Sequence[int]) -> int:
    from conversations.models import Consolidation

    return Consolidation.objects.filter(chat_id__in=chat_ids, status="running").count()


def wait_idle(redis_url: str, chat_ids: Sequence[int], fake: FakeOpenAI, timeout: float) -> bool:
    """Until nothing is queued, delivered, locked or running, no request is being answered and
    none arrived, over IDLE_QUIET_POLLS polls in a row. False at the timeout."""
    deadline = time.monotonic() + timeout
    quiet, seen = 0, -1
    while time.monotonic() < deadline:
        counters = fake.counters()
        busy = broker_backlog(redis_url) + running_folds(chat_ids) + counters["in_flight"]
        quiet = quiet + 1 if busy == 0 and counters["total"] == seen else 0
        if quiet >= IDLE_QUIET_POLLS:
            return True
        seen = counters["total"]
        time.sleep(IDLE_POLL_SECONDS)  # polling the services' state, not synchronising a thread
    return False


def ledger_rows(chat_id: int) -> list[dict[str, Any]]:
    from conversations.models import Consolidation

    fields = (
        "status",
        "trigger",
        "from_seq",
        "to_seq",
        "synchronous",
        "summary_tokens_after",
        "summarizer_calls",
    )
    return list(Consolidation.objects.filter(chat_id=chat_id).order_by("id").values(*fields))


def read_final_state(api: Api, chat: ChatRun) -> None:
    brief = api.get(f"/api/v1/chats/{chat.chat_id}/brief/")
    context = api.get(f"/api/v1/chats/{chat.chat_id}/context/")["messages"]
    chat.summary, chat.still_due = brief["summary"], bool(brief.get("pending"))
    chat.context = [content_text(message.get("content")) for message in context]
    chat.ledger = ledger_rows(chat.chat_id)


def web_log_lines(chat_ids: Iterable[int]) -> list[dict[str, Any]]:
    """The web processes' log lines about these chats: a turn's synchronous fold ("sync_fold",
    with the turn's request id), its wait for a fold in flight, the fold's own lines..."""
    wanted = set(chat_ids)
    lines = []
    for raw in (ROOT / "artifacts" / GUNICORN_LOG).read_text().splitlines():
        try:
            line = json.loads(raw)
        except ValueError:
            continue  # gunicorn's own lines are not JSON
        if isinstance(line, dict) and line.get("chat_id") in wanted:
            lines.append(line)
    return lines


def run_config(
    index: int,
    config: cost.BenchConfig,
    bases: Sequence[Sequence[cost.Turn]],
    services: Services,
    args: argparse.Namespace,
) -> ConfigRun:
    # Ordinals go on from one configuration to the next: each chat of a run has its own tags.
    first = index * len(bases) + 1
    workloads = {first + c: chat_workload(base, first + c) for c, base in enumerate(bases)}
    replies = ChatReplies(workloads)
    services.fake.reset()
    services.fake.reply_fn = replies
    api = Api(services.port, services.token)
    chats = [create_chat(api, config, ordinal, turns) for ordinal, turns in workloads.items()]
    started = time.monotonic()
    play_all(services.port, services.token, chats, replies)
    turns_seconds = time.monotonic() - started
    chat_ids = [chat.chat_id for chat in chats]
    idle = wait_idle(args.redis_url, chat_ids, services.fake, args.idle_timeout)
    wall_seconds = time.monotonic() - started
    for chat in chats:
        read_final_state(api, chat)
    api.close()
    return ConfigRun(
        config=config,
        chats=chats,
        records=services.fake.requests,
        served={ordinal: list(numbers) for ordinal, numbers in replies.served.items()},
        strays=replies.strays,
        server_counters=services.fake.counters(),
        web_log=web_log_lines(chat_ids),
        turns_seconds=turns_seconds,
        wall_seconds=wall_seconds,
        idle=idle,
    )


# --- main -----------------------------------------------------------------------------------


def parse_args(argv: Sequence[str] | None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(
        prog="python -m bench.topology", description=(__doc__ or "").split("\n")[0]
    )
    names = ", ".join(c.name for c in ALL_CONFIGS)
    parser.add_argument("--configs", default="all", help=f"all, or comma-separated: {names}")
    parser.add_argument("--overrides", help="a JSON object of knobs applied to every config")
    parser.add_argument("--chats", type=int, default=1, help="chats at once, one client each")
    parser.add_argument("--turns", type=int, default=cost.DEFAULT_TURNS, help="per chat")
    parser.add_argument("--seed", type=int, default=cost.DEFAULT_SEED, help="chat c: seed + c")
    parser.add_argument("--celery-workers", type=int, default=2)
    parser.add_argument("--model-latency", type=float, default=0.0, help="seconds per reply")
    parser.add_argument("--summarizer-latency", type=float, default=0.0)
    parser.add_argument(
        "--summarizer-habits",
        type=lambda text: [name for name in text.split(",") if name],
        default=[],
        help=f"comma-separated, of {','.join(SUMMARY_HABITS)}: a summarizer at its worst",
    )
    parser.add_argument("--workers", type=int, default=2, help="gunicorn processes")
    parser.add_argument("--threads", type=int, default=8, help="gunicorn threads per process")
    parser.add_argument("--pool-size", type=int, default=10, help="DB connections per process")
    parser.add_argument("--redis-url", default=DEFAULT_REDIS_URL, help="flushed: a bench's own")
    parser.add_argument("--postgres-url", default=DEFAULT_POSTGRES_URL, help="the server")
    parser.add_argument("--keep-database", action="store_true")
    parser.add_argument("--idle-timeout", type=float, default=300.0, help="per configuration")
    parser.add_argument("--out", default="bench/results/topology.json")
    args = parser.parse_args(argv)
    if args.turns < 2 or args.chats < 1 or args.celery_workers < 1:
        parser.error("--turns must be at least 2, --chats and --celery-workers at least 1")
    return args


def workload_report(bases: Sequence[Sequence[cost.Turn]], seed: int) -> dict[str, Any]:
    per_chat = [cost.workload_summary(base) for base in bases]
    return {
        "seeds": [seed + c for c in range(len(bases))],
        "turns_per_chat": per_chat[0]["turns"],
        "conversation_tokens_per_chat": [w["conversation_tokens"] for w in per_chat],
        "chat_1": per_chat[0],
    }


def run_all(args: argparse.Namespace, configs: Sequence[cost.BenchConfig]) -> dict[str, Any]:
    bases = [cost.build_workload(args.turns, args.seed + c) for c in range(args.chats)]
    services = start_services(args)
    results = []
    try:
        for index, config in enumerate(configs):
            run = run_config(index, config, bases, services, args)
            results.append(measure_config(run))
            print(f"  {config.name}: {run.wall_seconds:.1f} s", file=sys.stderr, flush=True)
            for error in results[-1]["failures_shown"]:
                print(f"    {error}", file=sys.stderr)
    finally:
        stop_services(services, args)
    database = urlparse(services.database_url).path.lstrip("/")
    kept = " (kept)" if args.keep_database else " (dropped)"
    return {
        "workload": workload_report(bases, args.seed),
        "database": database + kept,
        "results": results,
    }


def main(argv: Sequence[str] | None = None) -> int:
    args = parse_args(argv)
    configs = select_configs(args.configs, args.overrides)
    given = list(sys.argv[1:] if argv is None else argv)
    started, code = time.monotonic(), code_revision()
    outcome = run_all(args, configs)
    code_at_end = code_revision()
    report = {
        "command": shlex.join(["python", "-m", "bench.topology", *given]),
        "date": datetime.now(UTC).strftime("%Y-%m-%d %H:%M UTC"),
        "code": code,
        "code_changed_during_run": code_at_end != code,
        "machine": machine_line(),
        "topology": topology_line(args),
        "database": outcome["database"],
        "redis": args.redis_url,
        "workload": outcome["workload"],
        "wall_seconds": round(time.monotonic() - started, 1),
        "results": outcome["results"],
    }
    print(markdown(report))
    print(f"\nwrote {save_report(report, args.out)}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
