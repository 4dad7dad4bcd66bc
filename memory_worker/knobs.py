"""Operator-level defaults for the presets' knobs, from the environment: the knobs of
sliding-window and chunked (and turn-digest's FULL_DETAIL_TURNS), under the names their
requirements give them (docs/policies.md). Unset variables leave the preset's default.

Read once, when the app is ready (memory_worker.apps), and validated with ``resolve_policy``
then, so a bad value stops start-up with the reason instead of failing the first turn. The
settings do not read them: they load without importing the engine."""

from functools import cache
from typing import Any

import environ

from chatmem_project.env import read_number
from memory_worker.engine.presets import PRESETS, PolicyError, resolve_policy

# environment variable -> (preset, knob)
ENV_KNOBS: dict[str, tuple[str, str]] = {
    # sliding-window
    "MEMORY_CONTEXT_SIZE": ("sliding-window", "context_size"),
    "MEMORY_TAIL_KEEP_SIZE": ("sliding-window", "tail_messages"),
    "MEMORY_COMPRESSION_WINDOW_SIZE": ("sliding-window", "window"),
    "MEMORY_COMPRESSION_COOLDOWN_SEC": ("sliding-window", "cooldown_seconds"),
    "MEMORY_COMPRESSION_HARD_LIMIT": ("sliding-window", "hard_limit"),
    # chunked
    "MEMORY_K_RAW_TURNS": ("chunked", "tail_turns"),
    "MEMORY_CHUNK_SUMMARIZE_THRESHOLD": ("chunked", "chunk_threshold"),
    # turn-digest
    "FULL_DETAIL_TURNS": ("turn-digest", "tail_turns"),
}
FLOAT_KNOBS = {"cooldown_seconds"}
# chunked's prompt memory budget is the headroom above the chunk threshold (docs/policies.md)
PROMPT_BUDGET_VARIABLE = "MEMORY_PROMPT_TOKEN_BUDGET"
DEFAULT_PROMPT_BUDGET = 3000
# the summarizer's cap is every preset's summary cap
SUMMARY_CAP_VARIABLE = "MEMORY_SUMMARY_TOKEN_CAP"
# every preset's headroom below its bounds: sized for the deployment's summarizer against its
# turns (docs/policies.md)
HEADROOM_VARIABLE = "MEMORY_HEADROOM_TURNS"


def _raw(env: Any, variable: str) -> str:
    """Empty or blank means unset, as for every other setting."""
    return str(env.str(variable, default="")).strip()


def preset_env_overrides(env: Any) -> dict[str, dict[str, object]]:
    overrides: dict[str, dict[str, object]] = {name: {} for name in PRESETS}
    for variable, (preset, knob) in ENV_KNOBS.items():
        raw = _raw(env, variable)
        if raw:
            overrides[preset][knob] = read_number(
                variable, raw, float if knob in FLOAT_KNOBS else int
            )
    budget = _raw(env, PROMPT_BUDGET_VARIABLE)
    if budget or "chunk_threshold" in overrides["chunked"]:
        threshold = overrides["chunked"].get("chunk_threshold", PRESETS["chunked"].chunk_threshold)
        headroom = (
            read_number(PROMPT_BUDGET_VARIABLE, budget, int) if budget else DEFAULT_PROMPT_BUDGET
        )
        assert isinstance(threshold, int)
        overrides["chunked"]["max_memory_tokens"] = threshold + int(headroom)
    for variable, knob in (
        (SUMMARY_CAP_VARIABLE, "summary_token_cap"),
        (HEADROOM_VARIABLE, "headroom_turns"),
    ):
        raw = _raw(env, variable)
        if raw:
            for knobs in overrides.values():
                knobs[knob] = read_number(variable, raw, int)
    for preset, knobs in overrides.items():
        try:
            resolve_policy(preset, knobs)
        except PolicyError as error:
            raise ValueError(f"Memory settings for preset {preset!r}: {error}") from error
    return {preset: knobs for preset, knobs in overrides.items() if knobs}


@cache
def operator_overrides() -> dict[str, dict[str, object]]:
    """The environment's knobs per preset, read once per process."""
    return preset_env_overrides(environ.Env())
