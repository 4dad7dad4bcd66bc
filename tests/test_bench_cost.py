"""The cost benchmark (bench/cost.py): its measurements can fail, and a short run stays clean.

The short run uses the benchmark's own SQLite database in a subprocess (it sets up Django itself),
so it needs no service."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path
from typing import Any

from bench import cost
from memory_worker.summaries.contract import FoldMessage, format_fold_input
from tests.support.fake_openai import RecordedRequest

ROOT = Path(__file__).resolve().parent.parent


def chat_request(number: int, *tags: str) -> RecordedRequest:
    messages = [{"role": "system", "content": "You are helpful."}]
    messages += [{"role": "user", "content": f"{tag} words"} for tag in tags]
    return RecordedRequest(
        "chat", "/v1/chat/completions", {"messages": messages}, {}, 0.0, None, number
    )


def summarize_request(number: int, *tags: str) -> RecordedRequest:
    messages = [FoldMessage(seq, "user", f"{tag} words") for seq, tag in enumerate(tags, 1)]
    source = format_fold_input("", messages)
    body = {"messages": [{"role": "user", "content": source}]}
    return RecordedRequest("summarize", "/v1/chat/completions", body, {}, 0.0, None, number)


def run_of(records: list[RecordedRequest], served: list[int]) -> cost.Run:
    config = cost.BenchConfig("unit", "contract")
    return cost.Run(config, 1, records, served, [], "", [], [], 0.0)


def test_a_message_that_leaves_the_context_unfolded_is_a_drop() -> None:
    # Turn 1's user message is in request 1, then missing from request 2 with no summarize
    # request carrying it before: one drop (the reply tags are never shown, so they count too).
    records = [chat_request(1, "[t1u]"), chat_request(2, "[t2u]")]
    stored = {"[t1u]": 0, "[t2u]": 1}
    assert cost.drops_without_fold(run_of(records, [1, 2]), stored) == 1


def test_a_message_folded_before_it_leaves_is_not_a_drop() -> None:
    records = [chat_request(1, "[t1u]"), summarize_request(1, "[t1u]"), chat_request(2, "[t2u]")]
    stored = {"[t1u]": 0, "[t2u]": 1}
    assert cost.drops_without_fold(run_of(records, [1, 2]), stored) == 0


def test_a_fold_after_the_message_left_is_still_a_drop() -> None:
    records = [chat_request(1, "[t1u]"), chat_request(2, "[t2u]"), summarize_request(1, "[t1u]")]
    stored = {"[t1u]": 0, "[t2u]": 1}
    assert cost.drops_without_fold(run_of(records, [1, 2]), stored) == 1


def test_workload_is_seeded_and_shaped_as_the_issue_asks() -> None:
    workload = cost.build_workload(70, seed=3)
    assert workload == cost.build_workload(70, seed=3)
    assert sum(1 for turn in workload if turn.fact) == 40
    for turn in workload:
        reply_words = len(turn.reply.split()) - 1  # the tag
        low, high = cost.DEEP_DIVE_WORDS if turn.number % 7 == 0 else cost.REPLY_WORDS
        assert low <= reply_words <= high


def test_a_calls_overhead_splits_into_instructions_existing_summary_and_format() -> None:
    summary = "## Decisions\n- ship on Friday"
    source = format_fold_input(summary, [FoldMessage(1, "user", "[t1u] words")])
    instructions = "Rewrite the summary."
    body = {
        "messages": [
            {"role": "system", "content": instructions},
            {"role": "user", "content": source},
        ]
    }
    record = RecordedRequest("summarize", "/v1/chat/completions", body, {}, 0.0, None, 1)
    assert cost.instructions_tokens(record) == cost.tokens(instructions)
    assert cost.existing_summary_tokens(record) == cost.tokens(summary)
    # The first fold's NONE is the format's, not a summary.
    assert cost.existing_summary_tokens(summarize_request(2, "[t1u]")) == 0
    assert cost.instructions_tokens(summarize_request(2, "[t1u]")) == 0


def run_bench(tmp_path: Path, *args: str) -> dict[str, Any]:
    out = tmp_path / "cost.json"
    command = [sys.executable, "-m", "bench.cost", *args, "--out", str(out)]
    finished = subprocess.run(command, cwd=ROOT, capture_output=True, text=True, timeout=300)
    assert finished.returncode == 0, finished.stderr[-3000:]
    report: dict[str, Any] = json.loads(out.read_text())
    return report


def test_short_run_loses_nothing_and_reports_goals(tmp_path: Path) -> None:
    report = run_bench(
        tmp_path, "--turns", "40", "--presets", "sliding-window,token-budget@4000+500/target=0"
    )
    results = {result["config"]: result for result in report["results"]}
    assert set(results) == {"sliding-window", "token-budget@4000+500/target=0"}
    for result in results.values():
        assert result["failed_turns"] == 0
        assert result["drop_without_fold"] == 0
        assert result["newest_not_verbatim"] == 0
        assert result["resent_folded"] == 0
    # 40 turns of ~500 tokens overflow the 4,500-token peer bound several times over.
    assert results["token-budget@4000+500/target=0"]["summarizer_calls"] >= 3
    assert results["token-budget@4000+500/target=0"]["prompt_tokens_max"] <= 4800
    assert {goal["goal"] for goal in report["goals"]} >= {"calls", "amplification", "drops"}
    for result in results.values():
        parts = (
            result["instructions_tokens_per_call"]
            + result["existing_summary_tokens_per_call"]
            + result["format_tokens_per_call"]
        )
        assert abs(parts - result["overhead_tokens_per_call"]) < 1e-6
        assert result["instructions_tokens_per_call"] > 0 and result["format_tokens_per_call"] > 0
        assert result["amplification_without_instructions"] < result["amplification"]
