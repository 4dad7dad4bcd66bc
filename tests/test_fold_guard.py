"""The fold guard (memory_worker.fold_guard, memory_worker.guarded_summary): a new summary that
drops a rule or an exact value of the old one, which no folded message changed, is refused,
repaired once, or fails; and the loss report lists what a fold's summary let go."""

from collections.abc import Sequence

import pytest
from hypothesis import given
from hypothesis import strategies as st

from memory_worker import fold_guard
from memory_worker.guarded_summary import summarize_guarded
from memory_worker.offline_summarizer import OfflineSummarizer
from memory_worker.summarizers import FoldMessage, SummarizerError, SummaryResult
from memory_worker.tokens import count_tokens

OLD = """## Facts / Constraints
- The door code is 4821.
- Never share the staging password with contractors.
- Budget is at most $4,000.
## Goals / Preferences
- Prefers short answers.
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


def test_still_lost_names_only_what_a_repair_kept_dropping() -> None:
    new = KEPT.replace("Door code: 4821.", "").replace("Budget at most $4000.", "")
    lost = fold_guard.losses(OLD, said("hi"), new)
    assert [loss.missing for loss in lost] == [("4821",), ("$4,000",)]
    repaired = new + "\n- Door code is 4821."
    assert fold_guard.still_lost(lost, repaired) == [lost[1]]


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


def test_a_refused_summary_is_repaired_once_and_both_calls_count() -> None:
    summarizer = Scripted(DROPS_CODE, KEPT)
    guarded = summarize_guarded(summarizer, OLD, said("hello"))
    assert summarizer.repairs == [["The door code is 4821."]]
    assert (guarded.result.text, guarded.repaired) == (KEPT, True)
    assert (guarded.result.calls, guarded.result.input_tokens, guarded.result.output_tokens) == (
        2,
        250,
        30,
    )


def test_a_repair_that_still_drops_it_fails_as_lossy() -> None:
    with pytest.raises(SummarizerError) as failed:
        summarize_guarded(Scripted(DROPS_CODE, DROPS_CODE), OLD, said("hello"))
    assert failed.value.kind == "lossy" and not failed.value.transient
    assert "4821" in str(failed.value)


def test_a_summarizer_that_cannot_repair_fails_at_once() -> None:
    class Plain:
        name = "plain"

        def summarize(self, current_summary: str, messages: Sequence[FoldMessage]) -> SummaryResult:
            return SummaryResult(DROPS_CODE, 1, 1, self.name)

    with pytest.raises(SummarizerError, match="4821"):
        summarize_guarded(Plain(), OLD, said("hello"))


def test_a_summary_that_loses_nothing_takes_one_call() -> None:
    guarded = summarize_guarded(Scripted(KEPT), OLD, said("Ticket ZZ-9001 is open."))
    assert (guarded.result.calls, guarded.repaired) == (1, False)
    assert guarded.dropped_details == ["ZZ-9001"]


def smallest_cap_that_refuses(old: str, new: str) -> int:
    return next(cap for cap in range(1, 2000) if fold_guard.losses(old, said("hi"), new, cap))


def test_a_drop_with_no_room_left_under_the_cap_is_the_cap_biting() -> None:
    cap = smallest_cap_that_refuses(OLD, DROPS_CODE)
    needed = count_tokens(DROPS_CODE) + count_tokens("- The door code is 4821.\n")
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
WRITTEN = "Prefers short answers."


def test_a_line_a_person_wrote_is_kept_like_a_rule() -> None:
    dropped = summary("Door code: 4821.", "Never share the staging password with contractors.")
    assert WRITTEN not in [loss.line for loss in fold_guard.losses(OLD, said("ok"), dropped)]
    lost = fold_guard.losses(OLD, said("ok"), dropped, user_lines=[WRITTEN])
    assert WRITTEN in [loss.line for loss in lost]
    reworded = summary("Door code: 4821.", "Prefers answers that are short.")
    assert WRITTEN not in [
        loss.line for loss in fold_guard.losses(OLD, said("ok"), reworded, user_lines=[WRITTEN])
    ]


def test_a_line_a_person_wrote_may_go_when_a_folded_message_revokes_it() -> None:
    dropped = summary("Door code: 4821.")
    revoked = said("Forget the short answers preference: long answers are fine now.")
    assert WRITTEN not in [
        loss.line for loss in fold_guard.losses(OLD, revoked, dropped, user_lines=[WRITTEN])
    ]


def test_a_line_a_person_wrote_stays_theirs_only_while_the_summary_states_it() -> None:
    kept = summary("Door code: 4821.", "Prefers short answers.")
    assert fold_guard.user_lines_kept([WRITTEN, "The door code is 4821."], kept) == [
        WRITTEN,
        "The door code is 4821.",
    ]
    assert fold_guard.user_lines_kept([WRITTEN], summary("Door code: 4821.")) == []


def test_a_repair_must_keep_the_lines_a_person_wrote() -> None:
    drafts = iter([summary("Door code: 4821."), summary("Door code: 4821.")])

    class Forgetful:
        name = "forgetful"

        def summarize(self, current: str, messages: Sequence[FoldMessage]) -> SummaryResult:
            return SummaryResult(next(drafts), 1, 1, self.name)

        def repair(
            self, current: str, messages: Sequence[FoldMessage], draft: str, keep: Sequence[str]
        ) -> SummaryResult:
            assert WRITTEN in keep
            return SummaryResult(next(drafts), 1, 1, self.name)

    with pytest.raises(SummarizerError) as refused:
        summarize_guarded(Forgetful(), OLD, said("ok"), user_lines=[WRITTEN])
    assert refused.value.kind == "lossy" and WRITTEN in str(refused.value)
