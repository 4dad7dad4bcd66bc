"""What bench.topology measures of a configuration's run, and its report.

A configuration's record (``ConfigRun``: the chats as they were played, every request the fake
model server recorded, the web processes' log lines) is split by chat with bench.topology_chats'
tags; bench.cost's measuring functions run on each chat's requests; the ledger's rows and the web
log's "sync_fold" lines are counted; the figures (listed in bench.topology's docstring) are summed
or pooled over the chats and formatted as the report's table.
"""

from __future__ import annotations

import argparse
import hashlib
import json
import subprocess
from collections import Counter
from collections.abc import Iterable, Mapping, Sequence
from dataclasses import asdict, dataclass, field
from typing import Any

from bench import cost
from bench.common import ROOT
from bench.prompt_cache import CacheFigures, cache_figures, pooled
from bench.throughput import percentile
from bench.topology_chats import DIGEST_LINE, REPLY_TAG, chat_ordinal, turn_request_number
from tests.support.fake_openai import RecordedRequest, content_text, last_user_text

# --- what a configuration's run recorded -----------------------------------------------------


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
    """The chat's bound on history tokens: max_memory_tokens, and token-budget's max_tokens (summary
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
    cache: CacheFigures  # what a prefix cache could serve of its turn prompts


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
        cache=cache_figures([cost.body_messages(r) for r in turn_requests]),
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


# How the fold guard's repair request opens (memory_worker.summaries.contract.repair_request).
REPAIR_OPENING = "That summary drops these lines"


def is_repair_request(record: RecordedRequest) -> bool:
    """A summarize request that is the fold guard's repair call (its follow-up names lines)."""
    return record.kind == "summarize" and REPAIR_OPENING in last_user_text(record.body)


def fold_figures(run: ConfigRun) -> dict[str, Any]:
    """Summarizer calls as the server saw them (retries included), and the ledger's attempts."""
    sent = sum(len(chat.statuses) for chat in run.chats)
    calls = sum(1 for record in run.records if record.kind == "summarize")
    repairs = sum(1 for record in run.records if is_repair_request(record))
    ledger = ledger_counts(row for chat in run.chats for row in chat.ledger)
    sync_turns = sync_fold_turns(run.web_log)
    return {
        "summarizer_calls": calls,
        "guard_repair_calls": repairs,
        "guard_repair_pct_of_folds": round(ratio(repairs * 100, ledger.attempts), 2),
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
    cache = pooled([f.cache for f in figures])
    return {
        "cached_share": round(cache.cached_share, 4),
        "cached_share_exact": round(cache.exact_share, 4),
        "cached_share_between_folds": round(cache.between_folds_share, 4),
        "cache_miss_turns": cache.miss_turns,
        "billed_input_per_turn": round(cache.billed_per_turn, 1),
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
        "cache": asdict(figures.cache),
        **{k: v for k, v in asdict(figures.metrics).items() if k not in ("config", "preset")},
    }


# --- reporting ------------------------------------------------------------------------------

RESULT_HEADER = (
    "config",
    "turns sent / stored / failed",
    "calls/100 turns",
    "guard repair calls (% of folds)",
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
    "cached share: OpenAI rule / exact / between folds",
    "turns losing the prefix (folds committed)",
    "billed input per turn (cached at 0.1)",
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
        f"{r.get('guard_repair_calls', 0)} ({r.get('guard_repair_pct_of_folds', 0.0):.1f} %)",
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
        f"{r.get('cached_share', 0.0):.1%} / {r.get('cached_share_exact', 0.0):.1%} / "
        f"{r.get('cached_share_between_folds', 0.0):.1%}",
        f"{r.get('cache_miss_turns', 0)} ({folds['succeeded']:,})",
        f"{r.get('billed_input_per_turn', 0.0):,.0f}",
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
