"""The goals bench.report checks, with their thresholds, and the pieces every section of the
page is made of: rows, sections, the results files read once, numbers formatted alike."""

from __future__ import annotations

import json
import re
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parent.parent
RESULTS_DIR = ROOT / "bench" / "results"
PAGE = ROOT / "docs" / "benchmarks.md"

Doc = dict[str, Any]

MET, NOT_MET, NO_GOAL = "met", "**not met**", "no goal"
PEERS_BOUND = "seed002@4500+500"  # bench.topology: token-budget at 4,500 tokens, summary 500
RETENTION_BOUND = "token-budget@4000+500/target=0"  # bench.retention: the same bound
TYPES = ("safety", "constraint", "fact", "goal", "preference")
STANDARD = dict.fromkeys(TYPES, 0.95)
CROWDED = {**STANDARD, "fact": 0.90}
EVERY = dict.fromkeys(TYPES, 1.0)

# The goals, from the issues; {name} is filled in from the results file.
GOALS = {
    "calls": "≤ 16 summarizer calls / 100 turns at the peers' bound (issue 3; issue 23: ≤ 18)",
    "input": "summarizer input ≤ 1.20x the conversation at the peers' bound (issue 23)",
    "amplification": "input amplification ≤ 1.15 (issue 3)",
    "sync": "≤ 1 % of turns fold synchronously, every preset (issue 23)",
    "superseded": "≤ 1 % of fold attempts superseded, every preset (issue 23)",
    "stored": "every preset: every turn stored, no drop without a fold, the newest message "
    "verbatim, no turn over its bound (issues 3, 23)",
    "verbatim": "mean verbatim history ≥ 2,000 tokens at the peers' bound (issue 3)",
    "slow": "model 1 s, summarizer 2 s, 8 chats, the peers' bound: ≤ 1 % synchronous, ≤ 1 % "
    "superseded, no turn over its bound (issue 23)",
    "pads": "a summarizer that pads to its cap, every preset: guard repairs ≤ 2 % of folds, 0 "
    "failed; at the peers' bound ≤ 18 calls / 100 turns, input ≤ 1.20x (issue 38)",
    "misses": "turns that lose the cached prefix ≤ folds committed, every preset (issue 36)",
    "between": "the default (`sliding-window`): ≥ 95 % cacheable between folds (issue 36)",
    "hosted": "the hosted configuration ({knobs}): ≥ 90 % of prompt tokens cacheable (issue 36)",
    "billed": "hosted: billed input per turn ≤ 0.8x the default's (issue 36)",
    "hosted calls": "hosted: summarizer calls / 100 turns no higher than the default's (issue 36)",
    "standard": "every type ≥ 95 % (issue 25)",
    "guard": "every type 100 % (issue 38)",
    "forgets": "every type 100 %, ≤ 1.1x the calls of the row above (issue 38)",
    "worst": "every type 100 %, 0 folds failed (issue 38)",
    "pinned": "every pinned canary kept after every round",
    "crowded": "standing types ≥ 95 %, facts ≥ 90 % (issue 37)",
    "flat": "turn overhead at message {history} ≤ 1.1x at message 10, p50 and p99 (issue 6)",
    "overhead": "p50 turn overhead ≤ 15 ms, one client (issue 6)",
    "150": "≥ 150 turns/s at concurrency {concurrency}, {model} (issue 6)",
    "proxy": "≥ 0.5x a stateless proxy's turns/s, {model} (issue 6)",
    "p50": "p50 latency ≤ 15 ms at concurrency {concurrency}, {model} (issue 6)",
    "360": "400 clients, model 1 s, {worker}: ≥ 360 turns/s for 60 s (issue 6)",
    "lag": "400 clients, {worker}: no errors, no sync fold, consolidation lag p95 < 5 s (issue 6)",
    "streams": "200 streams, {arrivals}, model 2 s: p99 first-token overhead < 100 ms (issue 5)",
    "model call": "CPU per model call, 200 threads, model 1 s",
    "compare": "a turn's cost, {head} against {base}, in one interleaved run",
    "workers": "2 workers ≥ 1.7x 1 worker (issue 6)",
    "rss": "worker RSS flat ±10 % over 10,000 folds (issue 6)",
    "kill": "worker killed mid-fold: another folds the chat within 60 s, 20 kills (issue 29)",
    "chaos": "chaos as deployed (40 x 60, a kill every 2 s, 30 % faults): 0 turns failed, 0 "
    "violations, converged within 120 s after the faults stop (issues 29, 38)",
    "stall": "a Redis that never answers: turn p99 within 300 ms of healthy (issue 27)",
    "recovery": "Redis back: every chat due folds within 2 sweep intervals, {interval} (issue 27)",
    "local": "llama.cpp, SmolLM2-135M, 30 turns: 0 failed, no fold over cap or deadline, every "
    "summary valid (issue 30)",
    "timeline": "a {turns:,}-turn chat's memory timeline: its queries and SVG in < 1 s, the SVG "
    "< 300 KB (issue 35)",
    "fleet": "the admin's fleet page over {rows:,} ledger rows in < 300 ms (issue 35)",
}

TESTS = [
    "schemathesis, two users, ≥ 2,000 cases, 0 server errors (issue 27): "
    "`tests/test_schemathesis.py`",
    "hosts' clocks ±5 min apart, no slot stolen (issue 27): `tests/test_host_clocks.py`",
    "1,000 deletions racing failing folds (issue 27): `CHATMEM_DELETION_RACES=1000 python -m "
    "pytest tests/test_deletion_races.py -k racing`",
    "query counts constant in history length (issue 6): `tests/test_query_counts.py`",
    "token counts with no tokenizer (issue 30): `python -m bench.token_margin` (no results file)",
]


class ReportError(Exception):
    """A results file is missing or does not hold what the page needs."""


@dataclass
class Row:
    cells: list[str]
    files: tuple[str, ...]


@dataclass
class Section:
    title: str
    note: str
    tables: list[tuple[list[str], list[Row]]]
    caveats: dict[str, str] = field(default_factory=dict)


class Results(dict[str, Doc]):
    """The results files of one directory, each read when first asked for."""

    def __init__(self, directory: Path) -> None:
        super().__init__()
        self.directory = directory

    def __missing__(self, name: str) -> Doc:
        try:
            doc: Doc = json.loads((self.directory / name).read_text(encoding="utf-8"))
        except (OSError, ValueError) as error:
            raise ReportError(f"{self.directory / name}: {error}") from error
        self[name] = doc
        return doc

    def config(self, name: str, config: str | None = None) -> Doc:
        results: list[Doc] = self[name]["results"]
        for result in results:
            if (config is None and len(results) == 1) or result["config"] == config:
                return result
        raise ReportError(f"{name}: no result for configuration {config!r}")


GOAL = ["goal", "measured", "verdict"]


def goal(key: str, measured: str, ok: bool | None, *files: str, note: str = "", **fill: Any) -> Row:
    text = GOALS[key].format(**fill)
    return Row([text, measured, NO_GOAL if ok is None else verdict(ok, note)], files)


def verdict(ok: bool, note: str = "") -> str:
    return (MET if ok else NOT_MET) + (f" ({note})" if note else "")


def num(value: float, places: int = 1) -> str:
    return f"{value:,.{places}f}"


def pct(share: float) -> str:
    return "100 %" if share == 1 else f"{share * 100:.1f} %"


def label(config: str) -> str:
    return f"`{config}`" + (" (the peers' bound)" if config == PEERS_BOUND else "")


def short(config: str) -> str:
    return "the peers' bound" if config == PEERS_BOUND else f"`{config}`"


def same_commit(first: Doc, second: Doc) -> str:
    a, b = (doc.get("code", {}).get("commit", "?") for doc in (first, second))
    return f"both on {a}" if a == b else f"{a} against {b}: different commits"


def machine(doc: Doc) -> str:
    """'Linux x86_64, 2 CPUs, Python 3.11.7' from either form the benchmarks record."""
    recorded = doc.get("machine")
    if isinstance(recorded, dict):
        platform = str(recorded.get("platform", ""))
        rest = [f"{recorded.get('cpu_count')} CPUs", f"Python {recorded.get('python')}"]
    else:
        platform, *rest = (part.strip() for part in str(recorded).split(","))
    arch = re.search(r"x86_64|aarch64|arm64|i686", platform)
    return ", ".join([f"{platform.split('-')[0]} {arch.group() if arch else '?'}", *rest])


def command(doc: Doc, name: str) -> str:
    """The file's command, its `--out` naming the file (every benchmark takes one)."""
    recorded = str(doc.get("command", "")).strip()
    if not recorded.startswith("python -m bench."):
        raise ReportError(f"{name}: no command recorded")
    out = f"--out bench/results/{name}"
    if re.search(r"--out\s+\S+", recorded):
        return re.sub(r"--out\s+\S+", out, recorded)
    return f"{recorded} {out}"
