"""The retention benchmark (bench/retention.py): its canaries can only be found where they were
planted, its survival check reads values as whole tokens, and a short run stays clean.

The short run uses the benchmark's own SQLite database in a subprocess (it sets up Django itself),
so it needs no service."""

from __future__ import annotations

import json
import random
import re
import subprocess
import sys
from pathlib import Path
from typing import Any

from bench import retention, retention_crowded, retention_results, scripted_model
from bench import retention_workload as workload
from memory_worker.summaries.contract import (
    RETRY_TARGET_FACTOR,
    FoldMessage,
    format_fold_input,
    shorten_request,
    summary_instructions,
)
from memory_worker.summaries.validation import validate_summary

ROOT = Path(__file__).resolve().parent.parent


def test_canaries_are_seeded_typed_and_unique() -> None:
    canaries = workload.make_canaries(random.Random(4))
    assert canaries == workload.make_canaries(random.Random(4))
    assert canaries != workload.make_canaries(random.Random(5))
    kinds = [canary.kind for canary in canaries]
    for kind in workload.CANARY_TYPES:
        assert kinds.count(kind) == workload.CANARIES_PER_TYPE
    values = [canary.value for canary in canaries]
    assert len(set(values)) == len(values)
    for canary in canaries:
        assert workload.survives(canary, [canary.sentence])
        # No value is found inside another canary's sentence.
        others = [c.sentence for c in canaries if c is not canary]
        assert not workload.survives(canary, others)


def test_every_template_plants_a_value_the_check_finds() -> None:
    rng = random.Random(1)
    for kind, templates in workload.TEMPLATES.items():
        for template in templates:
            value = template.value(rng)
            canary = workload.Canary(kind, value, template.text.format(v=value))
            assert workload.survives(canary, [canary.sentence]), canary.sentence
            assert workload.survives(canary, [f"- {canary.sentence}"]), canary.sentence


def test_a_value_survives_only_as_a_whole_token() -> None:
    code = workload.Canary("safety", "VX-81Q2", "Never share the vault code VX-81Q2.")
    assert workload.survives(code, ["- Never share the vault code VX-81Q2."])
    assert workload.survives(code, ["code VX-81Q2, and"])
    assert not workload.survives(code, ["code VX-81Q"])
    assert not workload.survives(code, ["code AVX-81Q2"])
    assert not workload.survives(code, ["code VX-81Q2-B"])
    amount = workload.Canary("constraint", "3,417", "The budget must stay under 3,417 euros.")
    assert workload.survives(amount, ["under 3,417 euros"])
    assert workload.survives(amount, ["under 3,417."])
    assert not workload.survives(amount, ["under 13,417 euros"])
    assert not workload.survives(amount, ["under 3,4170 euros"])
    assert not workload.survives(amount, ["under 3,417,000 euros"])


def test_where_a_canary_was_kept() -> None:
    fact = workload.Canary("fact", "48213", "My locker number is 48213.")
    assert retention.where_kept(fact, "- My locker number is 48213.", "", ["hello"]) == "summary"
    assert retention.where_kept(fact, "", "", ["My locker number is 48213."]) == "verbatim"
    assert retention.where_kept(fact, "48213", "", ["48213"]) == "both"
    assert retention.where_kept(fact, "48213", "- user: locker 48213", ["48213"]) == "pinned"
    assert retention.where_kept(fact, "4821", "", ["48214"]) == ""


def test_chit_chat_never_looks_like_a_canary() -> None:
    rng = random.Random(9)
    for _ in range(500):
        text = workload.chit_chat(rng)
        assert text
        # Numbers of one or two digits only, and no code with a digit in it.
        assert not re.search(r"\d{3}", text), text
        assert not re.search(r"[A-Z]-\d", text), text


def test_planting_keeps_the_canary_sentence_whole() -> None:
    rng = random.Random(2)
    for canary in workload.make_canaries(rng):
        assert canary.sentence in workload.planting_message(canary, rng)


def test_kept_fractions_count_every_canary_of_a_type() -> None:
    canaries = [
        workload.Canary("safety", "AA-11B2", "a"),
        workload.Canary("safety", "BB-22C3", "b"),
        workload.Canary("fact", "12345", "c"),
    ]
    first = retention_results.Session("unit", 0, canaries, kept=[["summary", "", "both"]])
    second = retention_results.Session(
        "unit", 1, canaries, kept=[["verbatim", "summary", ""], ["", "", ""]]
    )
    fractions = retention_results.kept_fractions([first, second], rounds=3)
    assert fractions["safety"] == [0.75, 0.0, None]
    assert fractions["fact"] == [0.5, 0.0, None]
    assert fractions["goal"] == [None, None, None]


def run_bench(tmp_path: Path, *args: str) -> dict[str, Any]:
    out = tmp_path / "retention.json"
    command = [sys.executable, "-m", "bench.retention", *args, "--out", str(out)]
    finished = subprocess.run(command, cwd=ROOT, capture_output=True, text=True, timeout=300)
    assert finished.returncode == 0, finished.stderr[-3000:]
    report: dict[str, Any] = json.loads(out.read_text())
    return report


def test_short_run_completes_its_rounds_and_reports_per_type(tmp_path: Path) -> None:
    report = run_bench(tmp_path, "--seeds", "1", "--rounds", "2", "--presets", "turn-digest")
    (result,) = report["results"]
    assert result["config"] == "turn-digest"
    assert result["failed_turns"] == 0
    assert result["incomplete_sessions"] == 0
    assert result["folds_mean"] >= 2
    assert set(result["kept"]) == set(workload.CANARY_TYPES)
    for row in result["kept"].values():
        assert len(row) == 2
        assert all(value is not None and 0 <= value <= 1 for value in row)
    (session,) = result["sessions"]
    assert len(session["canaries"]) == len(workload.CANARY_TYPES) * workload.CANARIES_PER_TYPE
    assert all(len(canary["kept"]) == 2 for canary in session["canaries"])
    assert report["command"].startswith("python -m bench.retention")
    assert report["goals"] == []  # turn-digest is not a goal configuration


def test_pinned_canaries_are_in_the_context_after_every_round(tmp_path: Path) -> None:
    name = "sliding-window/canaries-pinned"
    report = run_bench(tmp_path, "--seeds", "1", "--rounds", "2", "--presets", name)
    (result,) = report["results"]
    assert result["refused_pins"] == 0 and result["incomplete_sessions"] == 0
    assert all(row == [1.0, 1.0] for row in result["kept"].values())
    canaries = result["sessions"][0]["canaries"]
    assert all(canary["kept"] == ["pinned", "pinned"] for canary in canaries)
    assert [goal["met"] for goal in report["goals"]] == [True]


def test_a_crowded_session_plants_more_than_fits_and_finds_each_item_by_all_its_phrases(
    tmp_path: Path,
) -> None:
    canaries = retention_crowded.make_crowded_canaries(random.Random("retention-0"))
    assert len(canaries) == len(workload.CANARY_TYPES) * retention_crowded.PER_TYPE
    two_part = next(c for c in canaries if c.also) if any(c.also for c in canaries) else None
    if two_part is not None:  # a rule or a task kept in half is lost
        assert not workload.survives(two_part, [two_part.value])
        assert workload.survives(two_part, [two_part.sentence.lower()])
    report = run_bench(
        tmp_path,
        "--sessions",
        "crowded",
        "--seeds",
        "1",
        "--rounds",
        "2",
        "--presets",
        "sliding-window",
    )
    (result,) = report["results"]
    assert report["sessions"] == "crowded"
    assert result["failed_turns"] == 0 and result["incomplete_sessions"] == 0
    (session,) = result["sessions"]
    # The cap bites: the summary is at its cap with the incidental details the rounds bring.
    assert session["final_summary_tokens"] >= 400
    (goal,) = report["goals"]
    assert "fact ≥ 90%" in goal["goal"] and "safety ≥ 95%" in goal["goal"]


def summarize_request(summary: str, messages: list[tuple[str, str]], *follow_up: str) -> Any:
    """A request body as chatmem's Chat Completions summarizer sends it."""
    source = format_fold_input(
        summary, [FoldMessage(n + 1, role, text) for n, (role, text) in enumerate(messages)]
    )
    conversation = [
        {"role": "system", "content": summary_instructions(300)},
        {"role": "user", "content": source},
    ]
    for index, text in enumerate(follow_up):
        conversation.append({"role": "assistant" if index % 2 == 0 else "user", "content": text})
    return {"model": "scripted-model", "messages": conversation}


def test_the_scripted_model_keeps_what_the_prompt_asks_and_no_chatter() -> None:
    model = scripted_model.ScriptedModel()
    summary = model(
        summarize_request(
            "",
            [
                ("user", "Anyway, never share the vault code VX-81Q2 with anyone."),
                ("user", "Sounds good. What do you think about houseplants?"),
                ("assistant", "Noted: the vault code VX-81Q2 stays private."),
                ("user", "I prefer replies in Portuguese, tag P-1234."),
            ],
        )
    )
    assert "- Never share the vault code VX-81Q2 with anyone." in summary
    assert "- I prefer replies in Portuguese, tag P-1234." in summary
    assert "houseplants" not in summary and "Noted" not in summary
    # A summary chatmem accepts as it is.
    assert validate_summary(summary, "stop", 300, "gpt-4o-mini", headings=True) == summary


def test_the_scripted_model_drops_the_least_durable_first_to_fit_a_shorten_request() -> None:
    model = scripted_model.ScriptedModel()
    rule = "The budget must stay under 3,417 euros."
    facts = [f"My locker number is {10000 + n}, in corridor {n}." for n in range(40)]
    messages = [("user", rule), *(("user", fact) for fact in facts)]
    draft = model(summarize_request("", messages))
    shorter = model(summarize_request("", messages, draft, shorten_request(900, 120)))
    assert scripted_model.approx_tokens(shorter) <= int(120 * RETRY_TARGET_FACTOR)
    assert rule in shorter and facts[0] not in shorter and facts[-1] in shorter


def test_a_forgetful_scripted_model_loses_old_bullets_but_not_on_a_repair_request() -> None:
    model = scripted_model.ScriptedModel(forget_rate=0.5)
    old = "\n".join(
        ["## Facts / Constraints", *(f"- Server {n} runs on port {8000 + n}." for n in range(20))]
    )
    body = summarize_request(old, [("user", "ok thanks")])
    lossy = model(body)
    assert 0 < sum(f"port {8000 + n}." in lossy for n in range(20)) < 20
    assert model(body) == lossy  # seeded by the request: a rerun forgets the same bullets
    repaired = model(summarize_request(old, [("user", "ok thanks")], lossy, "You dropped: 8003"))
    assert all(f"port {8000 + n}." in repaired for n in range(20))


def test_a_scripted_model_that_ignores_repairs_answers_them_with_the_same_losses() -> None:
    model = scripted_model.ScriptedModel(forget_rate=0.5, ignores_repairs=True)
    old = "\n".join(
        ["## Facts / Constraints", *(f"- Server {n} runs on port {8000 + n}." for n in range(20))]
    )
    body = summarize_request(old, [("user", "ok thanks")])
    lossy = model(body)
    assert (
        model(summarize_request(old, [("user", "ok thanks")], lossy, "You dropped: 8003")) == lossy
    )


def test_a_padding_scripted_model_fills_half_its_cap_with_prose() -> None:
    model = scripted_model.ScriptedModel(pads=True)
    messages = [("user", f"The budget for item {n} is at most {200 + n} EUR.") for n in range(30)]
    padded = model(summarize_request("", messages))
    prose = sum(padded.count(line) for line in scripted_model.PADDING)
    assert prose >= 4 and "at most 229 EUR" in padded and "at most 200 EUR" not in padded
    assert scripted_model.approx_tokens(padded) <= 500


def test_a_short_run_folds_through_the_scripted_model(tmp_path: Path) -> None:
    report = run_bench(
        tmp_path, "--seeds", "1", "--rounds", "2", "--presets", "sliding-window",
        "--summarizer", "scripted-model",
    )  # fmt: skip
    (result,) = report["results"]
    assert report["summarizer"] == "scripted-model"
    assert report["summarize_calls"] >= result["folds_mean"] >= 2
    assert result["failed_turns"] == 0 and result["incomplete_sessions"] == 0
