"""Operators set the seeds' knobs with environment variables (seed 001, seed 003 §10)."""

import environ
import pytest

from memory_worker.env_knobs import preset_env_overrides
from memory_worker.presets import resolve_policy


def overrides_from(
    monkeypatch: pytest.MonkeyPatch, **variables: str
) -> dict[str, dict[str, object]]:
    for name, value in variables.items():
        monkeypatch.setenv(name, value)
    return preset_env_overrides(environ.Env())


def test_unset_environment_keeps_the_seed_defaults(monkeypatch: pytest.MonkeyPatch) -> None:
    for name in ("MEMORY_TAIL_KEEP_SIZE", "MEMORY_K_RAW_TURNS", "MEMORY_PROMPT_TOKEN_BUDGET"):
        monkeypatch.delenv(name, raising=False)
    monkeypatch.delenv("MEMORY_SUMMARY_TOKEN_CAP", raising=False)
    monkeypatch.delenv("MEMORY_HEADROOM_TURNS", raising=False)
    assert overrides_from(monkeypatch) == {}


def test_the_headroom_is_every_presets(monkeypatch: pytest.MonkeyPatch) -> None:
    """Sized for the deployment's summarizer, not for one seed: a summarizer slower than the
    turns needs room for more of them below every bound."""
    found = overrides_from(monkeypatch, MEMORY_HEADROOM_TURNS="3")
    assert {name: knobs["headroom_turns"] for name, knobs in found.items()} == dict.fromkeys(
        ("contract", "sliding-window", "token-budget", "chunked", "turn-digest"), 3
    )
    monkeypatch.setenv("MEMORY_HEADROOM_TURNS", "0")
    with pytest.raises(ValueError, match='Knob "headroom_turns" must be at least 1'):
        overrides_from(monkeypatch)


def test_seed_001_and_003_knobs(monkeypatch: pytest.MonkeyPatch) -> None:
    found = overrides_from(
        monkeypatch,
        MEMORY_CONTEXT_SIZE="60",
        MEMORY_TAIL_KEEP_SIZE="20",
        MEMORY_COMPRESSION_WINDOW_SIZE="8",
        MEMORY_COMPRESSION_COOLDOWN_SEC="300",
        MEMORY_COMPRESSION_HARD_LIMIT="25",
        MEMORY_K_RAW_TURNS="4",
        MEMORY_CHUNK_SUMMARIZE_THRESHOLD="5000",
        MEMORY_PROMPT_TOKEN_BUDGET="2500",
        MEMORY_SUMMARY_TOKEN_CAP="400",
    )
    window = resolve_policy("sliding-window", found["sliding-window"])
    assert (window.context_size, window.tail_messages, window.window) == (60, 20, 8)
    assert (window.cooldown_seconds, window.hard_limit, window.summary_token_cap) == (
        300.0,
        25,
        400,
    )
    chunked = resolve_policy("chunked", found["chunked"])
    assert (chunked.tail_turns, chunked.chunk_threshold, chunked.max_memory_tokens) == (
        4,
        5000,
        7500,
    )


def test_bad_values_stop_start_up_with_the_reason(monkeypatch: pytest.MonkeyPatch) -> None:
    with pytest.raises(ValueError, match="MEMORY_K_RAW_TURNS must be an integer"):
        overrides_from(monkeypatch, MEMORY_K_RAW_TURNS="three")
    monkeypatch.delenv("MEMORY_K_RAW_TURNS")
    with pytest.raises(ValueError, match=r"tail_messages .* must be less than context_size"):
        overrides_from(monkeypatch, MEMORY_TAIL_KEEP_SIZE="80")
