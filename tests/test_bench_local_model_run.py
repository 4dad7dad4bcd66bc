"""The local model run's verdicts (bench/local_model_run.py): each summary version through the
validator against what it replaced, and the ledger's folds against their cap and deadline."""

from __future__ import annotations

from typing import Any

from bench.local_model_run import summarize, validate_versions

WELL_FORMED = (
    "## Facts and constraints\n- The locker code is 4821.\n\n## Decisions\n- Meet on Friday."
)
TRANSCRIPT = "FULL_TURNS:\nTurn 1:\nUser: My locker code is 4821.\nAssistant: Noted."


def brief(version: int, summary: str, watermark: int) -> dict[str, Any]:
    return {
        "version": version,
        "summary": summary,
        "summary_tokens": 20,
        "last_consolidated": watermark,
        "fallback_since": None,
    }


MESSAGES = [
    {"seq": 1, "role": "user", "content": "My locker code is 4821, and we meet on Friday."},
    {"seq": 2, "role": "assistant", "content": "Noted: locker 4821, the meeting on Friday."},
    {"seq": 3, "role": "user", "content": "Also, the budget is 300 euros for the trip."},
    {"seq": 4, "role": "assistant", "content": "Got it, 300 euros is the trip's budget."},
]


def test_a_transcript_is_refused_and_a_summary_of_its_range_passes() -> None:
    versions = {0: brief(0, "", 0), 1: brief(1, WELL_FORMED, 2), 2: brief(2, TRANSCRIPT, 4)}
    verdicts = validate_versions(versions, MESSAGES, cap=256)
    assert verdicts[0]["verdict"] == "ok"
    assert verdicts[1]["verdict"].startswith("malformed")
    assert all(v["replaces_checked"] for v in verdicts)


def test_a_version_not_seen_before_is_validated_without_the_length_check() -> None:
    verdicts = validate_versions({0: brief(0, "", 0), 2: brief(2, WELL_FORMED, 4)}, MESSAGES, 256)
    assert verdicts == [
        {"version": 2, "tokens": 20, "fallback": False, "replaces_checked": False, "verdict": "ok"}
    ]


def ledger_row(status: str, tokens: int, ms: int | None, calls: int = 1) -> dict[str, Any]:
    return {
        "status": status,
        "trigger": "overflow",
        "summary_tokens_after": tokens,
        "duration_ms": ms,
        "summarizer_calls": calls,
        "error": "summary is 300 tokens, over the cap of 256" if status == "failed" else "",
    }


def test_folds_over_the_cap_or_past_the_deadline_are_counted() -> None:
    ledger = [
        ledger_row("succeeded", 200, 3000),
        ledger_row("succeeded", 300, 1000),
        ledger_row("failed", 0, 70_000),
        ledger_row("failed", 0, 70_000, calls=2),
        ledger_row("running", 0, None),
    ]
    figures = summarize(ledger, cap=256, deadline=60.0, verdicts=[])
    assert figures["folds_over_cap"] == 1
    assert figures["max_summary_tokens"] == 300
    assert figures["folds_past_deadline"] == 1
    assert figures["folds_by_status_and_trigger"] == {
        "succeeded/overflow": 2,
        "failed/overflow": 2,
        "running/overflow": 1,
    }
    assert figures["fold_seconds_max"] == 70.0
