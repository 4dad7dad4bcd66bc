"""Memory cost benchmark.

Runs one seeded synthetic conversation per configuration through the real turn API (DRF, in
process), the real policy engine and the real consolidation service, against the fake
OpenAI-compatible server (``tests.support.fake_openai``), which records every chat and summarize
request. All token figures are counted here, with ``conversations.chat_model.tokens.count_tokens``,
over what the model server actually received.

    python -m bench.cost [--turns 600] [--presets all|name,...] [--seed 7]
                         [--out bench/results/cost.json] [--database-url postgres://...]

After every turn the script plays the Celery worker: it calls ``fold_once`` for the turn
until it answers "nothing" or "deferred" (at most 5 times), which is what a worker does off the
request path. See ``docs/benchmarks.md`` for what each figure means.
"""

from __future__ import annotations

import argparse
import json
import math
import random
import re
import shlex
import sys
import tempfile
import time
from collections import Counter
from collections.abc import Callable, Iterable, Sequence
from dataclasses import asdict, dataclass, field
from datetime import UTC, datetime
from functools import cache
from typing import Any

from bench.common import api_client, configure_django, create_chat, machine_info, save_report
from conversations.chat_model.tokens import count_tokens
from memory_worker.coordination.dispatch import RequestReason
from tests.support.fake_openai import (
    FakeOpenAI,
    RecordedRequest,
    content_text,
    is_fold_input,
    read_fold_input,
    transcript,
)

# --- workload ------------------------------------------------------------------------------

DEFAULT_TURNS = 600
DEFAULT_SEED = 7
FACT_COUNT = 40
USER_WORDS = (15, 120)
REPLY_WORDS = (60, 500)
DEEP_DIVE_WORDS = (800, 1500)
DEEP_DIVE_EVERY = 7  # every 7th reply is a deep dive
# The fake summary keeps whole bullets under this many words: at most about 470 tokens on this
# workload, under the summarizer's 500-token cap (MEMORY_SUMMARY_TOKEN_CAP); 350 words went over.
SUMMARY_CAP_WORDS = 325
WORKER_PASSES = 5
FAILURES_SHOWN = 3  # per configuration, on stderr; every failure is counted in the results
MESSAGE_OVERHEAD_TOKENS = 4  # role and separators per chat message

VOCABULARY = tuple(
    [
        "system",
        "data",
        "service",
        "request",
        "cache",
        "queue",
        "worker",
        "deploy",
        "build",
        "test",
        "release",
        "branch",
        "commit",
        "review",
        "merge",
        "config",
        "schema",
        "index",
        "query",
        "table",
        "column",
        "server",
        "client",
        "token",
        "memory",
        "budget",
        "window",
        "summary",
        "policy",
        "limit",
        "retry",
        "backoff",
        "latency",
        "timeout",
        "metric",
        "alert",
        "dashboard",
        "log",
        "trace",
        "span",
        "error",
        "failure",
        "success",
        "rollout",
        "canary",
        "region",
        "cluster",
        "node",
        "pod",
        "volume",
        "storage",
        "backup",
        "restore",
        "migrate",
        "version",
        "update",
        "patch",
        "issue",
        "ticket",
        "owner",
        "team",
        "plan",
        "goal",
        "risk",
        "cost",
        "estimate",
        "scope",
        "deadline",
        "sprint",
        "design",
        "document",
        "proposal",
        "draft",
        "decision",
        "option",
        "tradeoff",
        "benchmark",
        "result",
        "figure",
        "chart",
        "report",
        "note",
        "idea",
        "question",
        "answer",
        "reason",
        "detail",
        "example",
        "case",
        "check",
        "value",
        "range",
        "field",
        "record",
        "event",
        "message",
        "channel",
        "stream",
        "batch",
        "job",
        "task",
        "step",
        "stage",
        "phase",
        "input",
        "output",
        "format",
        "parser",
        "model",
        "prompt",
        "context",
        "history",
        "fold",
        "chunk",
        "digest",
        "reply",
        "user",
        "account",
        "access",
        "role",
        "permission",
        "secret",
        "key",
        "rotate",
        "password",
        "staging",
        "production",
        "database",
        "network",
        "proxy",
        "route",
        "path",
        "file",
        "folder",
        "script",
        "module",
        "package",
        "library",
        "function",
        "method",
        "class",
        "object",
        "array",
        "string",
        "number",
    ]
)
FACT_SUBJECTS = (
    "staging database password",
    "production backup job",
    "billing export",
    "search index",
    "audit log archive",
    "support rota",
    "canary cluster",
    "release freeze",
    "vendor contract",
    "metrics retention",
)
FACT_PREDICATES = (
    "rotates every {n} days",
    "runs on port {p}",
    "is owned by team {t}",
    "must stay under {n} gigabytes",
)
FACT_TEAMS = ("atlas", "borealis", "cobalt", "delta", "ember", "fjord", "granite", "harbor")

# --- configurations ------------------------------------------------------------------------

PRESET_NAMES = ("contract", "sliding-window", "token-budget", "chunked", "turn-digest")
# The bound the peers were measured at: 4,000 verbatim tokens plus a 500-token summary. The
# token-budget trigger fires when summary + verbatim history passes max_tokens - max_summary_tokens
# (4,500 here), and the hard bound on summary + history (max_memory_tokens) is that same 4,500: a
# peer buffer holds up to 4,000 verbatim tokens beside a summary of up to 500.
PEER_BOUND = {"max_tokens": 5000, "max_summary_tokens": 500, "max_memory_tokens": 4500}
# Low-water targets for token folds. The target includes the summary's 500-token reserve, so any
# target up to about 500 + one turn folds everything but the newest turn (0 and 500 act alike).
PEER_FOLD_TARGETS: tuple[int | None, ...] = (None, 0, 1500, 2500)


@dataclass(frozen=True)
class BenchConfig:
    name: str
    preset: str
    overrides: dict[str, int] = field(default_factory=dict)
    peer_bound: bool = False


def peer_config(target: int | None) -> BenchConfig:
    suffix = "" if target is None else f"/target={target}"
    overrides = dict(PEER_BOUND)
    if target is not None:
        overrides["fold_target_tokens"] = target
    return BenchConfig(f"token-budget@4000+500{suffix}", "token-budget", overrides, True)


ALL_CONFIGS = (
    *(BenchConfig(name, name) for name in PRESET_NAMES),
    *(peer_config(target) for target in PEER_FOLD_TARGETS),
)


def select_configs(spec: str) -> list[BenchConfig]:
    """``all``, or comma-separated config names; a preset name selects every config of it."""
    if spec == "all":
        return list(ALL_CONFIGS)
    wanted = [part.strip() for part in spec.split(",") if part.strip()]
    chosen = [c for c in ALL_CONFIGS if c.name in wanted or c.preset in wanted]
    unknown = [w for w in wanted if not any(w in (c.name, c.preset) for c in ALL_CONFIGS)]
    if unknown or not chosen:
        known = ", ".join(c.name for c in ALL_CONFIGS)
        raise SystemExit(f"unknown configuration(s) {unknown}; known: {known}")
    return chosen


# --- goals ---------------------------------------------------------------------------------


@dataclass(frozen=True)
class Goal:
    key: str
    label: str
    metric: str  # an attribute of Metrics
    target: float
    at_most: bool  # True: measured <= target; False: measured >= target
    applies: Callable[[BenchConfig], bool]


def _is_peer(config: BenchConfig) -> bool:
    return config.peer_bound


def _is_sliding_default(config: BenchConfig) -> bool:
    return config.name == "sliding-window"


GOALS = (
    Goal("calls", "calls/100 turns ≤ 16", "calls_per_100_turns", 16, True, _is_peer),
    Goal(
        "amplification",
        "amplification ≤ 1.15",
        "amplification",
        1.15,
        True,
        lambda c: _is_peer(c) or _is_sliding_default(c),
    ),
    Goal("drops", "drop-without-fold = 0", "drop_without_fold", 0, True, _is_peer),
    Goal("newest", "newest user msg verbatim", "newest_not_verbatim", 0, True, _is_peer),
    Goal("verbatim", "mean verbatim ≥ 2,000", "verbatim_tokens_mean", 2000, False, _is_peer),
    Goal(
        "fold_size",
        "msgs per summarizer call ≥ 12",
        "messages_per_call",
        12,
        False,
        _is_sliding_default,
    ),
)


# --- workload generation -------------------------------------------------------------------


@dataclass(frozen=True)
class Turn:
    number: int
    user: str
    reply: str
    fact: str | None


def user_tag(number: int) -> str:
    return f"[t{number}u]"


def reply_tag(number: int) -> str:
    return f"[t{number}a]"


def filler(rng: random.Random, count: int) -> str:
    return " ".join(rng.choice(VOCABULARY) for _ in range(count))


def fact_sentence(number: int, rng: random.Random) -> str:
    subject = FACT_SUBJECTS[(number - 1) % len(FACT_SUBJECTS)]
    predicate = FACT_PREDICATES[(number - 1) // len(FACT_SUBJECTS) % len(FACT_PREDICATES)]
    detail = predicate.format(
        n=rng.randint(2, 90), p=rng.randint(1024, 9999), t=rng.choice(FACT_TEAMS)
    )
    return f"Fact {number}: the {subject} {detail}."


def user_message(number: int, rng: random.Random, fact: str | None) -> str:
    """The fact, when there is one, opens the message: the fake summarizer keeps the first
    words of each message, so a fact can survive into the summary."""
    total = rng.randint(*USER_WORDS)
    parts = [user_tag(number)]
    if fact:
        parts.append(fact)
        total -= len(fact.split())
    parts.append(filler(rng, max(total, 1)) + ".")
    return " ".join(parts)


def assistant_reply(number: int, rng: random.Random) -> str:
    bounds = DEEP_DIVE_WORDS if number % DEEP_DIVE_EVERY == 0 else REPLY_WORDS
    return f"{reply_tag(number)} {filler(rng, rng.randint(*bounds))}."


def build_workload(turns: int, seed: int) -> list[Turn]:
    rng = random.Random(seed)
    fact_turns = sorted(rng.sample(range(1, turns + 1), min(FACT_COUNT, turns)))
    facts = {turn: fact_sentence(index, rng) for index, turn in enumerate(fact_turns, start=1)}
    workload = []
    for number in range(1, turns + 1):
        fact = facts.get(number)
        user = user_message(number, rng, fact)
        workload.append(Turn(number, user, assistant_reply(number, rng), fact))
    return workload


# --- token counting ------------------------------------------------------------------------


@cache
def tokens(text: str) -> int:
    return count_tokens(text)


def body_messages(record: RecordedRequest) -> list[dict[str, Any]]:
    return list(record.body.get("messages") or [])


def message_contents(record: RecordedRequest) -> list[str]:
    return [content_text(message.get("content")) for message in body_messages(record)]


# --- running one configuration --------------------------------------------------------------


class ReplyScript:
    """The fake model's chat answers: the pre-generated reply of the turn being posted. It
    notes which turn each chat request served, so requests map to turns even if one fails."""

    def __init__(self) -> None:
        self.turn: Turn | None = None
        self.served: list[int] = []

    def __call__(self, body: dict[str, Any]) -> str:
        assert self.turn is not None, "a chat request arrived outside a turn"
        self.served.append(self.turn.number)
        return self.turn.reply

    def reset(self) -> None:
        self.turn, self.served = None, []


@dataclass
class Run:
    config: BenchConfig
    chat_id: int
    records: list[RecordedRequest]
    served: list[int]
    failed_turns: list[int]
    final_summary: str
    final_context: list[str]
    ledger: list[dict[str, Any]]
    seconds: float


def post_turn(client: Any, chat_id: int, turn: Turn, *, verbose: bool) -> bool:
    response = client.post(f"/api/v1/chats/{chat_id}/turns/", {"content": turn.user}, format="json")
    if response.status_code == 201:
        return True
    if verbose:
        detail = response.json().get("detail", "")
        print(f"  turn {turn.number}: HTTP {response.status_code} {detail}", file=sys.stderr)
    return False


def play_worker(chat_id: int) -> None:
    """What a Celery worker does after a turn: judge and fold until nothing more is due."""
    from memory_worker.folding.execute import fold_once

    for _ in range(WORKER_PASSES):
        if fold_once(chat_id, RequestReason.TURN).status in ("nothing", "deferred"):
            return


def ledger_rows(chat_id: int) -> list[dict[str, Any]]:
    from conversations.models import Consolidation

    fields = ("status", "trigger", "from_seq", "to_seq", "synchronous", "summary_tokens_after")
    return list(Consolidation.objects.filter(chat_id=chat_id).order_by("id").values(*fields))


def run_config(
    config: BenchConfig,
    workload: Sequence[Turn],
    client: Any,
    server: FakeOpenAI,
    script: ReplyScript,
) -> Run:
    server.reset()
    script.reset()
    chat_id = create_chat(client, config.name, config.preset, config.overrides)
    started = time.monotonic()
    failed: list[int] = []
    for turn in workload:
        script.turn = turn
        if not post_turn(client, chat_id, turn, verbose=len(failed) < FAILURES_SHOWN):
            failed.append(turn.number)
        play_worker(chat_id)
    seconds = time.monotonic() - started
    brief = client.get(f"/api/v1/chats/{chat_id}/brief/").json()
    context = client.get(f"/api/v1/chats/{chat_id}/context/").json()["messages"]
    return Run(
        config=config,
        chat_id=chat_id,
        records=server.requests,
        served=list(script.served),
        failed_turns=failed,
        final_summary=brief["summary"],
        final_context=[content_text(m.get("content")) for m in context],
        ledger=ledger_rows(chat_id),
        seconds=seconds,
    )


# --- measuring ------------------------------------------------------------------------------

NEW_TURN_LINE = re.compile(r"^(?:User|Assistant): (\[t\d+[ua]\])", re.MULTILINE)


def new_turns_section(record: RecordedRequest) -> str:
    """The NEW_TURNS of a summarize request's input as "User: …" lines, one per message (a
    retry repeats the same input)."""
    source = next(text for text in message_contents(record) if is_fold_input(text))
    return transcript(read_fold_input(source)[1])


def instructions_tokens(record: RecordedRequest) -> int:
    return sum(
        tokens(content_text(message.get("content")))
        for message in body_messages(record)
        if message.get("role") == "system"
    )


def existing_summary_tokens(record: RecordedRequest) -> int:
    """Tokens of the EXISTING_SUMMARY section's text (0 for the first fold's NONE)."""
    source = next(text for text in message_contents(record) if is_fold_input(text))
    existing = read_fold_input(source)[0]
    return tokens(existing) if existing else 0


def folded_tags(record: RecordedRequest) -> list[str]:
    return NEW_TURN_LINE.findall(new_turns_section(record))


def context_tags(record: RecordedRequest) -> set[str]:
    """Tags of the verbatim (non-system) messages of a chat request, the new one included."""
    return {
        content_text(m.get("content")).split(" ", 1)[0]
        for m in body_messages(record)
        if m.get("role") != "system"
    }


def prompt_tokens(record: RecordedRequest) -> int:
    return sum(tokens(text) + MESSAGE_OVERHEAD_TOKENS for text in message_contents(record))


def verbatim_history_tokens(record: RecordedRequest) -> int:
    messages = body_messages(record)[:-1]  # the final message is the new user message
    return sum(
        tokens(content_text(m.get("content"))) for m in messages if m.get("role") != "system"
    )


def percentile(values: Sequence[int], share: float) -> int:
    """Nearest-rank percentile."""
    ordered = sorted(values)
    return ordered[max(math.ceil(share * len(ordered)) - 1, 0)] if ordered else 0


def mean(values: Sequence[float]) -> float:
    return sum(values) / len(values) if values else 0.0


def first_fold_positions(
    indexed: Iterable[tuple[int, RecordedRequest]],
    carried: Callable[[RecordedRequest], list[str]] = folded_tags,
) -> dict[str, int]:
    """For each message tag, the position (in all requests) of the first summarize request
    whose NEW_TURNS carries it (``carried``: the tags a summarize request carries)."""
    first: dict[str, int] = {}
    for position, record in indexed:
        for tag in carried(record):
            first.setdefault(tag, position)
    return first


def drops_without_fold(
    run: Run,
    stored: dict[str, int],
    carried: Callable[[RecordedRequest], list[str]] = folded_tags,
) -> int:
    """Messages that left the model's context before being sent to the summarizer.

    ``stored`` maps a tag to the index (among chat requests) of the first chat request that
    must show it: its own request for a user message, the next one for a reply. ``carried``
    reads the tags a summarize request carries (bench.topology also counts a turn-digest
    reply's digest as carrying it)."""
    indexed = list(enumerate(run.records))
    chats = [(position, r) for position, r in indexed if r.kind == "chat"]
    summarized = first_fold_positions(
        ((p, r) for p, r in indexed if r.kind == "summarize"), carried
    )
    contexts = [context_tags(record) for _, record in chats]
    drops = 0
    for tag, visible_from in stored.items():
        absent = next((i for i in range(visible_from, len(chats)) if tag not in contexts[i]), None)
        if absent is not None and summarized.get(tag, math.inf) > chats[absent][0]:
            drops += 1
    return drops


def stored_messages(run: Run) -> dict[str, int]:
    """Tag -> index of the first chat request that must show it (stored turns only)."""
    request_of_turn = {turn: index for index, turn in enumerate(run.served)}
    failed = set(run.failed_turns)
    stored = {}
    for turn, index in request_of_turn.items():
        if turn in failed:
            continue
        stored[user_tag(turn)] = index
        stored[reply_tag(turn)] = index + 1
    return stored


def newest_not_verbatim(run: Run, workload: dict[int, Turn]) -> int:
    chats = [r for r in run.records if r.kind == "chat"]
    misses = 0
    for record, turn in zip(chats, run.served, strict=True):
        last = body_messages(record)[-1]
        if last.get("role") != "user" or content_text(last.get("content")) != workload[turn].user:
            misses += 1
    return misses


def facts_retained(run: Run, workload: Sequence[Turn]) -> int:
    memory = "\n".join([run.final_summary, *run.final_context])
    return sum(1 for turn in workload if turn.fact and turn.fact in memory)


@dataclass
class Metrics:
    config: str
    preset: str
    overrides: dict[str, int]
    turns: int
    failed_turns: int
    chat_requests: int
    summarizer_calls: int
    calls_per_100_turns: float
    folds_succeeded: int
    folds_failed: int
    sync_folds: int
    messages_folded: int
    messages_per_call: float
    conversation_tokens: int
    summarizer_input_tokens: int
    amplification: float
    folded_content_share: float
    overhead_share: float
    overhead_tokens_per_call: float
    # The overhead per call in three parts: the instructions (system messages), the existing summary
    # every fold rewrites, and the rest (the input's section markers and turn labels, and a stricter
    # retry's extra messages).
    instructions_tokens_per_call: float
    existing_summary_tokens_per_call: float
    format_tokens_per_call: float
    # What amplification would be with no instructions at all: the floor of any summarizer that
    # takes the fold's input and rewrites the summary on every fold (docs/design.md, the
    # summarizer).
    amplification_without_instructions: float
    prompt_tokens_mean: float
    prompt_tokens_p95: int
    prompt_tokens_max: int
    verbatim_tokens_mean: float
    drop_without_fold: int
    newest_not_verbatim: int
    resent_folded: int
    facts_planted: int
    facts_retained: int
    summary_tokens_max: int
    final_summary_tokens: int
    seconds: float


def message_tokens_by_tag(workload: Sequence[Turn]) -> dict[str, int]:
    by_tag = {}
    for turn in workload:
        by_tag[user_tag(turn.number)] = tokens(turn.user)
        by_tag[reply_tag(turn.number)] = tokens(turn.reply)
    return by_tag


def measure(run: Run, workload: Sequence[Turn]) -> Metrics:
    turns = len(workload)
    chats = [r for r in run.records if r.kind == "chat"]
    summaries = [r for r in run.records if r.kind == "summarize"]
    by_tag = message_tokens_by_tag(workload)
    stored = {turn.number for turn in workload} - set(run.failed_turns)
    conversation = sum(by_tag[user_tag(n)] + by_tag[reply_tag(n)] for n in stored)
    sent = sum(tokens(text) for record in summaries for text in message_contents(record))
    folded_lists = [folded_tags(record) for record in summaries]
    folded_content = sum(by_tag[tag] for tags in folded_lists for tag in tags)
    resent = sum(1 for count in Counter(t for ts in folded_lists for t in ts).values() if count > 1)
    succeeded = [row for row in run.ledger if row["status"] == "succeeded"]
    folded = sum(row["to_seq"] - row["from_seq"] + 1 for row in succeeded)
    prompts = [prompt_tokens(record) for record in chats]
    calls = len(summaries) or 1
    instructions = sum(instructions_tokens(record) for record in summaries)
    existing = sum(existing_summary_tokens(record) for record in summaries)
    return Metrics(
        config=run.config.name,
        preset=run.config.preset,
        overrides=run.config.overrides,
        turns=turns,
        failed_turns=len(run.failed_turns),
        chat_requests=len(chats),
        summarizer_calls=len(summaries),
        calls_per_100_turns=len(summaries) * 100 / turns,
        folds_succeeded=len(succeeded),
        folds_failed=sum(1 for row in run.ledger if row["status"] == "failed"),
        sync_folds=sum(1 for row in run.ledger if row["synchronous"]),
        messages_folded=folded,
        messages_per_call=folded / len(summaries) if summaries else 0.0,
        conversation_tokens=conversation,
        summarizer_input_tokens=sent,
        amplification=sent / conversation,
        folded_content_share=folded_content / conversation,
        overhead_share=(sent - folded_content) / conversation,
        overhead_tokens_per_call=(sent - folded_content) / len(summaries) if summaries else 0.0,
        instructions_tokens_per_call=instructions / calls,
        existing_summary_tokens_per_call=existing / calls,
        format_tokens_per_call=(sent - folded_content - instructions - existing) / calls,
        amplification_without_instructions=(sent - instructions) / conversation,
        prompt_tokens_mean=mean(prompts),
        prompt_tokens_p95=percentile(prompts, 0.95),
        prompt_tokens_max=max(prompts, default=0),
        verbatim_tokens_mean=mean([verbatim_history_tokens(record) for record in chats]),
        drop_without_fold=drops_without_fold(run, stored_messages(run)),
        newest_not_verbatim=newest_not_verbatim(run, {t.number: t for t in workload}),
        resent_folded=resent,
        facts_planted=sum(1 for turn in workload if turn.fact),
        facts_retained=facts_retained(run, workload),
        summary_tokens_max=max((row["summary_tokens_after"] for row in succeeded), default=0),
        final_summary_tokens=tokens(run.final_summary),
        seconds=run.seconds,
    )


# --- goals and reporting --------------------------------------------------------------------


@dataclass
class GoalResult:
    config: str
    goal: str
    target: float
    measured: float
    met: bool
    miss: str


def check_goal(goal: Goal, metrics: Metrics) -> GoalResult:
    measured = float(getattr(metrics, goal.metric))
    met = measured <= goal.target if goal.at_most else measured >= goal.target
    gap = measured - goal.target
    miss = ""
    if not met:
        relative = f" ({gap / goal.target:+.1%})" if goal.target else ""
        miss = format_number(gap, signed=True) + relative
    return GoalResult(metrics.config, goal.key, goal.target, measured, met, miss)


def format_number(value: float, *, signed: bool = False) -> str:
    sign = "+" if signed else ""
    if value.is_integer() or abs(value) >= 100:
        return f"{value:{sign},.0f}"
    return f"{value:{sign}.2f}" if abs(value) < 10 else f"{value:{sign}.1f}"


def check_goals(configs: Sequence[BenchConfig], results: Sequence[Metrics]) -> list[GoalResult]:
    return [
        check_goal(goal, metrics)
        for config, metrics in zip(configs, results, strict=True)
        for goal in GOALS
        if goal.applies(config)
    ]


def markdown_table(header: Sequence[str], rows: Iterable[Sequence[str]]) -> str:
    lines = ["| " + " | ".join(header) + " |", "|" + "---|" * len(header)]
    lines.extend("| " + " | ".join(row) + " |" for row in rows)
    return "\n".join(lines)


RESULT_HEADER = (
    "config",
    "calls/100 turns",
    "msgs/call",
    "amplification (content + overhead)",
    "overhead/call: instructions + summary + format",
    "amplification without instructions",
    "prompt tokens mean / p95 / max",
    "mean verbatim history",
    "drop w/o fold",
    "newest not verbatim",
    "re-sent",
    "sync folds",
    "failed folds / turns",
    "facts kept",
)


def result_row(m: Metrics) -> list[str]:
    return [
        f"`{m.config}`",
        f"{m.calls_per_100_turns:.1f}",
        f"{m.messages_per_call:.1f}",
        f"{m.amplification:.2f} ({m.folded_content_share:.2f} + {m.overhead_share:.2f})",
        f"{m.instructions_tokens_per_call:.0f} + {m.existing_summary_tokens_per_call:.0f}"
        f" + {m.format_tokens_per_call:.0f}",
        f"{m.amplification_without_instructions:.3f}",
        f"{m.prompt_tokens_mean:,.0f} / {m.prompt_tokens_p95:,} / {m.prompt_tokens_max:,}",
        f"{m.verbatim_tokens_mean:,.0f}",
        str(m.drop_without_fold),
        str(m.newest_not_verbatim),
        str(m.resent_folded),
        str(m.sync_folds),
        f"{m.folds_failed} / {m.failed_turns}",
        f"{m.facts_retained}/{m.facts_planted}",
    ]


def goal_cell(result: GoalResult | None) -> str:
    if result is None:
        return "—"
    value = format_number(result.measured)
    return f"{value} ✓" if result.met else f"{value} ✗ {result.miss}"


def goals_table(goal_results: Sequence[GoalResult]) -> str:
    configs = list(dict.fromkeys(result.config for result in goal_results))
    by_key = {(result.config, result.goal): result for result in goal_results}
    rows = [
        [f"`{config}`", *(goal_cell(by_key.get((config, goal.key))) for goal in GOALS)]
        for config in configs
    ]
    return markdown_table(["config", *(goal.label for goal in GOALS)], rows)


def header_lines(info: dict[str, Any], command: str, date: str, database: str) -> list[str]:
    return [
        f"command: {command}",
        f"date:    {date}",
        f"machine: {info['platform']}, {info['cpu_count']} CPUs, Python {info['python']}",
        f"database: {database}",
    ]


# --- setup ----------------------------------------------------------------------------------


def configure_for_fake_server(database_url: str, base_url: str) -> str:
    return configure_django(
        database_url,
        {
            "MEMORY_DISPATCH": "off",
            "CHAT_BACKEND": "openai",
            "MEMORY_SUMMARIZER_BACKEND": "chat",
            "OPENAI_API_KEY": "bench",
            "OPENAI_BASE_URL": base_url,
            "CHAT_MODEL": "fake-chat",
            "MEMORY_SUMMARIZER_MODEL": "fake-summarizer",
            "TURN_RATE_LIMIT": "",  # one user sends 600 turns a minute here
        },
    )


def parse_args(argv: Sequence[str] | None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(
        prog="python -m bench.cost", description=__doc__.split("\n")[0]
    )
    parser.add_argument("--turns", type=int, default=DEFAULT_TURNS)
    parser.add_argument(
        "--presets", default="all", help="all, or comma-separated config or preset names"
    )
    parser.add_argument("--seed", type=int, default=DEFAULT_SEED)
    parser.add_argument("--out", default="bench/results/cost.json")
    parser.add_argument(
        "--database-url", default=None, help="default: a fresh SQLite file in a temp dir"
    )
    args = parser.parse_args(argv)
    if args.turns < 2:
        parser.error("--turns must be at least 2")
    return args


def workload_summary(workload: Sequence[Turn]) -> dict[str, Any]:
    user = [tokens(turn.user) for turn in workload]
    reply = [tokens(turn.reply) for turn in workload]
    return {
        "turns": len(workload),
        "user_tokens_mean": round(mean(user), 1),
        "reply_tokens_mean": round(mean(reply), 1),
        "conversation_tokens": sum(user) + sum(reply),
        "deep_dives": sum(1 for turn in workload if turn.number % DEEP_DIVE_EVERY == 0),
        "planted_facts": sum(1 for turn in workload if turn.fact),
    }


def run_all(
    args: argparse.Namespace, configs: Sequence[BenchConfig], tmpdir: str
) -> dict[str, Any]:
    workload = build_workload(args.turns, args.seed)
    script = ReplyScript()
    with FakeOpenAI(reply_fn=script, summary_cap_words=SUMMARY_CAP_WORDS) as server:
        database_url = args.database_url or f"sqlite:///{tmpdir}/bench.sqlite3"
        vendor = configure_for_fake_server(database_url, server.base_url)
        client = api_client()
        results = []
        for config in configs:
            run = run_config(config, workload, client, server, script)
            results.append(measure(run, workload))
            print(f"  {config.name}: {run.seconds:.1f} s", file=sys.stderr, flush=True)
    return {"workload": workload_summary(workload), "database": vendor, "results": results}


def main(argv: Sequence[str] | None = None) -> int:
    args = parse_args(argv)
    configs = select_configs(args.presets)
    command = shlex.join(["python", "-m", "bench.cost", *(sys.argv[1:] if argv is None else argv)])
    date = datetime.now(UTC).strftime("%Y-%m-%d %H:%M UTC")
    info = machine_info()
    started = time.monotonic()
    with tempfile.TemporaryDirectory(prefix="chatmem-bench-") as tmpdir:
        outcome = run_all(args, configs, tmpdir)
    wall = time.monotonic() - started
    results: list[Metrics] = outcome["results"]
    goal_results = check_goals(configs, results)
    lines = [
        *header_lines(info, command, date, outcome["database"]),
        f"workload: {json.dumps(outcome['workload'])}",
        f"wall time: {wall:.1f} s",
        "",
        markdown_table(RESULT_HEADER, (result_row(m) for m in results)),
        "",
        goals_table(goal_results) if goal_results else "(no configuration with a goal selected)",
    ]
    print("\n".join(lines))
    report = {
        "command": command,
        "date": date,
        "machine": info,
        "database": outcome["database"],
        "seed": args.seed,
        "workload": outcome["workload"],
        "wall_seconds": round(wall, 1),
        "results": [asdict(m) for m in results],
        "goals": [asdict(g) for g in goal_results],
    }
    print(f"\nwrote {save_report(report, args.out)}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
