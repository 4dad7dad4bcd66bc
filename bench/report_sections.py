"""The sections of docs/benchmarks.md: each reads its results files and computes each row's figure
and verdict against its goal (bench.report_goals)."""

from __future__ import annotations

import re

from bench.report_goals import (
    CROWDED,
    EVERY,
    GOAL,
    GOALS,
    PEERS_BOUND,
    RETENTION_BOUND,
    STANDARD,
    TYPES,
    Doc,
    ReportError,
    Results,
    Row,
    Section,
    goal,
    label,
    num,
    pct,
    same_commit,
    short,
    verdict,
)

# --- the sections ------------------------------------------------------------------------------


def topology_section(r: Results) -> Section:
    topo, slow, pads = "topology-cache.json", "topology_slow.json", "topology-guard-pads.json"
    every: list[Doc] = r[topo]["results"]
    b = r.config(topo, PEERS_BOUND)
    sync = max(every, key=lambda c: c["sync_fold_turns_pct"])
    superseded = max(c["folds"]["superseded_pct"] for c in every)
    keys = ("turns_stored", "turns_sent", "drop_without_fold", "newest_not_verbatim")
    stored, sent, drops, newest = (sum(c[key] for c in every) for key in keys)
    over = sum(c["over_bound_turns"] for c in every)
    amp = {c: r.config(topo, c)["amplification"] for c in (PEERS_BOUND, "sliding-window")}
    missed = " and ".join(short(c) for c, value in amp.items() if value > 1.15)
    s, p, padded = r.config(slow), r.config(pads, PEERS_BOUND), r[pads]["results"]
    repairs = sum(c["guard_repair_calls"] for c in padded)
    folds, failed = (sum(c["folds"][key] for c in padded) for key in ("attempts", "failed"))
    most = max(c["guard_repair_pct_of_folds"] for c in padded)
    sync_pct, s_sync = sync["sync_fold_turns_pct"], s["sync_fold_turns_pct"]
    s_sup, verbatim = s["folds"]["superseded_pct"], b["verbatim_tokens_mean"]
    m_amp = ", ".join(f"{label(c)} {value:.3f}" for c, value in amp.items())
    m_sync = f"at most {sync_pct:.2f} % ({short(sync['config'])})" if sync_pct else "none"
    m_sup = f"at most {superseded:.2f} %" if superseded else "none"
    m_stored = f"{stored:,} of {sent:,} stored; {drops} dropped, {newest} not verbatim, {over} over"
    m_slow = f"{s_sync:.1f} % synchronous, {s_sup:.1f} % superseded, {s['over_bound_turns']} over"
    m_pads = f"{repairs} repairs in {folds:,} folds (at most {most:.1f} %), {failed} failed; "
    m_pads += f"{num(p['calls_per_100_turns'])} calls, {p['amplification']:.3f}x"
    ok_pads = most <= 2 and failed == 0 and p["calls_per_100_turns"] <= 18
    rows = [
        goal("calls", num(b["calls_per_100_turns"]), b["calls_per_100_turns"] <= 16, topo),
        goal("input", f"{b['amplification']:.3f}x", b["amplification"] <= 1.20, topo),
        goal("amplification", m_amp, not missed, topo, note=f"at {missed}" if missed else ""),
        goal("sync", m_sync, sync_pct <= 1, topo),
        goal("superseded", m_sup, superseded <= 1, topo),
        goal("stored", m_stored, stored == sent and drops == newest == over == 0, topo),
        goal("verbatim", num(verbatim, 0), verbatim >= 2000, topo),
        goal("slow", m_slow, max(s_sync, s_sup) <= 1 and s["over_bound_turns"] == 0, slow),
        goal("pads", m_pads, ok_pads and p["amplification"] <= 1.20, pads),
    ]
    note = (
        f"{every[0]['chats']} chats x {r[topo]['workload']['turns_per_chat']} turns at once per "
        "configuration over HTTP: gunicorn, `celery worker` processes, PostgreSQL, Redis, the fake "
        "model server; instant model, a summarizer that pads to its cap. The peers' bound is "
        f"`{PEERS_BOUND}`: `token-budget` at 4,500 tokens with a 500-token summary. "
        "Amplification: all summarizer input over the conversation's tokens."
    )
    return Section("Memory cost on the deployed topology", note, [(GOAL, rows)])


def cache_section(r: Results) -> Section:
    topo, default = "topology-cache.json", "topology-cache-default.json"
    hosted, peers = "topology-cache-hosted.json", "peers-cache.json"
    every: list[Doc] = r[topo]["results"]
    w = max(every, key=lambda c: c["cache_miss_turns"] / c["folds"]["succeeded"])
    ok_miss = all(c["cache_miss_turns"] <= c["folds"]["succeeded"] for c in every)
    base, h = r.config(topo, "sliding-window"), r.config(hosted)
    billed = h["billed_input_per_turn"] / base["billed_input_per_turn"]
    calls = (h["calls_per_100_turns"], base["calls_per_100_turns"])
    pair = same_commit(r[hosted], r[topo])
    m_miss = f"closest: {label(w['config'])}, {w['cache_miss_turns']:,} turns, "
    m_miss += f"{w['folds']['succeeded']:,} folds"
    m_billed = f"{num(h['billed_input_per_turn'], 0)} against "
    m_billed += f"{num(base['billed_input_per_turn'], 0)} tokens: {billed:.2f}x ({pair})"
    m_calls = "{:.2f} against {:.2f}".format(*calls) + f" ({pair})"
    rows = [goal("misses", m_miss, ok_miss, topo)]
    for name in (topo, default):
        share = r.config(name, "sliding-window")["cached_share_between_folds"]
        rows.append(goal("between", pct(share), share >= 0.95, name))
    rows += [
        goal("hosted", pct(h["cached_share"]), h["cached_share"] >= 0.9, hosted, knobs=knobs(h)),
        goal("billed", m_billed, billed <= 0.8, hosted, topo),
        goal("hosted calls", m_calls, calls[0] <= calls[1], hosted, topo),
    ]
    configs = [Row(config_cells(label(c["config"]), c), (topo,)) for c in every]
    for name in (default, hosted, "topology-cache-hosted16.json"):
        c = r.config(name)
        title = ", ".join([f"`{c['preset']}`", *([knobs(c)] if c["overrides"] else [])])
        configs.append(Row(config_cells(title, c), (name,)))
    configs += [Row(config_cells(p["peer"], p), (peers,)) for p in r[peers]["results"]]
    headers = ["configuration", "calls / 100 turns"]
    headers += ["cacheable: OpenAI's rule / exact / between folds", "billed input / turn"]
    headers += ["prompt tokens, mean", "drops without a fold", "turns without their own message"]
    note = (
        "Cacheable: the share of prompt tokens in the prefix each turn's prompt shares with the "
        "chat's previous one, as OpenAI's rule caches it (from 1,024 tokens, in steps of 128), "
        "exactly, and over the turns between folds. Billed input counts a cached token at 0.1. "
        "The peers (`python -m bench.peers`: their own libraries, unit-level, in one process) "
        "play the same chats at the peers' bound."
    )
    return Section("Prompt cache", note, [(GOAL, rows), (headers, configs)])


def knobs(c: Doc) -> str:
    return ", ".join(f"{key} {value}" for key, value in c["overrides"].items())


def config_cells(name: str, c: Doc) -> list[str]:
    between = c.get("cached_share_between_folds")
    shares = [pct(c["cached_share"]), pct(c["cached_share_exact"])]
    shares.append("—" if between is None else pct(between))
    drops = c.get("drop_without_fold", c.get("dropped_without_fold"))
    counts = [num(c["billed_input_per_turn"], 0), num(c["prompt_tokens_mean"], 0)]
    counts += [f"{drops:,}", f"{c['newest_not_verbatim']:,}"]
    return [name, num(c["calls_per_100_turns"]), " / ".join(shares), *counts]


RETENTION = ["sessions: summarizer", "goal", *TYPES[:3], "goal state", "preference"]
RETENTION += ["summarize calls (repairs)", "folds (failed)", "verdict"]


def retention_row(
    r: Results,
    name: str,
    key: str,
    thresholds: dict[str, float],
    every_round: bool = False,
    also: tuple[str, str, bool] | None = None,
) -> Row:
    """Kept after the last round (or every round), `sliding-window` / the peers' bound; `also`:
    one more file, a note on the calls and one more condition of the verdict."""
    doc = r[name]
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
    calls, folds, files = f"{doc['summarize_calls']:,}", "—", [name]
    if "guard_repair_calls" in doc:
        calls += f" ({doc['guard_repair_calls']:,})"
    if "folds" in doc:
        failed = sum(doc["folds"]["failed_by_kind"].values())
        folds, ok = f"{doc['folds']['succeeded']:,} ({failed})", ok and failed == 0
    if also is not None:
        files, calls, ok = [name, also[0]], f"{calls}; {also[1]}", ok and also[2]
    kept = [" / ".join(pct(c["kept"][t][-1]) for c in configs) for t in TYPES]
    who = f"{doc.get('sessions', 'standard')}: {doc['summarizer']}"
    return Row([who, GOALS[key], *kept, calls, folds, verdict(ok)], tuple(files))


def retention_note(r: Results, rows: list[Row], sessions: str) -> str:
    runs = {f"{r[row.files[0]]['seeds']} seeds, {r[row.files[0]]['rounds']} rounds" for row in rows}
    return (
        f"{'; '.join(sorted(runs))}, in process (SQLite). Kept after the last round, "
        f"`sliding-window` (the default) / the peers' bound (`{RETENTION_BOUND}`); calls and folds "
        f"count both. {sessions} The scripted stand-in is a script that follows the prompt "
        "(`bench/scripted_model.py`), not a model."
    )


def retention_sections(r: Results) -> list[Section]:
    forgets, nothing = "retention-guard-forgets-0.2.json", "retention-guard-forgets-0.json"
    ratio = r[forgets]["summarize_calls"] / r[nothing]["summarize_calls"]
    pair = f"{ratio:.2f}x the row above, {same_commit(r[forgets], r[nothing])}"
    rows = [
        retention_row(r, "retention-standard-offline.json", "standard", STANDARD),
        retention_row(r, "retention-standard-scripted-worst.json", "standard", STANDARD),
        retention_row(r, nothing, "guard", EVERY),
        retention_row(r, forgets, "forgets", EVERY, also=(nothing, pair, ratio <= 1.1)),
        retention_row(r, "retention-guard-worst.json", "worst", EVERY),
        retention_row(r, "retention-pinned.json", "pinned", EVERY, every_round=True),
    ]
    kinds = ("offline", "scripted", "scripted-worst")
    crowded = [retention_row(r, f"retention-crowded-{k}.json", "crowded", CROWDED) for k in kinds]
    standard = "Each session plants 15 canaries, 3 of each type, with unguessable values."
    more = (
        "The crowded sessions plant more than fits the summary's cap, beside details with values."
    )
    return [
        Section("Retention", retention_note(r, rows, standard), [(RETENTION, rows)]),
        Section(
            "Retention when the cap bites", retention_note(r, crowded, more), [(RETENTION, crowded)]
        ),
    ]


def speed_section(r: Results) -> Section:
    over = "turn_overhead.json"
    t = r[over]
    ratio, history = t["ratio_long_to_short"], f"{t['history_messages']:,}"
    p50s = (t["at_10_messages"]["p50_ms"], t["at_history"]["p50_ms"])
    m_flat = f"p50 {ratio['p50']:.3f}x, p99 {ratio['p99']:.3f}x"
    m_p50 = f"{p50s[0]:.2f} ms at message 10, {p50s[1]:.2f} ms at message {history}"
    rows = [
        goal("flat", m_flat, max(ratio["p50"], ratio["p99"]) <= 1.1, over, history=history),
        goal("overhead", m_p50, max(p50s) <= 15, over),
    ]
    for name in ("throughput.json", "throughput_fake_server.json"):
        d = r[name]
        c, proxy, floor = d["chatmem"], d["proxy"], d["floor"]
        fill = {"concurrency": d["concurrency"], "model": f"model: {d['model']}"}
        tps, proxy_tps = c["turns_per_second_median"], proxy["turns_per_second_median"]
        rounds = ", ".join(num(x) for x in c["turns_per_second_rounds"])
        m_tps = f"{num(tps)} (rounds {rounds}), {c['errors']} errors"
        m_proxy = f"{tps / proxy_tps:.3f} (proxy {num(proxy_tps)}); a turn that only stores its "
        m_proxy += f"messages: {floor['turns_per_second_median'] / proxy_tps:.3f}"
        rows.append(goal("150", m_tps, tps >= 150, name, **fill))
        rows.append(goal("proxy", m_proxy, tps / proxy_tps >= 0.5, name, **fill))
        if d["model"] == "offline":
            m_lat, queue = f"{c['p50_ms']:.1f} ms (p99 {c['p99_ms']:.1f} ms)", "in flight queue"
            queued = f"{d['concurrency']} turns {queue}"
            rows.append(goal("p50", m_lat, c["p50_ms"] <= 15, name, note=queued, **fill))
    for name in ("slow_model_gevent.json", "slow_model.json"):
        d = r[name]
        c, tps, proxy_tps = d["consolidation"], d["turns_per_second"], d["stateless_proxy"]
        worker = re.search(r"--worker-class (\S+)", d["server"])
        fill = {"worker": worker.group(1) if worker else d["server"]}
        m_tps = f"{num(tps)} turns/s; stateless proxy {num(proxy_tps['turns_per_second'])}"
        if "floor" in d:
            m_tps += f", a turn that only stores its messages {num(d['floor']['turns_per_second'])}"
        m_lag = f"{d['errors']} errors, {c['synchronous_folds']} synchronous, lag p95 "
        m_lag += f"{c['lag_p95_s']:.2f} s over {c['folds_committed']:,} folds"
        ok_lag = d["errors"] == c["synchronous_folds"] == 0 and c["lag_p95_s"] < 5
        rows.append(goal("360", m_tps, tps >= 360, name, **fill))
        rows.append(goal("lag", m_lag, ok_lag, name, **fill))
    for name in ("streams_spread.json", "streams.json"):
        d = r[name]
        first, done = d["first_token_overhead"], d["completed"] == d["streams"] and d["errors"] == 0
        m = f"p99 {num(first['p99_ms'])} ms (p50 {num(first['p50_ms'])}); {d['completed']} "
        m += f"completed, {d['errors']} errors, {d['most_open_at_once']} open at once"
        ok = first["p99_ms"] < 100 and done
        rows.append(goal("streams", m, ok, name, arrivals=d["arrivals"]))
    m, cmp = r["model_call.json"]["cpu_ms_per_call_median"], r["compare.json"]
    m_call = f"direct {m['direct']:.3f} ms, through the `openai` SDK {m['sdk']:.3f} ms "
    m_call += f"({m['sdk'] / m['direct']:.2f}x)"
    m_cmp = f"{cmp['head_over_base_cpu_median']:.3f} of the CPU, "
    m_cmp += f"{cmp['head_over_base_wall_median']:.3f} of the wall time per turn"
    rows.append(goal("model call", m_call, None, "model_call.json"))
    rows.append(goal("compare", m_cmp, None, "compare.json", head=cmp["head"], base=cmp["base"]))
    note = (
        "Turn overhead: the real API in process on PostgreSQL, offline model. Throughput: gunicorn "
        "(2 processes x 8 threads) serving chatmem, a stateless proxy and a turn that only stores "
        "its messages, no worker (a chat folds synchronously at its bound). Slow model: as "
        "deployed, 2 Celery workers folding. All on the same 2 cores."
    )
    caveat = "counted before 2322afa stopped counting the turns still in flight when the window "
    caveats = {"slow_model.json": caveat + "closed, so its turns/s is a little high"}
    return Section("Throughput and latency", note, [(GOAL, rows)], caveats)


def faults_section(r: Results) -> Section:
    w, k, chaos = r["workers.json"], r["kill_recovery.json"], r["chaos-deployed.json"]
    rss, secs = w["memory"], k["seconds_to_commit"]
    change = rss["rss_kib_at_end"] / rss["rss_kib_after_500_folds"] - 1
    rounds = ", ".join(f"{x:.3f}" for x in w["scaling_per_round"])
    m_workers = f"{w['scaling']:.2f} (rounds {rounds}); "
    m_workers += f"{num(w['one_worker_folds_per_second_median'])} → "
    m_workers += f"{num(w['two_workers_folds_per_second_median'])} folds/s"
    m_rss = f"{change * 100:+.1f} % ({rss['rss_kib_after_500_folds']:,} → "
    m_rss += f"{rss['rss_kib_at_end']:,} KiB over {rss['folds']:,} folds)"
    m_kill = f"{k['within_60_s']} of {k['kills']} (median {secs['median']:.1f} s, p90 "
    m_kill += f"{secs['p90']:.1f} s, max {secs['max']:.1f} s); {k['failures_counted']} failures, "
    m_kill += f"{k['degraded_chats']} degraded, {k['violations']} violations"
    ok_kill = k["kills"] >= 20 and k["within_60_s"] == k["kills"]
    ok_kill = ok_kill and k["failures_counted"] == k["degraded_chats"] == k["violations"] == 0
    after, converged = chaos["seconds_to_converge_after_faults_stopped"], chaos["converged"]
    m_chaos = f"{chaos['turns_acknowledged']:,} of {chaos['turns_sent']:,} acknowledged, "
    m_chaos += f"{chaos['kills']} kills, {chaos['violations']} violations; "
    m_chaos += f"converged {after:.1f} s after" if converged else "not converged"
    ok_chaos = chaos["turns_acknowledged"] == chaos["turns_sent"] and chaos["violations"] == 0
    st = r["stalled_redis_default_interval.json"]
    healthy, stalled = st["healthy"], st["stalled"]
    refused = sum(stalled["not_201"].values()) + sum(healthy["not_201"].values())
    m_stall = f"stalled {stalled['p99_ms']:.1f} ms, healthy {healthy['p99_ms']:.1f} ms "
    m_stall += f"({st['p99_difference_ms']:+.1f} ms); {refused} turns not 201"
    ok_stall = st["p99_difference_ms"] <= 300 and refused == 0
    rows = [
        goal("workers", m_workers, w["scaling"] >= 1.7, "workers.json"),
        goal("rss", m_rss, abs(change) <= 0.10 and rss["folds"] >= 10_000, "workers.json"),
        goal("kill", m_kill, ok_kill, "kill_recovery.json"),
        goal("chaos", m_chaos, ok_chaos and converged and after <= 120, "chaos-deployed.json"),
        goal("stall", m_stall, ok_stall, "stalled_redis_default_interval.json"),
    ]
    intervals = {"stalled_redis_default_interval.json": "60 s (the default)"}
    for name, interval in {**intervals, "stalled_redis_interval5.json": "5 s"}.items():
        d = r[name]
        took, limit = d["seconds_to_fold_all_after_recovery"], d["two_sweep_intervals_s"]
        m = f"{d['chats_with_fold_due_at_recovery']} of {d['chats']} chats due, folded "
        m += f"{took:.1f} s after (two intervals: {limit:g} s)"
        ok = d["all_folded"] and took <= limit
        rows.append(goal("recovery", m, ok, name, interval=interval))
    return Section("Workers and faults", "", [(GOAL, rows)])


def local_model_section(r: Results) -> Section:
    d = r["local_model_run.json"]
    refused = sum(v for k, v in d["folds_by_status_and_trigger"].items() if k.startswith("failed"))
    largest = max((v["tokens"] for v in d["verdicts"]), default=0)
    m = f"{d['turns_ok']} of {d['turns_ok'] + d['turns_failed']} turns; {d['summaries_valid']} of "
    m += f"{d['summary_versions_committed']} summaries valid, {d['folds_over_cap']} over the cap "
    m += f"of {d['summary_cap']} (largest {largest}), {d['folds_past_deadline']} past the "
    m += f"{d['fold_deadline_seconds']:g} s deadline (longest {d['fold_seconds_max']:.1f} s); "
    m += f"{refused} model outputs refused, the offline fallback folded"
    ok = d["turns_failed"] == d["folds_over_cap"] == d["folds_past_deadline"] == 0
    ok = ok and d["summaries_valid"] == d["summaries_validated"] == d["summary_versions_committed"]
    note = 'CPU only, on the same 2 cores; set up as docs/operations.md ("Integration run with '
    note += 'llama.cpp") says, with `MEMORY_SUMMARIZER_FALLBACK=offline`.'
    rows = [goal("local", m, ok, "local_model_run.json")]
    return Section("A real local model server", note, [(GOAL, rows)])


def admin_pages_section(r: Results) -> Section:
    d = r["admin_pages.json"]
    timeline, fleet = d["timeline"], d["fleet"]
    m = f"{timeline['median_ms']:,.1f} ms, {timeline['svg_bytes']:,} bytes ({timeline['folds']} "
    m += "folds drawn)"
    ok = timeline["median_ms"] < 1000 and timeline["svg_bytes"] < 300_000
    rows = [goal("timeline", m, ok, "admin_pages.json", turns=timeline["turns"])]
    index = "index" if "consolidation_finished" in fleet["window_plan"] else "no index"
    m = f"{fleet['median_ms']:,.1f} ms (a day's counts read through the {index} on finished_at)"
    rows.append(
        goal("fleet", m, fleet["median_ms"] < 300, "admin_pages.json", rows=fleet["ledger_rows"])
    )
    note = "PostgreSQL, in process: the admin's own code without HTTP, medians of "
    note += f"{d['repeats']} after a warm-up; rows written with generate_series."
    return Section("The admin's memory pages", note, [(GOAL, rows)])
