"""Operators set the presets' knobs with environment variables (sliding-window, chunked;
docs/policies.md). The knobs read numbers as every other setting does (docs/operations.md: "1e3" is
1000 for an integer setting too)."""

import os
import re
import subprocess
import sys
from pathlib import Path
from typing import Any

import environ
import pytest

from chatmem_project import env as settings_env
from memory_worker import knobs
from memory_worker.engine.presets import resolve_policy
from memory_worker.folding.effective_policy import env_overrides
from memory_worker.knobs import preset_env_overrides


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


# Numbers: an integer knob is read as Python reads a number, and refused by name when it
# is not a whole one.


def test_an_integer_knob_may_be_written_as_python_reads_a_number(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    found = overrides_from(
        monkeypatch,
        MEMORY_CONTEXT_SIZE="1e2",
        MEMORY_TAIL_KEEP_SIZE="4e1",
        MEMORY_K_RAW_TURNS=" 4 ",
        MEMORY_PROMPT_TOKEN_BUDGET="2.5e3",
    )
    window = found["sliding-window"]
    assert (window["context_size"], window["tail_messages"]) == (100, 40)
    assert all(type(knob) is int for knob in (window["context_size"], window["tail_messages"]))
    assert found["chunked"]["tail_turns"] == 4
    assert found["chunked"]["max_memory_tokens"] == 6000 + 2500  # the default threshold + budget


def test_a_blank_knob_means_its_default(monkeypatch: pytest.MonkeyPatch) -> None:
    assert "tail_messages" not in overrides_from(monkeypatch, MEMORY_TAIL_KEEP_SIZE="  ").get(
        "sliding-window", {}
    )


@pytest.mark.parametrize(
    ("raw", "says"),
    [
        ("40.5", "MEMORY_TAIL_KEEP_SIZE must be an integer, got '40.5'"),
        ("nan", "MEMORY_TAIL_KEEP_SIZE must be an integer, got 'nan'"),
        ("forty", "MEMORY_TAIL_KEEP_SIZE must be an integer, got 'forty'"),
    ],
)
def test_what_is_not_a_whole_number_is_refused_by_name(
    monkeypatch: pytest.MonkeyPatch, raw: str, says: str
) -> None:
    with pytest.raises(ValueError) as refused:
        overrides_from(monkeypatch, MEMORY_TAIL_KEEP_SIZE=raw)
    assert says in str(refused.value)


def test_the_settings_read_numbers_the_same_way() -> None:
    refused = re.escape("MEMORY_SWEEP_BATCH must be an integer, got '2.5'")
    with pytest.raises(Exception, match=refused), pytest.MonkeyPatch.context() as patch:
        patch.setenv("MEMORY_SWEEP_BATCH", "2.5")
        settings_env.env_int("MEMORY_SWEEP_BATCH", 500)


# Where the knobs are read: once per process when the app is ready, not by the settings.

ROOT = Path(__file__).resolve().parent.parent


def test_the_settings_load_without_importing_memory() -> None:
    code = (
        "import sys, chatmem_project.settings\n"
        "loaded = sorted(m for m in sys.modules if m.split('.')[0] == 'memory_worker')\n"
        "assert not loaded, loaded\n"
    )
    subprocess.run([sys.executable, "-c", code], check=True, timeout=60, cwd=ROOT)


def test_a_bad_knob_stops_a_process_at_start_up_with_its_reason() -> None:
    environment = {**os.environ, "MEMORY_K_RAW_TURNS": "three"}
    checked = subprocess.run(
        [sys.executable, "manage.py", "check"],
        cwd=ROOT,
        env=environment,
        capture_output=True,
        text=True,
        timeout=120,
    )
    assert checked.returncode != 0
    assert "MEMORY_K_RAW_TURNS must be an integer, got 'three'" in checked.stderr


def test_a_chat_policy_takes_the_environments_knobs_unless_the_settings_give_them(
    monkeypatch: pytest.MonkeyPatch, settings: Any
) -> None:
    monkeypatch.setenv("MEMORY_CONTEXT_SIZE", "100")
    knobs.operator_overrides.cache_clear()
    try:
        settings.MEMORY_PRESET_ENV_OVERRIDES = None
        assert env_overrides("sliding-window") == {"context_size": 100}
        settings.MEMORY_PRESET_ENV_OVERRIDES = {"sliding-window": {"context_size": 60}}
        assert env_overrides("sliding-window") == {"context_size": 60}
    finally:
        knobs.operator_overrides.cache_clear()
