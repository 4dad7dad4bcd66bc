"""docs/benchmarks.md, written from the results files in bench/results/.

    python -m bench.report          # write docs/benchmarks.md
    python -m bench.report --check  # exit 1 if docs/benchmarks.md is not what this would write

Every figure on the page is read from a results file; the goals (their thresholds) are here, and
each verdict compares the one with the other. Standard library only: this reads JSON and imports
nothing of chatmem, so it runs without Django, a database or a service.
"""

from __future__ import annotations

import argparse
import json
import re
import sys
import textwrap
from collections import Counter
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


class ReportError(Exception):
    """A results file is missing or does not hold what the page needs."""


@dataclass
class Row:
    cells: list[str]
    files: tuple[str, ...]


@dataclass
class Table:
    headers: list[str]
    rows: list[Row]


@dataclass
class Section:
    title: str
    note: str
    tables: list[Table]
    caveats: dict[str, str] = field(default_factory=dict)


class Results:
    """The results files of one directory, each read once."""

    def __init__(self, directory: Path) -> None:
        self.directory = directory
        self.docs: dict[str, Doc] = {}

    def __call__(self, name: str) -> Doc:
        if name not in self.docs:
            path = self.directory / name
            try:
                self.docs[name] = json.loads(path.read_text(encoding="utf-8"))
            except (OSError, ValueError) as error:
                raise ReportError(f"{path}: {error}") from error
        return self.docs[name]

    def config(self, name: str, config: str | None = None) -> Doc:
        results: list[Doc] = self(name)["results"]
        for result in results:
            if config is None and len(results) == 1 or result["config"] == config:
                return result
        raise ReportError(f"{name}: no result for configuration {config!r}")


def num(value: float, places: int = 1) -> str:
    return f"{value:,.{places}f}"


def pct(share: float, places: int = 1) -> str:
    return f"{share * 100:.{places}f} %"


def kept(share: float) -> str:
    return "100 %" if share >= 1 else pct(share)


def label(config: str) -> str:
    bound = config in (PEERS_BOUND, RETENTION_BOUND)
    return f"`{config}` (the peers' bound)" if bound else f"`{config}`"


def verdict(ok: bool, note: str = "") -> str:
    return (MET if ok else NOT_MET) + (f" ({note})" if note else "")


def goal(text: str, measured: str, ok: bool | None, *files: str, note: str = "") -> Row:
    return Row([text, measured, NO_GOAL if ok is None else verdict(ok, note)], files)


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


# --- the sections ------------------------------------------------------------------------------


def topology_section(r: Results) -> Section:
    topo, slow, pads = "topology-cache.json", "topology_slow.json", "topology-guard-pads.json"
    every: list[Doc] = r(topo)["results"]
    bound, window = r.config(topo, PEERS_BOUND), r.config(topo, "sliding-window")
    sync = max(every, key=lambda c: c["sync_fold_turns_pct"])
    superseded = max(every, key=lambda c: c["folds"]["superseded_pct"])
    stored, sent = (sum(c[key] for c in every) for key in ("turns_stored", "turns_sent"))
    drops, newest, over = (
        sum(c[key] for c in every)
        for key in ("drop_without_fold", "newest_not_verbatim", "over_bound_turns")
    )
    amplification = {PEERS_BOUND: bound["amplification"], "sliding-window": window["amplification"]}
    missed = [label(config) for config, value in amplification.items() if value > 1.15]
    s = r.config(slow)
    padded: list[Doc] = r(pads)["results"]
    padded_bound = r.config(pads, PEERS_BOUND)
    repairs, folds, failed = (
        sum(c["guard_repair_calls"] for c in padded),
        sum(c["folds"]["attempts"] for c in padded),
        sum(c["folds"]["failed"] for c in padded),
    )
    worst_repair = max(c["guard_repair_pct_of_folds"] for c in padded)
    rows = [
        goal(
            "≤ 16 summarizer calls / 100 turns at the peers' bound (issue 3; issue 23: ≤ 18)",
            num(bound["calls_per_100_turns"]),
            bound["calls_per_100_turns"] <= 16,
            topo,
        ),
        goal(
            "summarizer input ≤ 1.20× the conversation at the peers' bound (issue 23)",
            f"{bound['amplification']:.3f}×",
            bound["amplification"] <= 1.20,
            topo,
        ),
        goal(
            "input amplification ≤ 1.15 (issue 3)",
            ", ".join(f"{label(c)} {value:.3f}" for c, value in amplification.items()),
            not missed,
            topo,
            note=f"at {' and '.join(missed)}" if missed else "",
        ),
        goal(
            "≤ 1 % of turns fold synchronously, every preset (issue 23)",
            f"at most {sync['sync_fold_turns_pct']:.2f} % ({label(sync['config'])})",
            sync["sync_fold_turns_pct"] <= 1,
            topo,
        ),
        goal(
            "≤ 1 % of fold attempts superseded, every preset (issue 23)",
            f"at most {superseded['folds']['superseded_pct']:.2f} %",
            superseded["folds"]["superseded_pct"] <= 1,
            topo,
        ),
        goal(
            "every turn stored, 0 drops without a fold, newest message verbatim, "
            "no turn over its bound, every preset (issues 3, 23)",
            f"{stored:,} of {sent:,} stored; {drops} dropped, {newest} not verbatim, {over} over",
            stored == sent and drops == newest == over == 0,
            topo,
        ),
        goal(
            "mean verbatim history ≥ 2,000 tokens at the peers' bound (issue 3)",
            num(bound["verbatim_tokens_mean"], 0),
            bound["verbatim_tokens_mean"] >= 2000,
            topo,
        ),
        goal(
            "model 1 s, summarizer 2 s, 8 chats, 4 workers, the peers' bound: ≤ 1 % synchronous, "
            "≤ 1 % superseded, no turn over its bound (issue 23)",
            f"{s['sync_fold_turns_pct']:.1f} % synchronous, {s['folds']['superseded_pct']:.1f} % "
            f"superseded, {s['over_bound_turns']} over; p99 turn {num(s['latency_p99_ms'], 0)} ms",
            s["sync_fold_turns_pct"] <= 1
            and s["folds"]["superseded_pct"] <= 1
            and s["over_bound_turns"] == 0,
            slow,
        ),
        goal(
            "a summarizer that pads to its cap, every preset: guard repairs ≤ 2 % of folds, "
            "0 failed folds; at the peers' bound ≤ 18 calls / 100 turns, input ≤ 1.20× (issue 38)",
            f"{repairs} repairs in {folds:,} folds (at most {worst_repair:.1f} %), {failed} failed; "
            f"{num(padded_bound['calls_per_100_turns'])} calls, "
            f"{padded_bound['amplification']:.3f}×",
            worst_repair <= 2
            and failed == 0
            and padded_bound["calls_per_100_turns"] <= 18
            and padded_bound["amplification"] <= 1.20,
            pads,
        ),
    ]
    chats, turns = every[0]["chats"], r(topo)["workload"]["turns_per_chat"]
    note = (
        f"{chats} chats × {turns} turns at once per configuration over HTTP: gunicorn, real "
        "`celery worker` processes, PostgreSQL, Redis and the fake model server, instant model, a "
        "summarizer that pads to its cap. The peers' bound is `seed002@4500+500`: `token-budget` "
        "at 4,500 tokens with a 500-token summary. Amplification is all summarizer input over the "
        "conversation's tokens."
    )
    return Section("Memory cost on the deployed topology", note, [Table(GOAL, rows)])


GOAL = ["goal", "measured", "verdict"]


def cache_section(r: Results) -> Section:
    topo, default, hosted = (
        "topology-cache.json",
        "topology-cache-default.json",
        "topology-cache-hosted.json",
    )
    every: list[Doc] = r(topo)["results"]
    worst = max(every, key=lambda c: c["cache_miss_turns"] / c["folds"]["succeeded"])
    base, h = r.config(topo, "sliding-window"), r.config(hosted)
    knobs = ", ".join(f"{key} {value}" for key, value in h["overrides"].items())
    billed = h["billed_input_per_turn"] / base["billed_input_per_turn"]
    pair = same_commit(r(hosted), r(topo))
    rows = [
        goal(
            "turns that lose the cached prefix ≤ folds committed, every preset (issue 36)",
            f"closest: {label(worst['config'])}, {worst['cache_miss_turns']:,} turns, "
            f"{worst['folds']['succeeded']:,} folds",
            all(c["cache_miss_turns"] <= c["folds"]["succeeded"] for c in every),
            topo,
        ),
        *(
            goal(
                "the default (`sliding-window`): ≥ 95 % cacheable between folds (issue 36)",
                pct(r.config(name, "sliding-window")["cached_share_between_folds"]),
                r.config(name, "sliding-window")["cached_share_between_folds"] >= 0.95,
                name,
            )
            for name in (topo, default)
        ),
        goal(
            f"the hosted configuration ({knobs}): ≥ 90 % of chat prompt tokens cacheable "
            "(issue 36)",
            pct(h["cached_share"]),
            h["cached_share"] >= 0.90,
            hosted,
        ),
        goal(
            "hosted: billed input per turn ≤ 0.8× the default's (issue 36)",
            f"{num(h['billed_input_per_turn'], 0)} against {num(base['billed_input_per_turn'], 0)}"
            f" tokens: {billed:.2f}× ({pair})",
            billed <= 0.8,
            hosted,
            topo,
        ),
        goal(
            "hosted: summarizer calls / 100 turns no higher than the default's (issue 36)",
            f"{h['calls_per_100_turns']:.2f} against {base['calls_per_100_turns']:.2f} ({pair})",
            h["calls_per_100_turns"] <= base["calls_per_100_turns"],
            hosted,
            topo,
        ),
    ]
    configs = [Row(config_cells(label(c["config"]), c), (topo,)) for c in every]
    for name in (default, hosted, "topology-cache-hosted16.json"):
        c = r.config(name)
        extra = ", ".join(f"{key} {value}" for key, value in c["overrides"].items())
        configs.append(
            Row(config_cells(f"`{c['preset']}`" + (f", {extra}" if extra else ""), c), (name,))
        )
    peers = "peers-cache.json"
    for p in r(peers)["results"]:
        configs.append(Row(config_cells(f"{p['peer']} (unit-level)", p), (peers,)))
    note = (
        "Cacheable: the share of chat prompt tokens in the longest prefix each turn's prompt shares "
        "with the chat's previous one, as OpenAI's rule caches it (from 1,024 tokens, in steps of "
        "128), exactly, and over the turns between folds. Billed input counts a cached token at 0.1 "
        "of an uncached one. The peers run in one process on the same 600-turn chats at the "
        "peers' bound (`python -m bench.peers`, their own libraries)."
    )
    headers = [
        "configuration",
        "calls / 100 turns",
        "cacheable: OpenAI's rule / exact / between folds",
        "billed input / turn",
        "prompt tokens, mean",
        "drops without a fold",
        "turns without their own message",
    ]
    return Section("Prompt cache", note, [Table(GOAL, rows), Table(headers, configs)])


def config_cells(name: str, c: Doc) -> list[str]:
    between = c.get("cached_share_between_folds")
    shares = [pct(c["cached_share"]), pct(c["cached_share_exact"])]
    shares.append("—" if between is None else pct(between))
    drops = c.get("drop_without_fold", c.get("dropped_without_fold"))
    return [
        name,
        num(c["calls_per_100_turns"]),
        " / ".join(shares),
        num(c["billed_input_per_turn"], 0),
        num(c["prompt_tokens_mean"], 0),
        f"{drops:,}",
        f"{c['newest_not_verbatim']:,}",
    ]


RETENTION_HEADERS = [
    "sessions: summarizer",
    "goal",
    *TYPES[:3],
    "goal state",
    "preference",
    "summarize calls (repairs)",
    "folds (failed)",
    "verdict",
]


def retention_row(
    r: Results,
    name: str,
    text: str,
    thresholds: dict[str, float],
    *,
    every_round: bool = False,
    also: tuple[str, str, bool] | None = None,
) -> Row:
    """Kept after the last round (or every round), `sliding-window` / the peers' bound; `also`
    is one more file, a note for the calls cell and a condition of the verdict."""
    doc = r(name)
    configs: list[Doc] = doc["results"]
    names = [c["config"] for c in configs]
    if len(names) != 2 or not (
        names[0].startswith("sliding-window") and names[1].startswith(RETENTION_BOUND)
    ):
        raise ReportError(f"{name}: expected sliding-window and the peers' bound, got {names}")
    ok = all(
        min(c["kept"][t] if every_round else c["kept"][t][-1:]) >= thresholds[t]
        and c["incomplete_sessions"] == c["failed_turns"] == 0
        for c in configs
        for t in TYPES
    )
    calls = f"{doc['summarize_calls']:,}"
    if "guard_repair_calls" in doc:
        calls += f" ({doc['guard_repair_calls']:,})"
    folds = "—"
    if "folds" in doc:
        failed = sum(doc["folds"]["failed_by_kind"].values())
        folds = f"{doc['folds']['succeeded']:,} ({failed})"
        ok = ok and failed == 0
    files: tuple[str, ...] = (name,)
    if also is not None:
        files, calls, ok = (name, also[0]), f"{calls}; {also[1]}", ok and also[2]
    who = f"{doc.get('sessions', 'standard')}: {doc['summarizer']}"
    kept_cells = [" / ".join(kept(c["kept"][t][-1]) for c in configs) for t in TYPES]
    return Row([who, text, *kept_cells, calls, folds, verdict(ok)], files)


def retention_section(r: Results) -> Section:
    forgets, nothing = "retention-guard-forgets-0.2.json", "retention-guard-forgets-0.json"
    ratio = r(forgets)["summarize_calls"] / r(nothing)["summarize_calls"]
    pair = f"{ratio:.2f}× the row above, {same_commit(r(forgets), r(nothing))}"
    standard = "every type ≥ 95 % (issue 25)"
    rows = [
        retention_row(r, "retention-standard-offline.json", standard, STANDARD),
        retention_row(r, "retention-standard-scripted-worst.json", standard, STANDARD),
        retention_row(r, nothing, "every type 100 % (issue 38)", EVERY),
        retention_row(
            r,
            forgets,
            "every type 100 %, ≤ 1.1× the calls of the row above (issue 38)",
            EVERY,
            also=(nothing, pair, ratio <= 1.1),
        ),
        retention_row(
            r, "retention-guard-worst.json", "every type 100 %, 0 folds failed (issue 38)", EVERY
        ),
        retention_row(
            r,
            "retention-pinned.json",
            "every pinned canary kept after every round",
            EVERY,
            every_round=True,
        ),
    ]
    note = retention_note(r, [row.files[0] for row in rows]) + (
        " The standard sessions plant 15 canaries (3 of each type), each with an unguessable "
        "value; the scripted stand-in is a script that follows the prompt "
        "(`bench/scripted_model.py`), not a model."
    )
    return Section("Retention", note, [Table(RETENTION_HEADERS, rows)])


def retention_note(r: Results, names: list[str]) -> str:
    runs = sorted({f"{r(n)['seeds']} seeds, {r(n)['rounds']} rounds" for n in names})
    return (
        f"{'; '.join(runs)}, in process (SQLite); kept after the last round, `sliding-window` (the "
        f"default) / the peers' bound (`{RETENTION_BOUND}`); a run's calls and folds are over both."
    )


def crowded_section(r: Results) -> Section:
    text = "standing types ≥ 95 %, facts ≥ 90 % (issue 37)"
    names = [f"retention-crowded-{kind}.json" for kind in ("offline", "scripted", "scripted-worst")]
    rows = [retention_row(r, name, text, CROWDED) for name in names]
    note = retention_note(r, names) + (
        " The crowded sessions plant more than fits the summary's cap beside details that carry "
        "values; a standing item counts as kept only with every one of its key phrases."
    )
    return Section("Retention when the cap bites", note, [Table(RETENTION_HEADERS, rows)])


def speed_section(r: Results) -> Section:
    t = r("turn_overhead.json")
    ratio, short, long = t["ratio_long_to_short"], t["at_10_messages"], t["at_history"]
    rows = [
        goal(
            f"turn overhead at message {t['history_messages']:,} ≤ 1.1× message 10, p50 and p99 "
            "(issue 6)",
            f"p50 {ratio['p50']:.3f}×, p99 {ratio['p99']:.3f}×",
            max(ratio["p50"], ratio["p99"]) <= 1.1,
            "turn_overhead.json",
        ),
        goal(
            "p50 turn overhead ≤ 15 ms, one client (issue 6)",
            f"{short['p50_ms']:.2f} ms at message 10, {long['p50_ms']:.2f} ms at "
            f"{t['history_messages']:,}",
            max(short["p50_ms"], long["p50_ms"]) <= 15,
            "turn_overhead.json",
        ),
    ]
    for name in ("throughput.json", "throughput_fake_server.json"):
        d = r(name)
        chatmem, proxy, floor = d["chatmem"], d["proxy"], d["floor"]
        tps = chatmem["turns_per_second_median"]
        model = "model in process" if d["model"] == "offline" else f"model: {d['model']}"
        ratio_to_proxy = tps / proxy["turns_per_second_median"]
        floor_ratio = floor["turns_per_second_median"] / proxy["turns_per_second_median"]
        rounds = ", ".join(num(x) for x in chatmem["turns_per_second_rounds"])
        rows += [
            goal(
                f"≥ 150 turns/s at concurrency {d['concurrency']}, {model} (issue 6)",
                f"{num(tps)} (rounds {rounds}), {chatmem['errors']} errors",
                tps >= 150,
                name,
            ),
            goal(
                f"≥ 0.5× a stateless proxy's turns/s, {model} (issue 6)",
                f"{ratio_to_proxy:.3f} (proxy {num(proxy['turns_per_second_median'])}); a turn "
                f"that only stores its messages: {floor_ratio:.3f}",
                ratio_to_proxy >= 0.5,
                name,
            ),
        ]
        if d["model"] == "offline":
            rows.append(
                goal(
                    f"p50 latency ≤ 15 ms at concurrency {d['concurrency']}, {model} (issue 6)",
                    f"{chatmem['p50_ms']:.1f} ms (p99 {chatmem['p99_ms']:.1f} ms)",
                    chatmem["p50_ms"] <= 15,
                    name,
                    note=f"{d['concurrency']} turns in flight queue",
                )
            )
    for name in ("slow_model_gevent.json", "slow_model.json"):
        d = r(name)
        worker = re.search(r"--worker-class (\S+)", d["server"])
        scene = f"{d['clients']} clients, model {d['model_latency_s']:g} s, "
        scene += worker.group(1) if worker else d["server"]
        others = f"; stateless proxy {num(d['stateless_proxy']['turns_per_second'])}"
        if "floor" in d:
            others += (
                f", a turn that only stores its messages {num(d['floor']['turns_per_second'])}"
            )
        c = d["consolidation"]
        rows += [
            goal(
                f"{scene}: ≥ 360 turns/s for {d['seconds']:g} s (issue 6)",
                f"{num(d['turns_per_second'])} turns/s{others}",
                d["turns_per_second"] >= 360,
                name,
            ),
            goal(
                f"{scene}: no errors, no synchronous fold, consolidation lag p95 < 5 s (issue 6)",
                f"{d['errors']} errors, {c['synchronous_folds']} synchronous, lag p95 "
                f"{c['lag_p95_s']:.2f} s over {c['folds_committed']:,} folds",
                d["errors"] == c["synchronous_folds"] == 0 and c["lag_p95_s"] < 5,
                name,
            ),
        ]
    for name in ("streams_spread.json", "streams.json"):
        d = r(name)
        overhead = d["first_token_overhead"]
        rows.append(
            goal(
                f"{d['streams']} streams arriving {d['arrivals']}, model {d['model_latency_s']:g} "
                "s: p99 first-token overhead < 100 ms (issue 5)",
                f"p99 {overhead['p99_ms']:,.1f} ms (p50 {overhead['p50_ms']:,.1f}); "
                f"{d['completed']} completed, {d['errors']} errors, "
                f"{d['most_open_at_once']} open at once",
                overhead["p99_ms"] < 100 and d["completed"] == d["streams"] and d["errors"] == 0,
                name,
            )
        )
    m, cmp = r("model_call.json"), r("compare.json")
    direct, sdk = m["cpu_ms_per_call_median"]["direct"], m["cpu_ms_per_call_median"]["sdk"]
    rows += [
        goal(
            f"CPU per model call, {m['threads']} threads, model {m['model_latency_s']:g} s",
            f"direct {direct:.3f} ms, through the `openai` SDK {sdk:.3f} ms ({sdk / direct:.2f}×)",
            None,
            "model_call.json",
        ),
        goal(
            f"a turn's cost, {cmp['head']} against {cmp['base']} in one interleaved run",
            f"{cmp['head_over_base_cpu_median']:.3f} of the CPU, "
            f"{cmp['head_over_base_wall_median']:.3f} of the wall time per turn",
            None,
            "compare.json",
        ),
    ]
    note = (
        "Turn overhead: the real API in process on PostgreSQL, offline model. Throughput: gunicorn "
        "(2 × 8 threads), 16 clients, against a stateless proxy and a turn that only stores its "
        "messages on the same server, no worker (chats fold synchronously at their bound). Slow "
        "model: everything as deployed on the 2 cores, 2 Celery workers folding."
    )
    caveats = {
        "slow_model.json": "counted before 2322afa stopped counting turns still in flight when "
        "the window closed, so its turns/s is a little high"
    }
    return Section("Throughput and latency", note, [Table(GOAL, rows)], caveats)


def faults_section(r: Results) -> Section:
    w, k, chaos = r("workers.json"), r("kill_recovery.json"), r("chaos-deployed.json")
    memory = w["memory"]
    change = memory["rss_kib_at_end"] / memory["rss_kib_after_500_folds"] - 1
    seconds, p = k["seconds_to_commit"], chaos["parameters"]
    rows = [
        goal(
            "2 workers ≥ 1.7× 1 worker, folds/s (issue 6)",
            f"{w['scaling']:.2f} (rounds {', '.join(f'{x:.3f}' for x in w['scaling_per_round'])}); "
            f"{num(w['one_worker_folds_per_second_median'])} → "
            f"{num(w['two_workers_folds_per_second_median'])}",
            w["scaling"] >= 1.7,
            "workers.json",
        ),
        goal(
            f"worker RSS flat ±10 % over {memory['folds']:,} folds (issue 6)",
            f"{change * 100:+.1f} % ({memory['rss_kib_after_500_folds']:,} → "
            f"{memory['rss_kib_at_end']:,} KiB)",
            abs(change) <= 0.10,
            "workers.json",
        ),
        goal(
            "a worker killed mid-fold: another commits the chat's fold within 60 s, over 20 "
            "kills, no failure counted (issue 29)",
            f"{k['within_60_s']} of {k['kills']} (median {seconds['median']:.1f} s, p90 "
            f"{seconds['p90']:.1f} s, max {seconds['max']:.1f} s); {k['failures_counted']} "
            f"failures, {k['degraded_chats']} degraded, {k['violations']} violations",
            k["kills"] >= 20
            and k["within_60_s"] == k["kills"]
            and k["failures_counted"] == k["degraded_chats"] == k["violations"] == 0,
            "kill_recovery.json",
        ),
        goal(
            f"as deployed, {p['chats']} chats × {p['turns']} turns, a worker killed every "
            f"{p['kill_every']:g} s, {p['fault_rate']:.0%} of summarize calls failing: 0 turns "
            "failed, 0 violations, every chat folded, none degraded, within 120 s after the faults "
            "stop (issues 29, 38)",
            f"{chaos['turns_acknowledged']:,} of {chaos['turns_sent']:,} acknowledged, "
            f"{chaos['kills']} kills, {chaos['violations']} violations; converged "
            f"{chaos['seconds_to_converge_after_faults_stopped']:.1f} s after",
            chaos["turns_acknowledged"] == chaos["turns_sent"]
            and chaos["violations"] == 0
            and chaos["converged"]
            and chaos["seconds_to_converge_after_faults_stopped"] <= 120,
            "chaos-deployed.json",
        ),
    ]
    stall = r("stalled_redis_default_interval.json")
    healthy, stalled = stall["healthy"], stall["stalled"]
    refused = sum(stalled["not_201"].values()) + sum(healthy["not_201"].values())
    rows.append(
        goal(
            "a Redis that accepts and never answers: turn p99 within 300 ms of healthy (issue 27)",
            f"stalled {stalled['p99_ms']:.1f} ms, healthy {healthy['p99_ms']:.1f} ms "
            f"({stall['p99_difference_ms']:+.1f} ms); {stalled['turns']} turns each, {refused} "
            "not 201",
            stall["p99_difference_ms"] <= 300 and refused == 0,
            "stalled_redis_default_interval.json",
        )
    )
    for name, interval in (
        ("stalled_redis_default_interval.json", "the default 60 s"),
        ("stalled_redis_interval5.json", "a 5 s"),
    ):
        d = r(name)
        rows.append(
            goal(
                f"every chat due folds within two sweep intervals after Redis recovers, "
                f"{interval} interval (issue 27)",
                f"{d['chats_with_fold_due_at_recovery']} of {d['chats']} chats due, folded "
                f"{d['seconds_to_fold_all_after_recovery']:.1f} s after (two intervals: "
                f"{d['two_sweep_intervals_s']:g} s)",
                d["all_folded"]
                and d["seconds_to_fold_all_after_recovery"] <= d["two_sweep_intervals_s"],
                name,
            )
        )
    return Section("Workers and faults", "", [Table(GOAL, rows)])


def local_model_section(r: Results) -> Section:
    d = r("local_model_run.json")
    refused = sum(v for k, v in d["folds_by_status_and_trigger"].items() if k.startswith("failed"))
    largest = max((v["tokens"] for v in d["verdicts"]), default=0)
    turns = d["turns_ok"] + d["turns_failed"]
    row = goal(
        f"llama.cpp serving SmolLM2-135M, {turns} turns, small fold window: 0 turns failed, no "
        "fold over its cap or past its deadline, every committed summary valid (issue 30)",
        f"{d['turns_ok']} of {turns} turns; {d['summaries_valid']} of "
        f"{d['summary_versions_committed']} summaries valid, {d['folds_over_cap']} over the cap of "
        f"{d['summary_cap']} (largest {largest}), {d['folds_past_deadline']} past the "
        f"{d['fold_deadline_seconds']:g} s deadline (longest {d['fold_seconds_max']:.1f} s); "
        f"{refused} model outputs refused, the offline fallback folded",
        d["turns_failed"] == d["folds_over_cap"] == d["folds_past_deadline"] == 0
        and d["summaries_valid"] == d["summaries_validated"] == d["summary_versions_committed"],
        "local_model_run.json",
    )
    note = (
        'CPU only, on the same 2 cores; set-up in docs/operations.md ("Integration run with '
        'llama.cpp"), with `MEMORY_SUMMARIZER_FALLBACK=offline`.'
    )
    return Section("A real local model server", note, [Table(GOAL, [row])])


TESTS = [
    "schemathesis, two users, stateful phase, ≥ 2,000 cases, 0 server errors (issue 27): "
    "`tests/test_schemathesis.py`",
    "web, worker and sweep processes with clocks ±5 min apart: no slot stolen, no live fold "
    "abandoned (issue 27): `tests/test_host_clocks.py`",
    "1,000 deletions racing failing folds, every one completes (issue 27): "
    "`CHATMEM_DELETION_RACES=1000 python -m pytest tests/test_deletion_races.py -k racing`",
    "a turn's and a fold's query count constant in history length (issue 6): "
    "`tests/test_query_counts.py`",
    "tokens counted for a model with no tokenizer (issue 30): `python -m bench.token_margin` "
    "prints its table and writes no results file",
]


# --- the page ----------------------------------------------------------------------------------


def cells(values: list[str]) -> str:
    return "| " + " | ".join(value.replace("|", "\\|") for value in values) + " |"


def wrap(text: str) -> list[str]:
    return textwrap.wrap(text, width=100, break_long_words=False, break_on_hyphens=False)


def render_section(r: Results, section: Section, common: str) -> list[str]:
    lines = [f"## {section.title}", ""]
    if section.note:
        lines += [*wrap(section.note), ""]
    files: list[str] = []
    for table in section.tables:
        lines += [
            cells([*table.headers, "date", "file"]),
            cells(["---"] * (len(table.headers) + 2)),
        ]
        for row in table.rows:
            dates = "; ".join(dict.fromkeys(r(name)["date"] for name in row.files))
            named = ", ".join(f"`{name}`" for name in row.files)
            lines.append(cells([*row.cells, dates, named]))
            files += [name for name in row.files if name not in files]
        lines.append("")
    lines.append("Commands, each writing the file it names:")
    lines.append("")
    for name in files:
        doc = r(name)
        about = [doc.get("code", {}).get("commit", "")]
        about += [machine(doc)] if machine(doc) != common else []
        about += [section.caveats[name]] if name in section.caveats else []
        detail = "; ".join(part for part in about if part)
        lines.append(f"- `{name}`: `{command(doc, name)}`" + (f" ({detail})" if detail else ""))
    return [*lines, ""]


def render(results_dir: Path) -> str:
    """The page, from the results files in results_dir."""
    r = Results(results_dir)
    builders = (
        topology_section,
        cache_section,
        retention_section,
        crowded_section,
        speed_section,
        faults_section,
        local_model_section,
    )
    sections = [build(r) for build in builders]
    used = list(r.docs)
    machines = Counter(machine(r(name)) for name in used)
    common, count = machines.most_common(1)[0]
    dates = sorted(r(name)["date"] for name in used)
    header = [
        "# Benchmarks",
        "",
        "<!-- Written by `python -m bench.report` from bench/results/*.json: rerun a benchmark or "
        "edit bench/report.py, not this file. -->",
        "",
        *wrap(
            "The current figure for each of chatmem's measured goals, read from the results file "
            "its benchmark wrote (`bench/results/*.json`), with a verdict computed against the "
            "goal's threshold and the date of the run. `python -m bench.report` writes this page "
            "and `python -m bench.report --check` fails when the page differs from the files "
            "(tests/test_bench_report.py checks it). Under each table, the command that wrote "
            "each file, as the file records it with `--out` naming the file: rerun it to "
            "reproduce the row's figure, then regenerate the page."
        ),
        "",
        *wrap(
            f"Machine, as each file records it: {common} for {count} of the {len(used)} files "
            "named here (the others say so beside their command); 24 GiB of memory, which the "
            "files do not record. The machine's speed drifted by up to about 40 % over a day, so "
            "compare ratios taken within one run, not absolute figures across runs or rows. "
            f"Runs from {dates[0]} to {dates[-1]}. History (earlier runs, how each figure moved, "
            "corrections) is in git: `git log -p docs/benchmarks.md` and "
            "`git log -p bench/results/`."
        ),
        "",
    ]
    lines = header
    for section in sections:
        lines += render_section(r, section, common)
    lines += ["## Measured by tests, not by a results file", ""]
    lines += [f"- {line}" for line in TESTS] + [""]
    others = sorted(p.name for p in results_dir.glob("*.json") if p.name not in r.docs)
    lines += ["## Other results files", ""]
    lines += wrap(
        "Earlier runs and side measurements, not on this page (what they showed is in this "
        "page's git history): " + ", ".join(f"`{name}`" for name in others) + "."
    )
    return "\n".join(lines) + "\n"


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(
        prog="python -m bench.report",
        description="Write docs/benchmarks.md from bench/results/*.json.",
    )
    parser.add_argument("--check", action="store_true", help="exit 1 if the page is out of date")
    parser.add_argument("--results", type=Path, default=RESULTS_DIR, help="the results files")
    parser.add_argument("--page", type=Path, default=PAGE, help="the page to write or check")
    args = parser.parse_args(argv)
    try:
        text = render(args.results)
    except (ReportError, KeyError, TypeError, ValueError, ZeroDivisionError) as error:
        print(
            f"bench.report: cannot build the page from {args.results}: {error!r}", file=sys.stderr
        )
        return 2
    if args.check:
        current = args.page.read_text(encoding="utf-8") if args.page.exists() else ""
        if current != text:
            print(
                f"{args.page} is not what `python -m bench.report` writes from {args.results}: "
                "run it and commit the page",
                file=sys.stderr,
            )
            return 1
        return 0
    args.page.write_text(text, encoding="utf-8")
    print(f"wrote {args.page}: {text.count(chr(10))} lines")
    return 0


if __name__ == "__main__":
    sys.exit(main())
