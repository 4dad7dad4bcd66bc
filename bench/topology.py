"""Memory cost on the deployed topology (issue 23).

``bench/cost.py`` plays the Celery worker serially, in process, after every turn. This benchmark
measures the same figures on what users deploy, every part a process of its own on this machine:

- a fresh PostgreSQL database (created, migrated, dropped at the end unless --keep-database);
- Redis (``--redis-url``; only that database is flushed, at the start and at the end);
- chatmem under gunicorn (MEMORY_DISPATCH=celery, the Chat Completions model and summarizer);
- ``--celery-workers`` real ``celery worker`` processes on the memory queue;
- the fake OpenAI-compatible server (``tests.fake_openai``) in this process, recording every
  request: chat replies after ``--model-latency`` seconds, summaries after
  ``--summarizer-latency``.

    python -m bench.topology [--configs all|name,...] [--overrides JSON] [--chats 1]
                             [--turns 600] [--seed 7] [--celery-workers 2]
                             [--model-latency 0] [--summarizer-latency 0]
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
summarizer calls per 100 turns (summarize requests at the fake server, retries included); fold
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
import hashlib
import http.client
import json
import os
import re
import shlex
import subprocess
import sys
import threading
import time
import uuid
from collections import Counter
from collections.abc import Iterable, Mapping, Sequence
from dataclasses import asdict, dataclass, field
from datetime import UTC, datetime
from pathlib import Path
from typing import Any
from urllib.parse import urlparse

from bench import cost
from bench.common import ROOT, configure_django, ensure_database, machine_line, start
from bench.slow_model import service_env
from bench.throughput import free_port, gunicorn_command, percentile
from tests.fake_openai import (
    FakeOpenAI,
    RecordedRequest,
    content_text,
    last_user_text,
    summary_text,
)
from tests.workers import Worker

# A database of its own, flushed at the start and the end: the tests use 15, bench.slow_model 7,
# bench.workers 8, bench.throughput 9.
DEFAULT_REDIS_URL = "redis://127.0.0.1:6379/11"
DEFAULT_POSTGRES_URL = "postgres://postgres@127.0.0.1:5432"
GUNICORN_LOG = "bench-topology-gunicorn.log"
# Workers as in production: connections kept (tests/workers.py closes them after every task so
# that test databases can be dropped), INFO so that "ready." and every fold are logged.
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


# --- one workload per chat -----------------------------------------------------------------

# Chat g's turn n is numbered CHAT_BASE + g * TURNS_PER_CHAT + n. Its tags keep bench.cost's
# "[t<number>u]" form, so bench.cost's measuring functions work on them unchanged; they are
# unique across the chats of a run (across configurations too, so a request that strays from
# one configuration into the next is not taken for its own); and they have one width, so a tag
# costs the same tokens in every chat (cl100k splits digits in groups of three).
TURNS_PER_CHAT = 10_000
CHAT_BASE = 10_000_000
MAX_CHAT_ORDINAL = 999  # keeps every turn number at 8 digits
USER_TAG = re.compile(r"\[t(\d+)u\]")
REPLY_TAG = re.compile(r"\[t(\d+)a\]")


def chat_ordinal(number: int) -> int:
    return (number - CHAT_BASE) // TURNS_PER_CHAT


def renumbered(turn: cost.Turn, number: int) -> cost.Turn:
    user = cost.user_tag(number) + turn.user.removeprefix(cost.user_tag(turn.number))
    reply = cost.reply_tag(number) + turn.reply.removeprefix(cost.reply_tag(turn.number))
    return cost.Turn(number, user, reply, turn.fact)


def chat_workload(base: Sequence[cost.Turn], ordinal: int) -> list[cost.Turn]:
    """bench.cost's conversation ``base`` as chat ``ordinal``'s: the same text, its own tags."""
    if not 1 <= ordinal <= MAX_CHAT_ORDINAL or len(base) >= TURNS_PER_CHAT:
        raise SystemExit(f"at most {MAX_CHAT_ORDINAL} chats of {TURNS_PER_CHAT - 1} turns")
    offset = CHAT_BASE + ordinal * TURNS_PER_CHAT
    return [renumbered(turn, offset + turn.number) for turn in base]


# --- the fake model's answers --------------------------------------------------------------

# bench.cost's fake summary (325 words on its own tags) is about 470 tokens, under the 500-token
# cap of the summarizer (MEMORY_SUMMARY_TOKEN_CAP). This benchmark's tags are longer (8 digits),
# and the summary's bullets open with them: at the same word cap it passed 500 tokens and the
# summarizer refused it ("over_cap"). So the fake's summary is held to bench.cost's token size.
SUMMARY_TOKENS = 470
SUMMARY_WORDS_STEP = 25


def capped_summary(body: dict[str, Any]) -> str:
    """tests.fake_openai's summary at bench.cost's word cap, with fewer words (the oldest
    bullets go first) until it is at most SUMMARY_TOKENS tokens."""
    words = cost.SUMMARY_CAP_WORDS
    text = summary_text(body, words)
    while cost.tokens(text) > SUMMARY_TOKENS and words > SUMMARY_WORDS_STEP:
        words -= SUMMARY_WORDS_STEP
        text = summary_text(body, words)
    return text


# How the fake names the reply an agent-state digest is of; it is not a message tag, so bench.cost
# does not count a digest as carrying its reply.
DIGEST_PREFIX = "(digest of "
DIGEST_LINE = re.compile(r"^Assistant: \(digest of (\[t\d+a\])\)", re.MULTILINE)
DIGEST_WORDS = 12


def turn_request_number(body: Mapping[str, Any]) -> int | None:
    """The turn a chat request is the model call of: its last user message opens with a user
    tag. None for any other chat request (the agent state's, which quote a reply)."""
    found = USER_TAG.match(last_user_text(dict(body)))
    return int(found.group(1)) if found else None


def digest_reply(body: Mapping[str, Any]) -> str:
    """A one-sentence response summary (turn-digest, docs/agent-state.md) naming its reply."""
    text = last_user_text(dict(body))
    found = REPLY_TAG.search(text)
    if found is None:
        return "Noted."
    words = text[found.end() :].split()[:DIGEST_WORDS]
    return f"{DIGEST_PREFIX}{found.group(0)}) {' '.join(words).rstrip('.')}."


class ChatReplies:
    """The fake model's chat answers for every chat of a configuration at once (the server
    calls it from its threads). A turn's request gets the reply of the turn its chat's client
    is sending (``sending``), as bench.cost's ReplyScript does for its one chat, and is noted
    in that chat's ``served``; any other chat request gets a digest."""

    def __init__(self, workloads: Mapping[int, Sequence[cost.Turn]]) -> None:
        self.replies = {turn.number: turn.reply for turns in workloads.values() for turn in turns}
        self.served: dict[int, list[int]] = {ordinal: [] for ordinal in workloads}
        self.strays = 0  # turn requests of a chat with no turn being sent
        self._sending: dict[int, int] = {}
        self._lock = threading.Lock()

    def sending(self, ordinal: int, number: int) -> None:
        with self._lock:
            self._sending[ordinal] = number

    def __call__(self, body: dict[str, Any]) -> str:
        number = turn_request_number(body)
        if number is None:
            return digest_reply(body)
        ordinal = chat_ordinal(number)
        with self._lock:
            current = self._sending.get(ordinal)
            if current is None:
                self.strays += 1
                return "(no turn of this chat is being sent)"
            self.served[ordinal].append(current)
        return self.replies[current]


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
        summary_fn=capped_summary,
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


@dataclass
class ChatRun:
    ordinal: int
    chat_id: int
    workload: list[cost.Turn]
    policy: dict[str, Any]  # the chat's effective_policy
    statuses: list[int] = field(default_factory=list)  # per turn sent
    latencies_ms: list[float] = field(default_factory=list)
    failed: list[int] = field(default_factory=list)  # turn numbers answered other than 2xx
    errors: list[str] = field(default_factory=list)  # the first failures' answers
    summary: str = ""
    context: list[str] = field(default_factory=list)
    still_due: bool = False  # the brief's "pending" at the end
    ledger: list[dict[str, Any]] = field(default_factory=list)


@dataclass
class ConfigRun:
    config: cost.BenchConfig
    chats: list[ChatRun]
    records: list[RecordedRequest]
    served: dict[int, list[int]]
    strays: int
    server_counters: dict[str, Any]
    web_log: list[dict[str, Any]]  # the web processes' log lines about these chats
    turns_seconds: float
    wall_seconds: float
    idle: bool


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


# --- measuring ------------------------------------------------------------------------------


def carried_with_digests(record: RecordedRequest) -> list[str]:
    """The tags a summarize request carries, a reply's digest counting as its reply."""
    return cost.folded_tags(record) + DIGEST_LINE.findall(cost.new_turns_section(record))


def summarize_ordinal(record: RecordedRequest) -> int | None:
    """The chat a summarize request folds, from the tags of its NEW_TURNS (None: no tag, or
    tags of several chats)."""
    ordinals = {chat_ordinal(int(tag[2:-2])) for tag in carried_with_digests(record)}
    return ordinals.pop() if len(ordinals) == 1 else None


def agent_ordinal(record: RecordedRequest) -> int | None:
    found = REPLY_TAG.search(last_user_text(record.body))
    return chat_ordinal(int(found.group(1))) if found else None


@dataclass
class Split:
    """A configuration's requests by chat: each chat's turn and summarize requests (in arrival
    order), each chat's other model calls (the agent state's), and what names no chat of it."""

    by_chat: dict[int, list[RecordedRequest]]
    agent_calls: dict[int, list[RecordedRequest]]
    unattributed: list[RecordedRequest]


def split_records(records: Iterable[RecordedRequest], ordinals: Iterable[int]) -> Split:
    wanted = list(ordinals)
    split = Split({o: [] for o in wanted}, {o: [] for o in wanted}, [])
    for record in records:
        if record.kind == "summarize":
            ordinal, agent = summarize_ordinal(record), False
        else:
            number = turn_request_number(record.body)
            agent = number is None
            ordinal = agent_ordinal(record) if agent else chat_ordinal(number or 0)
        if ordinal not in split.by_chat:
            split.unattributed.append(record)
        elif agent:
            split.agent_calls[ordinal].append(record)
        else:
            split.by_chat[ordinal].append(record)
    return split


def reply_fold_forms(records: Iterable[RecordedRequest]) -> Counter[str]:
    """How each reply first reached the summarizer: "itself" (its text) or "digest" (the
    agent state's response summary of it, turn-digest's fold input)."""
    first: dict[str, str] = {}
    for record in records:
        if record.kind != "summarize":
            continue
        for tag in cost.folded_tags(record):
            if REPLY_TAG.fullmatch(tag):
                first.setdefault(tag, "itself")
        for tag in DIGEST_LINE.findall(cost.new_turns_section(record)):
            first.setdefault(tag, "digest")
    return Counter(first.values())


def repeated_agent_calls(records: Iterable[RecordedRequest]) -> int:
    """Agent-state model calls about a reply an earlier call was already about: for example
    two runs of the agent state that raced, the loser's work discarded at its commit."""
    tags = [found.group(0) for r in records if (found := REPLY_TAG.search(last_user_text(r.body)))]
    return len(tags) - len(set(tags))


def history_of(record: RecordedRequest) -> tuple[int, int]:
    """(messages, tokens) of a turn request's history as the engine bounds it: the summary's
    text (without the context's header) and every verbatim message before the new one; not
    the system prompt or the agent state's block."""
    from conversations.services.context import SUMMARY_HEADER

    messages = cost.body_messages(record)[:-1]
    texts = [(m.get("role"), content_text(m.get("content"))) for m in messages]
    summary = sum(
        cost.tokens(text.removeprefix(SUMMARY_HEADER))
        for role, text in texts
        if role == "system" and text.startswith(SUMMARY_HEADER)
    )
    verbatim = [text for role, text in texts if role != "system"]
    return len(verbatim), summary + sum(cost.tokens(text) for text in verbatim)


def token_bound(policy: Mapping[str, Any]) -> int | None:
    """The chat's bound on history tokens: max_memory_tokens, and seed 002's max_tokens (summary
    and messages within it), the smaller when both are set."""
    bounds = [policy.get(k) for k in ("max_memory_tokens", "max_tokens")]
    present = [int(b) for b in bounds if b is not None]
    return min(present) if present else None


@dataclass
class BoundCheck:
    message_bound: int | None
    token_bound: int | None
    over_bound: int  # turn requests whose history passed a bound
    max_messages: int
    max_tokens: int


def check_bound(policy: Mapping[str, Any], turn_requests: Sequence[RecordedRequest]) -> BoundCheck:
    messages_bound, tokens_bound = policy.get("context_size"), token_bound(policy)
    histories = [history_of(record) for record in turn_requests]
    over = sum(
        1
        for messages, tokens in histories
        if (messages_bound is not None and messages > messages_bound)
        or (tokens_bound is not None and tokens > tokens_bound)
    )
    return BoundCheck(
        messages_bound,
        tokens_bound,
        over,
        max((m for m, _ in histories), default=0),
        max((t for _, t in histories), default=0),
    )


@dataclass
class LedgerCounts:
    attempts: int
    succeeded: int
    superseded: int
    failed: int
    running: int
    synchronous: int  # rows of folds a turn ran before its model call
    summarizer_calls: int  # as the ledger counts them
    # "background succeeded", "synchronous superseded"...: which side of a race lost.
    by_kind: dict[str, int] = field(default_factory=dict)

    @property
    def superseded_pct(self) -> float:
        return 100 * self.superseded / self.attempts if self.attempts else 0.0

    @property
    def failed_pct(self) -> float:
        return 100 * self.failed / self.attempts if self.attempts else 0.0


def ledger_counts(rows: Iterable[Mapping[str, Any]]) -> LedgerCounts:
    rows = list(rows)
    status = Counter(str(row["status"]) for row in rows)
    return LedgerCounts(
        attempts=len(rows),
        succeeded=status["succeeded"],
        superseded=status["superseded"],
        failed=status["failed"],
        running=status["running"],
        synchronous=sum(1 for row in rows if row["synchronous"]),
        summarizer_calls=sum(int(row.get("summarizer_calls") or 0) for row in rows),
        by_kind=dict(Counter(fold_kind(row) for row in rows)),
    )


def fold_kind(row: Mapping[str, Any]) -> str:
    return f"{'synchronous' if row['synchronous'] else 'background'} {row['status']}"


def sync_fold_turns(lines: Iterable[Mapping[str, Any]]) -> int:
    """Distinct turns (request ids) with a "sync_fold" line; a line without an id counts alone."""
    folds = [line for line in lines if line.get("event") == "sync_fold"]
    return len({line.get("request_id") or f"line-{n}" for n, line in enumerate(folds)})


def web_events(lines: Iterable[Mapping[str, Any]]) -> dict[str, int]:
    return dict(Counter(str(line.get("event") or line.get("msg")) for line in lines))


def chat_cost_run(
    config: cost.BenchConfig,
    chat: ChatRun,
    records: list[RecordedRequest],
    served: list[int],
    seconds: float,
) -> cost.Run:
    return cost.Run(
        config=config,
        chat_id=chat.chat_id,
        records=records,
        served=served,
        failed_turns=list(chat.failed),
        final_summary=chat.summary,
        final_context=list(chat.context),
        ledger=chat.ledger,
        seconds=seconds,
    )


@dataclass
class ChatFigures:
    """One chat's figures: bench.cost's, and what only this topology has."""

    chat_id: int
    metrics: cost.Metrics  # bench.cost's, on this chat's requests
    drops_counting_digests: int
    replies_folded: Counter[str]  # "itself" / "digest" -> replies
    agent_calls: int
    agent_calls_repeated: int
    bound: BoundCheck
    ledger: LedgerCounts
    prompt_tokens: list[int]
    verbatim_tokens: list[int]


def measure_chat(
    run: ConfigRun, chat: ChatRun, records: list[RecordedRequest], agent: list[RecordedRequest]
) -> ChatFigures:
    served = run.served.get(chat.ordinal, [])
    turn_requests = [r for r in records if r.kind == "chat"]
    if len(turn_requests) != len(served):
        raise SystemExit(
            f"chat {chat.chat_id}: {len(turn_requests)} turn requests but {len(served)} served"
        )
    cost_run = chat_cost_run(run.config, chat, records, served, run.wall_seconds)
    return ChatFigures(
        chat_id=chat.chat_id,
        metrics=cost.measure(cost_run, chat.workload),
        drops_counting_digests=cost.drops_without_fold(
            cost_run, cost.stored_messages(cost_run), carried_with_digests
        ),
        replies_folded=reply_fold_forms(records),
        agent_calls=len(agent),
        agent_calls_repeated=repeated_agent_calls(agent),
        bound=check_bound(chat.policy, turn_requests),
        ledger=ledger_counts(chat.ledger),
        prompt_tokens=[cost.prompt_tokens(r) for r in turn_requests],
        verbatim_tokens=[cost.verbatim_history_tokens(r) for r in turn_requests],
    )


def ratio(part: float, whole: float) -> float:
    return part / whole if whole else 0.0


def measure_config(run: ConfigRun) -> dict[str, Any]:
    split = split_records(run.records, (chat.ordinal for chat in run.chats))
    figures = [
        measure_chat(run, chat, split.by_chat[chat.ordinal], split.agent_calls[chat.ordinal])
        for chat in run.chats
    ]
    return {
        "config": run.config.name,
        "preset": run.config.preset,
        "overrides": run.config.overrides,
        "chats": len(run.chats),
        **turn_figures(run.chats),
        **fold_figures(run),
        **token_figures(figures),
        **memory_figures(figures, split, run.strays),
        "turns_seconds": round(run.turns_seconds, 1),
        "wall_seconds": round(run.wall_seconds, 1),
        "idle_at_end": run.idle,
        "chats_with_fold_still_due": sum(1 for chat in run.chats if chat.still_due),
        "per_chat": [chat_report(f) for f in figures],
    }


def turn_figures(chats: Sequence[ChatRun]) -> dict[str, Any]:
    statuses = [status for chat in chats for status in chat.statuses]
    failed = [status for status in statuses if not 200 <= status < 300]
    latencies = [ms for chat in chats for ms in chat.latencies_ms]
    return {
        "turns_sent": len(statuses),
        "turns_stored": len(statuses) - len(failed),
        "turns_failed": len(failed),
        "failed_statuses": dict(Counter(str(status) for status in failed)),
        "failures_shown": [error for chat in chats for error in chat.errors],
        "latency_p50_ms": round(percentile(latencies, 0.50), 1),
        "latency_p99_ms": round(percentile(latencies, 0.99), 1),
    }


def fold_figures(run: ConfigRun) -> dict[str, Any]:
    """Summarizer calls as the server saw them (retries included), and the ledger's attempts."""
    sent = sum(len(chat.statuses) for chat in run.chats)
    calls = sum(1 for record in run.records if record.kind == "summarize")
    ledger = ledger_counts(row for chat in run.chats for row in chat.ledger)
    sync_turns = sync_fold_turns(run.web_log)
    return {
        "summarizer_calls": calls,
        "summarizer_calls_at_server": run.server_counters["summarize"],
        "summarizer_calls_in_ledger": ledger.summarizer_calls,
        "calls_per_100_turns": round(ratio(calls * 100, sent), 2),
        "folds": {
            **asdict(ledger),
            "superseded_pct": round(ledger.superseded_pct, 2),
            "failed_pct": round(ledger.failed_pct, 2),
        },
        "sync_fold_turns": sync_turns,
        "sync_fold_turns_pct": round(ratio(sync_turns * 100, sent), 2),
        "web_log_events": web_events(run.web_log),
    }


def token_figures(figures: Sequence[ChatFigures]) -> dict[str, Any]:
    """bench.cost's token figures over every chat: amplification from the chats' totals, the
    prompt figures over every turn request of every chat."""
    conversation = sum(f.metrics.conversation_tokens for f in figures)
    sent = sum(f.metrics.summarizer_input_tokens for f in figures)
    content = sum(f.metrics.folded_content_share * f.metrics.conversation_tokens for f in figures)
    prompts = [tokens for f in figures for tokens in f.prompt_tokens]
    return {
        "amplification": round(ratio(sent, conversation), 3),
        "folded_content_share": round(ratio(content, conversation), 3),
        "overhead_share": round(ratio(sent - content, conversation), 3),
        "prompt_tokens_mean": round(cost.mean(prompts), 1),
        "prompt_tokens_p95": cost.percentile(prompts, 0.95),
        "prompt_tokens_max": max(prompts, default=0),
        "verbatim_tokens_mean": round(
            cost.mean([tokens for f in figures for tokens in f.verbatim_tokens]), 1
        ),
    }


def memory_figures(figures: Sequence[ChatFigures], split: Split, strays: int) -> dict[str, Any]:
    """What the model saw and what reached the summarizer: drops, the newest message, the bound,
    and the requests no chat of the configuration accounts for."""
    return {
        "drop_without_fold": sum(f.metrics.drop_without_fold for f in figures),
        "drop_without_fold_counting_digests": sum(f.drops_counting_digests for f in figures),
        "newest_not_verbatim": sum(f.metrics.newest_not_verbatim for f in figures),
        "over_bound_turns": sum(f.bound.over_bound for f in figures),
        "replies_folded_as_themselves": sum(f.replies_folded["itself"] for f in figures),
        "replies_folded_as_digest": sum(f.replies_folded["digest"] for f in figures),
        "agent_model_calls": sum(f.agent_calls for f in figures),
        "agent_model_calls_repeated": sum(f.agent_calls_repeated for f in figures),
        "unattributed_requests": len(split.unattributed),
        "stray_turn_requests": strays,
    }


def chat_report(figures: ChatFigures) -> dict[str, Any]:
    return {
        "chat_id": figures.chat_id,
        "drops_counting_digests": figures.drops_counting_digests,
        "replies_folded": dict(figures.replies_folded),
        "agent_model_calls": figures.agent_calls,
        "agent_model_calls_repeated": figures.agent_calls_repeated,
        "bound": asdict(figures.bound),
        "ledger": asdict(figures.ledger),
        **{k: v for k, v in asdict(figures.metrics).items() if k not in ("config", "preset")},
    }


# --- reporting ------------------------------------------------------------------------------

RESULT_HEADER = (
    "config",
    "turns sent / stored / failed",
    "calls/100 turns",
    "fold attempts: ok / superseded / failed",
    "superseded % / failed %",
    "sync-fold turns (% of turns) / ledger rows",
    "amplification (content + overhead)",
    "prompt tokens mean / p95 / max",
    "mean verbatim history",
    "drop w/o fold (counting digests)",
    "newest not verbatim",
    "latency p50 / p99 ms",
    "over bound; max history msgs / tokens vs bound",
    "agent-state calls (repeated)",
    "wall s",
)


def bound_cell(result: Mapping[str, Any]) -> str:
    chats = result["per_chat"]
    bound = chats[0]["bound"] if chats else {}
    messages = max((c["bound"]["max_messages"] for c in chats), default=0)
    tokens = max((c["bound"]["max_tokens"] for c in chats), default=0)
    limit_m = bound.get("message_bound") or "—"
    limit_t = f"{bound['token_bound']:,}" if bound.get("token_bound") else "—"
    return f"{result['over_bound_turns']}; {messages} / {tokens:,} vs {limit_m} / {limit_t}"


def result_row(r: Mapping[str, Any]) -> list[str]:
    folds = r["folds"]
    return [
        f"`{r['config']}`",
        f"{r['turns_sent']:,} / {r['turns_stored']:,} / {r['turns_failed']}",
        f"{r['calls_per_100_turns']:.1f}",
        f"{folds['attempts']:,}: {folds['succeeded']:,} / {folds['superseded']} / "
        f"{folds['failed']}",
        f"{folds['superseded_pct']:.1f} / {folds['failed_pct']:.1f}",
        f"{r['sync_fold_turns']} ({r['sync_fold_turns_pct']:.1f} %) / {folds['synchronous']}",
        f"{r['amplification']:.2f} ({r['folded_content_share']:.2f} + {r['overhead_share']:.2f})",
        f"{r['prompt_tokens_mean']:,.0f} / {r['prompt_tokens_p95']:,} / {r['prompt_tokens_max']:,}",
        f"{r['verbatim_tokens_mean']:,.0f}",
        f"{r['drop_without_fold']} ({r['drop_without_fold_counting_digests']})",
        str(r["newest_not_verbatim"]),
        f"{r['latency_p50_ms']:,.1f} / {r['latency_p99_ms']:,.1f}",
        bound_cell(r),
        f"{r['agent_model_calls']} ({r['agent_model_calls_repeated']})",
        f"{r['wall_seconds']:.1f}",
    ]


def git(*args: str) -> str:
    return subprocess.run(["git", *args], cwd=ROOT, capture_output=True, text=True).stdout


def code_revision() -> dict[str, Any]:
    """The commit, the files changed from it (untracked ones too: a new module is code), and a
    fingerprint of the Python among them. The services import the code as they start; a
    working tree edited during a run shows as another fingerprint at its end."""
    # Porcelain lines are "XY path" (X may be a space): the path starts at the fourth character.
    changed = [line[3:] for line in git("status", "--porcelain").splitlines() if line.strip()]
    digest = hashlib.sha256(git("diff", "HEAD", "--binary", "--", "*.py").encode())
    for name in git("ls-files", "--others", "--exclude-standard", "--", "*.py").splitlines():
        digest.update(name.encode() + (ROOT / name).read_bytes())
    return {
        "commit": git("rev-parse", "--short", "HEAD").strip(),
        "changed_files": changed,
        "python_changes_fingerprint": digest.hexdigest()[:12],
    }


def topology_line(args: argparse.Namespace) -> str:
    return (
        f"gunicorn --workers {args.workers} --threads {args.threads}; "
        f"{args.celery_workers} celery worker(s); {args.chats} chat(s) at once; "
        f"model latency {args.model_latency} s, summarizer latency {args.summarizer_latency} s"
    )


def commit_line(report: Mapping[str, Any]) -> str:
    code = report["code"]
    line = code["commit"]
    if code["changed_files"]:
        line += f" with changes to {', '.join(code['changed_files'])}"
        line += f" (Python changes' fingerprint {code['python_changes_fingerprint']})"
    if report["code_changed_during_run"]:
        line += "; THE WORKING TREE CHANGED DURING THE RUN"
    return line


def header_lines(report: Mapping[str, Any]) -> list[str]:
    return [
        f"command:  {report['command']}",
        f"date:     {report['date']}",
        f"commit:   {commit_line(report)}",
        f"machine:  {report['machine']}",
        f"topology: {report['topology']}",
        f"database: PostgreSQL {report['database']}, Redis {report['redis']}",
        f"workload: {json.dumps(report['workload'])}",
        f"wall time: {report['wall_seconds']} s",
    ]


def markdown(report: Mapping[str, Any]) -> str:
    rows = (result_row(result) for result in report["results"])
    return "\n".join([*header_lines(report), "", cost.markdown_table(RESULT_HEADER, rows)])


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
    out = Path(args.out)
    out.parent.mkdir(parents=True, exist_ok=True)
    out.write_text(json.dumps(report, indent=2, ensure_ascii=False) + "\n")
    print(f"\nwrote {out}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
