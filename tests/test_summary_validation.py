"""What a summary must be before it is written (memory_worker.summaries.validation): chatmem's own
headings, no transcript of the folded turns, no echo of the summarizer's input, and no longer
than what it replaces. A refused summary is a "malformed" fold (the fast stricter retry).

No database and no Django: run with ``python -m pytest -p no:django
tests/test_summary_validation.py``.
"""

import pytest

from conversations.chat_model.tokens import count_tokens
from memory_worker.summaries.contract import FoldMessage, SummarizerError, format_fold_input
from memory_worker.summaries.offline import OfflineSummarizer
from memory_worker.summaries.validation import HEADINGS_ROOM, replaced_tokens, validate_summary

OLD_SUMMARY = """## Facts / Constraints
- The user's locker code is 4821.

## Goals / Preferences
- Wants to run a marathon in 2027.

## Decisions
- None

## Open Items
- None

## Key Artifacts
- None"""

FOLDED = [
    FoldMessage(7, "user", "Hi again! I moved to Porto last month, my new flat is number 12B."),
    FoldMessage(8, "assistant", "Welcome to Porto! Noted: flat 12B. How is the move going?"),
    FoldMessage(9, "user", "Fine. We decided to train on the Douro trail every Sunday at 7:00."),
    FoldMessage(10, "assistant", "Great plan: Sundays at 7:00 on the Douro trail."),
    FoldMessage(11, "user", "Can you remind me what shoes I should buy? Budget is 120 EUR."),
    FoldMessage(12, "assistant", "Look for a cushioned trail shoe under 120 EUR."),
]

MODEL_SUMMARY = """## Facts / Constraints
- The user's locker code is 4821.
- Lives in Porto, flat 12B.
- Shoe budget: 120 EUR.

## Goals / Preferences
- Wants to run a marathon in 2027.

## Decisions
- Train on the Douro trail every Sunday at 7:00.

## Open Items
- Choose cushioned trail shoes.

## Key Artifacts
- None"""

# The "summary": a transcript that passed as one (short lines ending in a colon).
TRANSCRIPT = """FULL_TURNS:
Turn 1:
User: My locker code is 4821.
Assistant: Noted, 4821.
Turn 2:
User: I moved to Porto."""


def validate(text: str, *, summary: str = OLD_SUMMARY, cap: int = 500) -> str:
    replaces = replaced_tokens(summary, FOLDED, None)
    return validate_summary(text, "stop", cap, None, headings=True, replaces=replaces)


def refusal_of(text: str, **kwargs: object) -> SummarizerError:
    with pytest.raises(SummarizerError) as caught:
        validate(text, **kwargs)  # type: ignore[arg-type]
    return caught.value


def test_a_well_formed_model_summary_is_accepted() -> None:
    assert validate(MODEL_SUMMARY) == MODEL_SUMMARY


def test_the_offline_summarizers_output_is_accepted() -> None:
    summary = OfflineSummarizer(cap_tokens=500).summarize(OLD_SUMMARY, FOLDED).text
    assert validate(summary) == summary


def test_the_offline_summary_of_a_first_short_fold_is_accepted() -> None:
    """The headings' own room: a two-message fold's summary may be longer than its input."""
    folded = FOLDED[:2]
    summary = OfflineSummarizer(cap_tokens=500).summarize("", folded).text
    replaces = replaced_tokens("", folded, None)
    assert validate_summary(summary, "stop", 500, None, headings=True, replaces=replaces)


@pytest.mark.parametrize(
    "text",
    [
        TRANSCRIPT,
        # Role lines under the right headings are still a transcript.
        "## Facts / Constraints\nUser: My locker code is 4821.\n## Decisions\nAssistant: Noted.",
        "## Facts / Constraints\n**User:** flat 12B\n## Decisions\n- None",
        "## Turn 1\n- locker 4821\n## Decisions\n- None",
        "## Facts / Constraints\n- flat 12B\n## Decisions\nTurn 3: trail on Sundays",
    ],
    ids=["the-issues-transcript", "role-lines", "bold-role", "turn-heading", "turn-line"],
)
def test_a_transcript_is_a_malformed_fold(text: str) -> None:
    error = refusal_of(text)
    assert (error.kind, error.transient) == ("malformed", False)
    assert "transcript" in str(error)


def test_an_echo_of_the_input_is_a_malformed_fold() -> None:
    assert refusal_of(format_fold_input(OLD_SUMMARY, FOLDED), cap=5000).kind == "malformed"


def test_an_echo_of_the_input_data_lines_under_our_headings_is_a_malformed_fold() -> None:
    data_lines = format_fold_input("", FOLDED).splitlines()[4:-1]  # the NEW_TURNS lines
    text = "## Facts / Constraints\n" + "\n".join(data_lines) + "\n## Decisions\n- None"
    assert refusal_of(text, cap=5000).kind == "malformed"


@pytest.mark.parametrize(
    "text",
    [
        "## Summary\n- Lives in Porto, flat 12B.\n## Notes\n- Trail on Sundays at 7:00.",
        "Here is what I found:\n- Lives in Porto.\nAlso:\n- Trail on Sundays.",
        "## Faits / Contraintes\n- Porto, 12B\n## Objectifs\n- marathon 2027",
        "## Facts / Constraints\n- Lives in Porto, flat 12B, locker 4821, budget 120 EUR.",
    ],
    ids=["other-headings", "colon-lines", "translated-headings", "one-heading"],
)
def test_a_text_without_two_of_our_headings_is_a_malformed_fold(text: str) -> None:
    error = refusal_of(text)
    assert error.kind == "malformed" and "of the five headings" in str(error)


def test_a_summary_longer_than_what_it_replaces_is_a_malformed_fold() -> None:
    padding = "\n".join(f"- Remember detail number {n} of the Porto move." for n in range(40))
    text = MODEL_SUMMARY.replace("- Shoe budget: 120 EUR.", f"- Shoe budget: 120 EUR.\n{padding}")
    replaces = replaced_tokens(OLD_SUMMARY, FOLDED, None)
    assert count_tokens(text) > replaces + HEADINGS_ROOM  # within the cap, over its input
    error = refusal_of(text, cap=2000)
    assert error.kind == "malformed" and "longer than" in str(error)


@pytest.mark.parametrize(
    "line",
    ["- User: prefers tea.", "- The user said: flat 12B.", "- Assistant reply style: brief."],
)
def test_a_bullet_that_names_a_role_is_a_summary_line(line: str) -> None:
    text = MODEL_SUMMARY.replace("- Choose cushioned trail shoes.", line)
    assert validate(text) == text


def test_without_the_input_the_length_is_not_checked() -> None:
    """The langgraph node and callers with no fold input: the other checks still apply."""
    long_text = MODEL_SUMMARY + "\n" + "\n".join(f"- detail {n}" for n in range(100))
    assert validate_summary(long_text, "stop", 2000, None, headings=True)
    with pytest.raises(SummarizerError):
        validate_summary(TRANSCRIPT, "stop", 2000, None)
