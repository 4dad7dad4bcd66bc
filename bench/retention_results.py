"""The retention benchmark's record of a session and its report (bench.retention): the share
of each canary type kept after each round, where the kept ones were, and the goals."""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from dataclasses import asdict, dataclass, field
from typing import Any

from bench.retention_workload import CANARY_TYPES, Canary

GOAL_KEPT = 0.95
PINNED_SUFFIX = "/canaries-pinned"


@dataclass(frozen=True)
class Config:
    name: str
    preset: str
    overrides: dict[str, int] = field(default_factory=dict)
    pinned: bool = False  # each canary's message pinned as it is sent


@dataclass
class Session:
    config: str
    seed: int
    canaries: list[Canary]
    # kept[round - 1][i]: where canary i was after that round ("summary", "verbatim", "both",
    # or "" when lost).
    kept: list[list[str]] = field(default_factory=list)
    round_turns: list[int] = field(default_factory=list)
    complete_rounds: int = 0
    turns: int = 0
    failed_turns: int = 0
    refused_pins: int = 0
    folds: int = 0
    final_summary_tokens: int = 0
    seconds: float = 0.0


def kept_fractions(sessions: Sequence[Session], rounds: int) -> dict[str, list[float | None]]:
    """Per canary type, the share kept after each round over every session and canary (None:
    no session reached that round)."""
    fractions: dict[str, list[float | None]] = {}
    for kind in CANARY_TYPES:
        row: list[float | None] = []
        for index in range(rounds):
            outcomes = [
                bool(where)
                for session in sessions
                if index < len(session.kept)
                for canary, where in zip(session.canaries, session.kept[index], strict=True)
                if canary.kind == kind
            ]
            row.append(sum(outcomes) / len(outcomes) if outcomes else None)
        fractions[kind] = row
    return fractions


def where_counts(sessions: Sequence[Session], round_index: int) -> dict[str, int]:
    counts = {"summary": 0, "verbatim": 0, "both": 0, "pinned": 0, "lost": 0}
    for session in sessions:
        if round_index < len(session.kept):
            for where in session.kept[round_index]:
                counts[where or "lost"] += 1
    return counts


def config_result(config: Config, sessions: Sequence[Session], rounds: int) -> dict[str, Any]:
    return {
        "config": config.name,
        "preset": config.preset,
        "overrides": config.overrides,
        "kept": kept_fractions(sessions, rounds),
        "where_after_last_round": where_counts(sessions, rounds - 1),
        "incomplete_sessions": sum(1 for s in sessions if s.complete_rounds < rounds),
        "turns_mean": round(sum(s.turns for s in sessions) / len(sessions), 1),
        "failed_turns": sum(s.failed_turns for s in sessions),
        "refused_pins": sum(s.refused_pins for s in sessions),
        "folds_mean": round(sum(s.folds for s in sessions) / len(sessions), 1),
        "seconds": round(sum(s.seconds for s in sessions), 1),
        "sessions": [session_record(s) for s in sessions],
    }


def session_record(session: Session) -> dict[str, Any]:
    return {
        "seed": session.seed,
        "turns": session.turns,
        "round_turns": session.round_turns,
        "complete_rounds": session.complete_rounds,
        "failed_turns": session.failed_turns,
        "refused_pins": session.refused_pins,
        "folds": session.folds,
        "final_summary_tokens": session.final_summary_tokens,
        "canaries": [
            {**asdict(canary), "kept": [kept[i] for kept in session.kept]}
            for i, canary in enumerate(session.canaries)
        ],
    }


def percent(value: float | None) -> str:
    return "n/a" if value is None else f"{100 * value:.0f} %"


def last_known(row: Sequence[float | None]) -> float | None:
    return row[-1] if row else None


def markdown_table(results: Sequence[dict[str, Any]]) -> str:
    header = ["configuration", *CANARY_TYPES]
    lines = [
        "| " + " | ".join(header) + " |",
        "|" + "|".join(["---"] + ["---:"] * len(CANARY_TYPES)) + "|",
    ]
    for result in results:
        cells = [
            f"{percent(result['kept'][kind][0])} → {percent(last_known(result['kept'][kind]))}"
            for kind in CANARY_TYPES
        ]
        lines.append("| " + " | ".join([f"`{result['config']}`", *cells]) + " |")
    return "\n".join(lines)


def check_goals(
    results: Sequence[dict[str, Any]],
    rounds: int,
    goal_configs: Sequence[str],
    thresholds: Mapping[str, float],
) -> list[dict[str, Any]]:
    """Each type at least its threshold after the last round, at each goal configuration run."""
    goals = []
    for result in results:
        if result["config"].endswith(PINNED_SUFFIX):
            goals.append(pinned_goal(result))
        if result["config"] not in goal_configs:
            continue
        final = {kind: last_known(result["kept"][kind]) for kind in CANARY_TYPES}
        short = {
            kind: value
            for kind, value in final.items()
            if value is None or value < thresholds.get(kind, GOAL_KEPT)
        }
        worst = min((v for v in final.values() if v is not None), default=0.0)
        wanted = ", ".join(
            f"{kind} ≥ {thresholds.get(kind, GOAL_KEPT):.0%}" for kind in CANARY_TYPES
        )
        goals.append(
            {
                "config": result["config"],
                "goal": f"{wanted} after {rounds} rounds",
                "worst": worst,
                "short": {kind: value for kind, value in short.items()},
                "met": not short and result["incomplete_sessions"] == 0,
            }
        )
    return goals


def pinned_goal(result: dict[str, Any]) -> dict[str, Any]:
    """Every pinned canary in the context after every round, every pin taken."""
    every_round = [v for kind in CANARY_TYPES for v in result["kept"][kind]]
    worst = min((v for v in every_round if v is not None), default=0.0)
    met = (
        all(v == 1.0 for v in every_round)
        and result["incomplete_sessions"] == 0
        and result["refused_pins"] == 0
    )
    return {
        "config": result["config"],
        "goal": "every pinned canary kept after every round",
        "worst": worst,
        "met": met,
    }


def goal_lines(goals: Sequence[dict[str, Any]]) -> list[str]:
    if not goals:
        return ["(no goal configuration selected)"]
    return [
        f"{'✓' if goal['met'] else '✗'} `{goal['config']}`: {goal['goal']} "
        f"(lowest {percent(goal['worst'])})"
        for goal in goals
    ]
