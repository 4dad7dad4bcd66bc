"""The fold guard (memory_worker.summaries.guard, memory_worker.summaries.guarded): a new summary
that drops a rule or an exact value of the old one, which no folded message changed, is refused,
repaired once, or fails; and the loss report lists what a fold's summary let go."""

from collections.abc import Sequence

import pytest
from hypothesis import given
from hypothesis import strategies as st

from conversations.chat_model.tokens import count_tokens
from memory_worker.summaries import guard as fold_guard
from memory_worker.summaries.contract import FoldMessage, SummaryResult
from memory_worker.summaries.guarded import summarize_guarded
from memory_worker.summaries.offline import OfflineSummarizer
from memory_worker.summaries.retention import is_rule_or_value

OLD = """## Facts / Constraints
- The door code is 4821.
- Never share the staging password with contractors.
- Budget is at most $4,000.
## Goals / Preferences
- Enjoys long walks.
## Decisions
- None
## Open Items
- None
## Key Artifacts
- https://example.com/specs/v2"""


def said(*texts: str) -> list[FoldMessage]:
    return [FoldMessage(seq, "user", text) for seq, text in enumerate(texts, start=1)]


def summary(*bullets: str) -> str:
    return "## Facts / Constraints\n" + "\n".join(f"- {b}" for b in bullets) + "\n## Decisions\n"


KEPT = summary(
    "Door code: 4821.",
    "Do not share the staging password with contractors.",
    "Budget at most $4000.",
    "Spec at https://example.com/specs/v2.",
)


def test_the_guard_refuses_a_summary_that_drops_a_constraints_value() -> None:
    new = KEPT.replace("Door code: 4821.", "There is a door code.")
    [loss] = fold_guard.losses(OLD, said("What time is lunch?"), new)
    assert (loss.line, loss.missing) == ("The door code is 4821.", ("4821",))
    assert "4821" in loss.describe()


def test_the_guard_refuses_a_summary_that_drops_a_rule_without_a_value() -> None:
    new = KEPT.replace("Do not share the staging password with contractors.", "Uses staging.")
    [loss] = fold_guard.losses(OLD, said("Hello again."), new)
    assert (loss.line, loss.missing) == (
        "Never share the staging password with contractors.",
        (),
    )


def test_the_guard_accepts_values_kept_verbatim_in_other_words() -> None:
    # Reworded, reordered, "$4,000" written "$4000": every value is there.
    assert fold_guard.losses(OLD, said("ok"), KEPT) == []


@pytest.mark.parametrize(
    "message",
    [
        "Forget the 4821 code, it was reset.",
        "The door code is no longer valid.",
        "New door code: 7730.",
        "Cancel the door thing.",
    ],
)
def test_the_guard_accepts_a_drop_a_folded_message_revoked(message: str) -> None:
    new = KEPT.replace("Door code: 4821.", "")
    assert fold_guard.losses(OLD, said("Unrelated chatter.", message), new) == []


def test_a_new_value_on_a_subject_that_only_shares_a_word_does_not_excuse_a_drop() -> None:
    old = "## Facts / Constraints\n- My locker number is 48213."
    messages = said("My flat is number 55120 on the long street.")
    [loss] = fold_guard.losses(old, messages, summary("Flat number 55120."))
    assert loss.missing == ("48213",)


def test_a_message_on_another_subject_does_not_excuse_a_drop() -> None:
    new = KEPT.replace("Budget at most $4000.", "")
    messages = said("Forget the lunch plans.", "The code review is at 15:30.")
    lost = fold_guard.losses(OLD, messages, new)
    assert [loss.missing for loss in lost] == [("$4,000",)]


def test_the_loss_report_lists_exactly_the_planted_values_a_summary_dropped() -> None:
    messages = said(
        "Ship order QX-7719 to warehouse 33 before 2031-04-02.",
        "The invoice: https://billing.example.com/inv/88213, the contact: ana@example.org.",
        "Keep `retry_max = 5` in config.yaml; we were 12 at lunch on the 3rd.",
    )
    new = summary(
        "Door code 4821; budget $4,000; staging password never shared.",
        "Order QX-7719 ships before 2031-04-02.",
        "Contact ana@example.org; config.yaml holds retry_max = 5.",
    )
    dropped = fold_guard.dropped_details(OLD, messages, new)
    # Small numbers ("33", "12") and ordinals ("3rd") are not exact details.
    assert dropped == ["https://example.com/specs/v2", "https://billing.example.com/inv/88213"]


@given(
    codes=st.lists(
        st.from_regex(r"[A-Z]{2}-[0-9]{4}", fullmatch=True), min_size=1, max_size=8, unique=True
    ),
    data=st.data(),
)
def test_the_loss_report_is_the_planted_codes_left_out(
    codes: list[str], data: st.DataObject
) -> None:
    kept = data.draw(st.lists(st.sampled_from(codes), unique=True))
    messages = said(*(f"Remember ticket {code} for the audit." for code in codes))
    new = summary(*(f"Ticket {code}." for code in kept))
    assert fold_guard.dropped_details("", messages, new) == [c for c in codes if c not in kept]


@given(st.text(max_size=400), st.text(max_size=200))
def test_a_summary_that_keeps_the_old_one_whole_loses_nothing(extra: str, message: str) -> None:
    assert fold_guard.losses(OLD, said(message), OLD + "\n" + extra) == []


class Scripted:
    """A summarizer answering from a list: a summary per call, the repair's included."""

    name = "scripted"

    def __init__(self, *texts: str) -> None:
        self.texts = list(texts)
        self.repairs: list[Sequence[str]] = []

    def summarize(self, current_summary: str, messages: Sequence[FoldMessage]) -> SummaryResult:
        return SummaryResult(self.texts.pop(0), 100, 10, self.name)

    def repair(
        self, current_summary: str, messages: Sequence[FoldMessage], draft: str, keep: Sequence[str]
    ) -> SummaryResult:
        self.repairs.append(keep)
        return SummaryResult(self.texts.pop(0), 150, 20, self.name)


DROPS_CODE = KEPT.replace("Door code: 4821.", "")
KEPT_BULLETS_BUT_CODE = [
    "Do not share the staging password with contractors.",
    "Budget at most $4000.",
    "Spec at https://example.com/specs/v2.",
]


def test_a_dropped_line_with_room_is_put_back_in_its_section_without_a_second_call() -> None:
    summarizer = Scripted(DROPS_CODE)
    guarded = summarize_guarded(summarizer, OLD, said("hello"))
    assert summarizer.repairs == []
    assert (guarded.repaired, guarded.repair_calls, guarded.result.calls) == (True, 0, 1)
    facts = guarded.result.text.split("## Decisions")[0]
    assert "- The door code is 4821." in facts
    assert fold_guard.losses(OLD, said("hello"), guarded.result.text) == []


def test_a_summarizer_that_cannot_repair_is_spliced_all_the_same() -> None:
    class Plain:
        name = "plain"

        def summarize(self, current_summary: str, messages: Sequence[FoldMessage]) -> SummaryResult:
            return SummaryResult(DROPS_CODE, 1, 1, self.name)

    guarded = summarize_guarded(Plain(), OLD, said("hello"))
    assert "4821" in guarded.result.text and guarded.result.calls == 1


PADDING = [
    f"We talked about {topic} for a while and it was pleasant enough."
    for topic in ("gardening", "the weather", "films", "holidays", "cooking", "music")
]


def test_a_draft_padded_to_its_cap_gives_up_its_padding_from_the_bottom_for_what_it_lost() -> None:
    padded = summary(*KEPT_BULLETS_BUT_CODE, *PADDING)
    cap = int(count_tokens(padded) / (1 - fold_guard.CAP_SLACK)) + 1
    assert fold_guard.losses(OLD, said("hi"), padded, cap)  # padding is room the code had
    guarded = summarize_guarded(Scripted(padded), OLD, said("hi"), cap)
    text = guarded.result.text
    assert "4821" in text and guarded.result.calls == 1
    assert count_tokens(text) <= int(cap * (1 - fold_guard.CAP_SLACK))
    assert PADDING[0] in text and PADDING[-1] not in text  # evicted last line first
    assert all(bullet in text for bullet in KEPT_BULLETS_BUT_CODE)


def rules_only(count: int, start: int = 0) -> str:
    return summary(*(f"Never use {SUBJECTS[n]} on {1000 + n}." for n in range(start, count)))


ZULU = "Never use zulu on 1025."


def room_for_one_more(draft: str, line: str) -> int:
    """The smallest cap whose usable part holds ``draft`` and ``line`` as one more bullet."""
    needed = count_tokens(draft) + count_tokens(f"- {line}\n") + fold_guard.ROOM_MARGIN + 1
    return next(cap for cap in range(needed, 2 * needed) if fold_guard.usable_tokens(cap) >= needed)


def test_when_the_cap_forces_a_choice_the_model_is_asked_once_and_the_best_summary_is_written():
    """Rules only: the draft drops two, each of which would fit, but not both. The splice puts
    back the first; the model is asked once to make room; a repair that ignores the request
    does not fail the fold: the splice's summary is written, and what the cap forced out is in
    the loss report."""
    old = rules_only(5)
    draft = rules_only(5, start=2) + f"\n- {ZULU}"  # drops alpha's and bravo's rules
    cap = room_for_one_more(draft, "Never use bravo on 1001.")
    assert len(fold_guard.losses(old, said(ZULU), draft, cap)) == 2
    summarizer = Scripted(draft, draft)  # the repair ignores the request
    guarded = summarize_guarded(summarizer, old, said(ZULU), cap)
    assert summarizer.repairs == [["Never use alpha on 1000.", "Never use bravo on 1001."]]
    assert (guarded.repair_calls, guarded.result.calls) == (1, 2)
    assert "1000" in guarded.result.text and "1001" not in guarded.result.text
    assert guarded.forced_out == ("Never use bravo on 1001.",)
    assert "1001" in guarded.dropped_details
    assert count_tokens(guarded.result.text) <= fold_guard.usable_tokens(cap)


def test_a_repair_that_drops_another_protected_line_is_not_taken_for_a_better_one() -> None:
    old = rules_only(5)
    draft = rules_only(5, start=2) + f"\n- {ZULU}"
    cap = room_for_one_more(draft, "Never use bravo on 1001.")
    # Keeps both named rules, drops charlie's and delta's instead: worse than the splice.
    other = summary(*(f"Never use {SUBJECTS[n]} on {1000 + n}." for n in (0, 1, 4)), ZULU)
    guarded = summarize_guarded(Scripted(draft, other), old, said(ZULU), cap)
    assert "1002" in guarded.result.text and "1003" in guarded.result.text
    assert guarded.result.text.count("Never use") == 5


def test_a_summary_that_loses_nothing_takes_one_call() -> None:
    guarded = summarize_guarded(Scripted(KEPT), OLD, said("Ticket ZZ-9001 is open."))
    assert (guarded.result.calls, guarded.repaired) == (1, False)
    assert guarded.dropped_details == ["ZZ-9001"]


def smallest_cap_that_refuses(old: str, new: str) -> int:
    return next(cap for cap in range(1, 2000) if fold_guard.losses(old, said("hi"), new, cap))


def test_a_drop_with_no_room_left_under_the_cap_is_the_cap_biting() -> None:
    cap = smallest_cap_that_refuses(OLD, DROPS_CODE)
    # The spec's link, a value in passing, is room for the door code, a fact stated with its value.
    in_passing = count_tokens("- Spec at https://example.com/specs/v2.\n")
    needed = count_tokens(DROPS_CODE) - in_passing + count_tokens("- The door code is 4821.\n")
    needed += fold_guard.ROOM_MARGIN
    # The cap's last tenth is no room: a summarizer that stopped there was cutting for it.
    usable = 1 - fold_guard.CAP_SLACK
    assert int(cap * usable) >= needed > int((cap - 1) * usable)
    assert fold_guard.losses(OLD, said("hi"), DROPS_CODE, cap - 1) == []


def test_small_talk_kept_at_the_cap_is_room_a_dropped_rule_could_have_had() -> None:
    small_talk = "\n- We chatted about sourdough baking, houseplants and the weather lately."
    rules = "\n- Never deploy the billing service on a Friday afternoon or a public holiday."
    chatty, strict = DROPS_CODE + small_talk * 2, DROPS_CODE + rules * 2
    [loss] = fold_guard.losses(OLD, said("hi"), chatty, count_tokens(chatty))
    assert loss.missing == ("4821",)
    assert fold_guard.losses(OLD, said("hi"), strict, count_tokens(strict)) == []


SUBJECTS = [
    "alpha",
    "bravo",
    "charlie",
    "delta",
    "echo",
    "foxtrot",
    "golf",
    "hotel",
    "india",
    "juliet",
    "kilo",
    "lima",
    "mike",
    "november",
    "oscar",
    "papa",
    "quebec",
    "romeo",
    "sierra",
    "tango",
    "uniform",
    "victor",
    "whiskey",
    "xray",
    "yankee",
    "zulu",
    "amber",
    "cobalt",
    "indigo",
    "scarlet",
]


@pytest.mark.parametrize("cap", [64, 96, 128])
def test_offline_summaries_pass_the_guard_at_a_full_cap(cap: int) -> None:
    """Rules only, each on its own subject, at a cap far too small for all of them: the offline
    summarizer drops the oldest, as the cap forces, and never needs a repair; the newest rules
    get in."""
    rules = [f"Never use {subject} on {1000 + n}." for n, subject in enumerate(SUBJECTS)]
    summarizer = OfflineSummarizer(cap_tokens=cap)
    current, dropped_at_the_cap = "", 0
    for start in range(0, len(rules), 3):
        messages = said(*rules[start : start + 3])
        guarded = summarize_guarded(summarizer, current, messages, cap)
        assert (guarded.repaired, guarded.result.calls) == (False, 1)
        dropped_at_the_cap += len(fold_guard.losses(current, messages, guarded.result.text))
        current = guarded.result.text
    assert dropped_at_the_cap > 0  # without its cap, the guard would have refused these
    assert "1029" in current and "1000" not in current


# A line a person wrote (an edit of the summary) states no rule and no value: the guard keeps it
# all the same, unless a folded message takes it back.
WRITTEN = "Enjoys long walks."


def test_a_line_a_person_wrote_is_kept_like_a_rule() -> None:
    dropped = summary("Door code: 4821.", "Never share the staging password with contractors.")
    assert WRITTEN not in [loss.line for loss in fold_guard.losses(OLD, said("ok"), dropped)]
    lost = fold_guard.losses(OLD, said("ok"), dropped, user_lines=[WRITTEN])
    assert WRITTEN in [loss.line for loss in lost]
    reworded = summary("Door code: 4821.", "Enjoys walks that are long.")
    assert WRITTEN not in [
        loss.line for loss in fold_guard.losses(OLD, said("ok"), reworded, user_lines=[WRITTEN])
    ]


def test_a_line_a_person_wrote_may_go_when_a_folded_message_revokes_it() -> None:
    dropped = summary("Door code: 4821.")
    revoked = said("Forget the long walks: that hobby is over now.")
    assert WRITTEN not in [
        loss.line for loss in fold_guard.losses(OLD, revoked, dropped, user_lines=[WRITTEN])
    ]


def test_a_line_a_person_wrote_stays_theirs_only_while_the_summary_states_it() -> None:
    kept = summary("Door code: 4821.", "Enjoys long walks.")
    assert fold_guard.user_lines_kept([WRITTEN, "The door code is 4821."], kept) == [
        WRITTEN,
        "The door code is 4821.",
    ]
    assert fold_guard.user_lines_kept([WRITTEN], summary("Door code: 4821.")) == []


def test_a_line_a_person_wrote_is_put_back_when_a_draft_and_its_repair_drop_it() -> None:
    drafts = iter([summary("Door code: 4821."), summary("Door code: 4821.")])

    class Forgetful:
        name = "forgetful"

        def summarize(self, current: str, messages: Sequence[FoldMessage]) -> SummaryResult:
            return SummaryResult(next(drafts), 1, 1, self.name)

        def repair(
            self, current: str, messages: Sequence[FoldMessage], draft: str, keep: Sequence[str]
        ) -> SummaryResult:
            return SummaryResult(next(drafts), 1, 1, self.name)

    guarded = summarize_guarded(Forgetful(), OLD, said("ok"), user_lines=[WRITTEN])
    text = guarded.result.text
    assert f"## Goals / Preferences\n- {WRITTEN}\n" in text
    assert text.index(WRITTEN) < text.index("## Decisions")
    assert guarded.result.calls == 1


KITCHEN = "Budget for the kitchen is 4000 EUR."


def test_a_line_a_person_wrote_is_not_revoked_by_a_message_sharing_one_word() -> None:
    old = f"## Facts / Constraints\n- {KITCHEN}\n- Enjoys tea."
    dropped = summary("Enjoys tea.")
    unrelated = said("Actually, can you remove the kitchen photos from the album?")
    lost = fold_guard.losses(old, unrelated, dropped, user_lines=[KITCHEN])
    assert [loss.line for loss in lost] == [KITCHEN]


@pytest.mark.parametrize(
    "message",
    [
        "Actually the 4000 EUR is wrong: scrap it.",
        "Change of plan: the kitchen budget is now 5200 EUR.",
    ],
)
def test_a_line_a_person_wrote_goes_when_a_message_names_its_value_or_restates_it(
    message: str,
) -> None:
    old = f"## Facts / Constraints\n- {KITCHEN}"
    lost = fold_guard.losses(old, said(message), summary("Nothing."), user_lines=[KITCHEN])
    assert KITCHEN not in [loss.line for loss in lost]  # the message's own line is another matter


WITHHELD = "message 17 withheld: the summarizer refused it"


def test_a_withheld_marker_is_kept_like_a_rule_whatever_its_seq() -> None:
    assert is_rule_or_value(WITHHELD)
    old = f"## Facts / Constraints\n- Enjoys tea.\n## Open Items\n- {WITHHELD}"
    other = summary("Enjoys tea.") + "\n## Open Items\n- message 18 withheld: refused"
    [loss] = fold_guard.losses(old, said("Forget message 17, it was withheld anyway."), other)
    assert loss.line == WITHHELD
    guarded = summarize_guarded(Scripted(other), old, said("ok"))
    assert WITHHELD in guarded.result.text.split("## Open Items")[1]


def test_a_value_is_not_kept_by_a_longer_code_that_contains_it() -> None:
    old = "## Facts / Constraints\n- Each upload is limited to 8,502 kilobytes, never more."
    new = summary("Answers as short bullet lists, template T-8502.", "Locker 18502.")
    [loss] = fold_guard.losses(old, said("ok"), new)
    assert loss.missing == ("8,502",)
    assert fold_guard.losses(old, said("ok"), summary("Uploads: at most 8502 kB.")) == []


def values_only(count: int, start: int = 0) -> str:
    return summary(*(f"Locker {SUBJECTS[n]} is number {5000 + n}." for n in range(start, count)))


def test_values_the_cap_left_out_are_the_drafts_choice_and_cost_no_call() -> None:
    """Each old value would fit alone in the room the padding leaves, not all of them: a
    summarizer keeps the newest under its cap, so the guard puts back what fits and asks
    nothing; the rest is in the loss report."""
    old = values_only(6)
    draft = values_only(6, start=4) + "\n- " + "\n- ".join(PADDING[:2])
    cap = room_for_one_more(values_only(6, start=4), "Locker alpha is number 5000.") + 8
    summarizer = Scripted(draft)
    guarded = summarize_guarded(summarizer, old, said("ok"), cap)
    assert summarizer.repairs == [] and guarded.result.calls == 1
    assert "5000" in guarded.result.text and PADDING[0] not in guarded.result.text
    assert guarded.forced_out and all(
        line.split()[-1].rstrip(".") in guarded.dropped_details for line in guarded.forced_out
    )


def test_a_rule_is_put_back_over_a_line_that_only_carries_a_value() -> None:
    old = summary("Never deploy on a Friday.")
    draft = values_only(8)
    cap = int(count_tokens(draft) / (1 - fold_guard.CAP_SLACK)) + 1
    guarded = summarize_guarded(Scripted(draft), old, said("ok"), cap)
    text = guarded.result.text
    assert "Never deploy on a Friday." in text and guarded.result.calls == 1
    assert "5007" not in text  # the bottom value went, and the loss report says so
    assert guarded.dropped_details == ["Locker hotel is number 5007."]
    assert count_tokens(text) <= fold_guard.usable_tokens(cap)


def test_a_standing_item_the_user_said_and_the_summarizer_left_out_is_spliced_in() -> None:
    """A summarizer that does not see "Quote all prices in euros." as a rule (no "never", no
    "must") drops it from its first summary; the guard puts it back with no second call."""
    messages = [
        FoldMessage(1, "user", "Quote all prices in euros."),
        FoldMessage(2, "assistant", "Understood."),
        FoldMessage(3, "user", "I want answers as bullet points, no tables."),
        FoldMessage(4, "user", "Build QX-71B4 finished in 412 seconds."),
    ]
    draft = summary("Build QX-71B4 finished in 412 seconds.")
    guarded = summarize_guarded(Scripted(draft), "", messages, 200)
    assert guarded.result.calls == 1 and guarded.repaired
    assert "- Quote all prices in euros." in guarded.result.text
    assert "- I want answers as bullet points, no tables." in guarded.result.text
    assert "QX-71B4" in guarded.result.text  # there was room for all three


def test_half_of_a_two_sentence_rule_is_no_rule_kept() -> None:
    rule = "Deploys need two approvals. Never deploy on a Friday."
    half = summary("Never deploy on a Friday.")
    [loss] = fold_guard.losses("", said(rule), half)
    assert loss.line == rule
    assert fold_guard.losses("", said(rule), summary(rule)) == []


def test_a_later_message_of_the_user_takes_a_standing_item_back_and_a_reply_does_not() -> None:
    rule = "Quote all prices in euros."
    took_back = said(rule, "Actually, forget the euros rule, prices in dollars are fine.")
    assert fold_guard.losses("", took_back, summary("Prices in dollars are fine.")) == []
    echoed = [
        FoldMessage(1, "user", rule),
        FoldMessage(
            2, "assistant", "Understood: all prices in euros, 3 decimals, from 2031-01-01."
        ),
    ]
    [loss] = fold_guard.losses("", echoed, summary("Nothing yet."))
    assert loss.line == rule


def test_a_standing_item_the_cap_let_go_is_in_the_loss_report_in_words() -> None:
    """The offline summarizer at a cap too small for every rule drops the oldest; the loss
    report names it whole (it has no value to list), so what went is on the ledger."""
    rules = [
        "Quote all prices in euros.",
        "Report all distances in kilometres.",
        "Only PostgreSQL for the ledger.",
        "No tracking cookies on the public site.",
        "Escalate any data breach to the security team at once.",
    ]
    messages = [FoldMessage(n, "user", rule) for n, rule in enumerate(rules, start=1)]
    guarded = summarize_guarded(OfflineSummarizer(cap_tokens=70), "", messages, 70)
    assert count_tokens(guarded.result.text) <= 70
    gone = [rule for rule in rules if rule not in guarded.result.text]
    assert gone and gone[0] == rules[0]  # the oldest went first
    assert gone == [line for line in guarded.dropped_details if line in rules]


def test_one_off_requests_are_not_spliced_into_a_summary() -> None:
    messages = said("Explain recursion.", "Write a Python function that parses dates.")
    assert fold_guard.losses("", messages, summary("Nothing yet.")) == []


def test_a_users_rule_is_not_taken_back_by_a_question_sharing_one_word() -> None:
    rule = "Always quote prices in euros."
    messages = said(rule, "Actually, what were the flight prices again?")
    [loss] = fold_guard.losses("", messages, summary("Flights were discussed."))
    assert loss.line == rule
