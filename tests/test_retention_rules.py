"""memory_worker.summaries.retention: what a summary keeps first, as every summarizer's guard and
the offline summarizer read it (docs/policies.md, "What the summary keeps first")."""

import pytest

from memory_worker.summaries.retention import (
    FACT,
    RULE,
    VALUE,
    WEAK,
    is_standing,
    rank,
    statements,
)


@pytest.mark.parametrize(
    "text",
    [
        "Report all distances in kilometres.",  # a unit to report in
        "If a user seems distressed, pause and offer help.",  # a conditional
        "Only PostgreSQL 15.",
        "No tracking cookies on the public site.",
        "Prices in euros, please.",
        "Stick to PostgreSQL.",
        "From now on, address me as Coach.",
        "I'd like answers without emoji.",
        "Prefers short bullet-point answers.",  # a summary's own note
        "Phase 2 of 4 is done.",
    ],
)
def test_standing_items_said_without_never_or_must_are_rules(text: str) -> None:
    assert is_standing(text) and rank(text) == RULE


@pytest.mark.parametrize(
    "text",
    [
        "Explain recursion.",  # a request for this turn, not a rule
        "Write a Python function that parses dates.",
        "Tell me a joke.",
        "Never mind, it works now.",
        "The nightly import took 41 minutes on Tuesday.",
        "Only 3 people came, sadly.",
    ],
)
def test_one_off_requests_and_small_talk_are_not_standing(text: str) -> None:
    assert not is_standing(text)
    assert rank(text) == WEAK


def test_facts_with_their_value_outrank_values_in_passing() -> None:
    assert rank("My locker number is 48211.") == FACT
    assert rank("Build QX-71B4 finished in 412 seconds.") == VALUE


def test_an_open_question_about_a_rule_is_guarded_like_one() -> None:
    assert rank("Does legal require a sign-off before launch?") == RULE
    assert not is_standing("Does legal require a sign-off before launch?")


def test_statements_join_a_rule_and_its_second_sentence_but_never_a_question_or_a_line() -> None:
    assert list(statements("Deploys need two approvals. Never deploy on a Friday.")) == [
        "Deploys need two approvals. Never deploy on a Friday."
    ]
    assert list(statements("Never deploy on Fridays. But what about hotfixes?")) == [
        "Never deploy on Fridays.",
        "But what about hotfixes?",
    ]
    rule_list = "\n".join(f"- Never deploy service {n} on a Friday." for n in range(32))
    assert len(list(statements(rule_list))) == 32  # a list of rules stays a list of items
    many = " ".join(f"Never touch table t{n}." for n in range(10))
    assert all(item.count(".") <= 3 for item in statements(many))
