"""Operator-level defaults for the presets' knobs, from the environment: every knob of seed 003
§10 and of seed 001, named as the seeds name them. Unset variables leave the seed's default.

Read once at settings load; the result is validated with ``resolve_policy`` there, so a bad value
stops start-up with the reason instead of failing the first turn."""

from typing import Any

from memory_worker.presets import PRESETS, PolicyError, resolve_policy

# environment variable -> (preset, knob)
ENV_KNOBS: dict[str, tuple[str, str]] = {
    # seed 001 — sliding-window
    "MEMORY_CONTEXT_SIZE": ("sliding-window", "context_size"),
    "MEMORY_TAIL_KEEP_SIZE": ("sliding-window", "tail_messages"),
    "MEMORY_COMPRESSION_WINDOW_SIZE": ("sliding-window", "window"),
    "MEMORY_COMPRESSION_COOLDOWN_SEC": ("sliding-window", "cooldown_seconds"),
    "MEMORY_COMPRESSION_HARD_LIMIT": ("sliding-window", "hard_limit"),
    # seed 003 §10 — chunked
    "MEMORY_K_RAW_TURNS": ("chunked", "tail_turns"),
    "MEMORY_CHUNK_SUMMARIZE_THRESHOLD": ("chunked", "chunk_threshold"),
    # seed 004 — turn-digest
    "FULL_DETAIL_TURNS": ("turn-digest", "tail_turns"),
}
FLOAT_KNOBS = {"cooldown_seconds"}
# seed 003's prompt memory budget is the headroom above the chunk threshold (docs/policies.md)
PROMPT_BUDGET_VARIABLE = "MEMORY_PROMPT_TOKEN_BUDGET"
DEFAULT_PROMPT_BUDGET = 3000
# the summarizer's cap is every preset's summary cap
SUMMARY_CAP_VARIABLE = "MEMORY_SUMMARY_TOKEN_CAP"


def _number(variable: str, raw: str, as_float: bool) -> int | float:
    try:
        return float(raw) if as_float else int(raw)
    except ValueError as error:
        kind = "number" if as_float else "integer"
        raise ValueError(f"{variable} must be an {kind}, got {raw!r}") from error


def preset_env_overrides(env: Any) -> dict[str, dict[str, object]]:
    overrides: dict[str, dict[str, object]] = {name: {} for name in PRESETS}
    for variable, (preset, knob) in ENV_KNOBS.items():
        raw = env.str(variable, default="")
        if raw:
            overrides[preset][knob] = _number(variable, raw, knob in FLOAT_KNOBS)
    budget = env.str(PROMPT_BUDGET_VARIABLE, default="")
    if budget or "chunk_threshold" in overrides["chunked"]:
        threshold = overrides["chunked"].get("chunk_threshold", PRESETS["chunked"].chunk_threshold)
        headroom = (
            _number(PROMPT_BUDGET_VARIABLE, budget, False) if budget else DEFAULT_PROMPT_BUDGET
        )
        assert isinstance(threshold, int)
        overrides["chunked"]["max_memory_tokens"] = threshold + int(headroom)
    cap = env.str(SUMMARY_CAP_VARIABLE, default="")
    if cap:
        for knobs in overrides.values():
            knobs["summary_token_cap"] = _number(SUMMARY_CAP_VARIABLE, cap, False)
    for preset, knobs in overrides.items():
        try:
            resolve_policy(preset, knobs)
        except PolicyError as error:
            raise ValueError(f"Memory settings for preset {preset!r}: {error}") from error
    return {preset: knobs for preset, knobs in overrides.items() if knobs}
