"""The presets' knobs read numbers as every other setting does (docs/operations.md: "1e3" is 1000
for an integer setting too): MEMORY_TAIL_KEEP_SIZE=1e3 stopped start-up."""

from __future__ import annotations

import re

import environ
import pytest

from memory_worker.env_knobs import preset_env_overrides


def overrides_from(monkeypatch: pytest.MonkeyPatch, **variables: str) -> dict:
    for name, value in variables.items():
        monkeypatch.setenv(name, value)
    return preset_env_overrides(environ.Env())


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
    from chatmem_project import settings

    refused = re.escape("MEMORY_SWEEP_BATCH must be an integer, got '2.5'")
    with pytest.raises(Exception, match=refused), pytest.MonkeyPatch.context() as patch:
        patch.setenv("MEMORY_SWEEP_BATCH", "2.5")
        settings.env_int("MEMORY_SWEEP_BATCH", 500)
