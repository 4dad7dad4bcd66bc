"""A fold's summary as the fold guard lets it through (docs/policies.md, "The fold guard"): the
summarizer's valid summary, checked against the old summary and the folded messages
(memory_worker.summaries.guard). What it lost with room to keep it is put back deterministically
(memory_worker.summaries.splice), with no second call. Only when the cap forces a choice is the
summarizer asked once to make room itself; the better of the two summaries is written, and what
the cap forced out is in the loss report. A fold fails ``lossy`` only when no summary within the
cap keeps what had room. Plain Python (no Django)."""

import logging
from collections.abc import Collection, Sequence
from dataclasses import dataclass, replace

from memory_worker.summaries import guard as fold_guard
from memory_worker.summaries.contract import (
    FoldMessage,
    RepairingSummarizer,
    Summarizer,
    SummarizerError,
    SummaryResult,
)
from memory_worker.summaries.retention import RULE, WEAK, rank
from memory_worker.summaries.splice import Fits, Restore, Splice, splice

log = logging.getLogger("chatmem.fold")

# The ledger row keeps this many of a fold's dropped details (the metric counts them all).
DROPPED_DETAILS_KEPT = 50
# How much of what would have been lost a failed fold's error names.
ERROR_ITEMS = 10


@dataclass(frozen=True)
class GuardedSummary:
    result: SummaryResult  # its calls and tokens include the repair call's, if one was made
    dropped_details: list[str]  # the loss report, in input order (see ``loss_report``)
    repaired: bool = False  # lines were put back (by the splice, or by a repair call)
    repair_calls: int = 0  # summarizer calls the guard made: 0 unless the cap forced a choice
    forced_out: tuple[str, ...] = ()  # protected lines the cap left no room for


@dataclass(frozen=True)
class GuardContext:
    """What a summary is checked against, whichever path wrote it."""

    current_summary: str
    messages: Sequence[FoldMessage]  # those the summarizer saw (a withheld message is not one)
    cap_tokens: int | None = None
    pinned: Sequence[str] = ()
    user_lines: Collection[str] = ()
    model: str | None = None  # whose tokens the cap is counted in


def summarize_guarded(
    summarizer: Summarizer,
    current_summary: str,
    messages: Sequence[FoldMessage],
    cap_tokens: int | None = None,
    pinned: Sequence[str] = (),
    user_lines: Collection[str] = (),
    model: str | None = None,
) -> GuardedSummary:
    """``cap_tokens``: the summary's cap (the chat's ``summary_token_cap``); a line dropped from
    a summary with no room left for it is the cap biting, not a loss (fold_guard.losses).
    ``pinned``: the chat's pinned items, in every context beside the summary: a line they
    carry is not lost when the summary leaves it to them. ``user_lines``: the summary's lines
    a person wrote, kept like rules. ``model``: whose count the cap is in."""
    context = GuardContext(current_summary, messages, cap_tokens, pinned, user_lines, model)
    return guard(summarizer.summarize(current_summary, messages), context, summarizer)


def guard(
    draft: SummaryResult, context: GuardContext, summarizer: Summarizer | None = None
) -> GuardedSummary:
    """``draft`` checked and, where it lost what it had room for, repaired. ``summarizer``: the
    one asked when the cap forces a choice (None: no call, the splice's summary stands; a
    bisection's pieces were refused once already)."""
    lost = losses_of(draft.text, context)
    if not lost:
        return finished(draft, context)
    fields = {"event": "fold_guard", "backend": draft.backend, "lost": len(lost)}
    spliced = splice_in(draft.text, lost, context)
    best = replace(draft, text=spliced.text)
    repair_calls = 0
    if must_ask(spliced, lost, context) and isinstance(summarizer, RepairingSummarizer):
        # A rule or a person's line does not fit even with everything weaker gone: the cap is
        # full of their equals, and the model may say the same in fewer tokens. Its answer is
        # guarded like the draft.
        log.info("fold guard asks for a repair", extra={**fields, "outcome": "repair"})
        fixed = summarizer.repair(
            context.current_summary,
            context.messages,
            draft.text,
            [loss.line for loss in lost if not loss.said],
        )
        repair_calls = fixed.calls
        respliced = splice_in(fixed.text, losses_of(fixed.text, context), context)
        total = SummaryResult(
            best.text,
            draft.input_tokens + fixed.input_tokens,
            draft.output_tokens + fixed.output_tokens,
            fixed.backend,
            calls=draft.calls + fixed.calls,
        )
        if still_missing(respliced.text, context) < still_missing(spliced.text, context):
            spliced, total = respliced, replace(total, text=respliced.text)
        best = total
    # What the splice could not fit, or evicted for a line above it, is the cap biting;
    # anything else still lost is a bug in the splice, and writing nothing is then the safe
    # answer.
    forced = {*spliced.left_out, *spliced.evicted}
    remaining = [loss for loss in losses_of(best.text, context) if loss.line not in forced]
    if remaining:
        log.warning("fold guard refused a summary", extra={**fields, "outcome": "refused"})
        raise lossy_error(remaining, "and no summary within the cap could keep it")
    log.info(
        "fold guard repaired a summary",
        extra={**fields, "outcome": "spliced" if not repair_calls else "repaired"},
    )
    return finished(best, context, repaired=True, repair_calls=repair_calls, forced=spliced)


def finished(
    result: SummaryResult,
    context: GuardContext,
    *,
    repaired: bool = False,
    repair_calls: int = 0,
    forced: Splice | None = None,
) -> GuardedSummary:
    forced_out = forced_out_lines(forced, context) if forced is not None else ()
    details = loss_report(context, result.text, forced_out)
    return GuardedSummary(result, details, repaired, repair_calls, forced_out)


def loss_report(context: GuardContext, summary: str, forced_out: Sequence[str]) -> list[str]:
    """Every exact detail of the fold's input the summary let go (fold_guard.dropped_details),
    then each protected line the cap forced out (a rule in words; a line the draft wrote that
    the splice evicted for a rule) and each standing item the summary let go for the cap (the
    summarizer's own choice among standing items, the oldest first), whole, unless that list
    names its details already. A line a folded message took back went by request: not listed."""
    details = fold_guard.dropped_details(context.current_summary, context.messages, summary)
    named = {fold_guard.detail_key(detail) for detail in details}

    def said_already(line: str) -> bool:
        keys = {fold_guard.detail_key(detail) for detail in fold_guard.details_of(line)}
        return bool(keys) and keys <= named

    kept = "\n".join([summary, *context.pinned])
    gone = fold_guard.losses(
        context.current_summary, context.messages, kept, None, context.user_lines
    )
    lines = dict.fromkeys([*forced_out, *(loss.line for loss in gone if not loss.missing)])
    return [*details, *(line for line in lines if not said_already(line))]


def losses_of(text: str, context: GuardContext) -> list[fold_guard.Loss]:
    kept = "\n".join([text, *context.pinned])
    return fold_guard.losses(
        context.current_summary, context.messages, kept, context.cap_tokens, context.user_lines
    )


# Evicting whole lines can free more than a restored line takes: what then has room is spliced
# in the next round. Each round only fills room, so a few are enough.
SPLICE_ROUNDS = 4


def splice_in(text: str, lost: Sequence[fold_guard.Loss], context: GuardContext) -> Splice:
    cap = context.cap_tokens
    fits = Fits(cap, None if cap is None else fold_guard.usable_tokens(cap), context.model)
    done = Splice(text, (), (), ())
    for _ in range(SPLICE_ROUNDS):
        tried = {*done.restored, *done.left_out, *done.evicted}
        todo = [Restore(loss.heading, loss.line) for loss in lost if loss.line not in tried]
        if not todo:
            break
        step = splice(done.text, todo, fits, context.user_lines)
        done = Splice(
            step.text,
            (*done.restored, *step.restored),
            (*done.left_out, *step.left_out),
            (*done.evicted, *step.evicted),
        )
        lost = losses_of(done.text, context)
    return done


def must_ask(spliced: Splice, lost: Sequence[fold_guard.Loss], context: GuardContext) -> bool:
    """Whether the cap left out a standing line of the old summary, a line a person wrote or a
    withheld marker: a choice among equals, which the model may make room for. Values the cap
    left out are the cap biting, as the draft itself chose (a summarizer keeps the newest under
    its cap); so is a folded message's statement that finds the cap full of its equals."""
    old_lines = {loss.line for loss in lost if not loss.said}
    return any(
        rank(line, context.user_lines) <= RULE for line in spliced.left_out if line in old_lines
    )


def forced_out_lines(spliced: Splice, context: GuardContext) -> tuple[str, ...]:
    """The protected lines the cap forced out: left out, or evicted for a line above them."""
    evicted = (line for line in spliced.evicted if rank(line, context.user_lines) < WEAK)
    return (*spliced.left_out, *evicted)


def still_missing(text: str, context: GuardContext) -> int:
    """How many protected lines of the old summary ``text`` does not state, room or not."""
    kept = "\n".join([text, *context.pinned])
    return len(
        fold_guard.losses(context.current_summary, context.messages, kept, None, context.user_lines)
    )


def lossy_error(lost: list[fold_guard.Loss], why: str) -> SummarizerError:
    named = "; ".join(loss.describe() for loss in lost[:ERROR_ITEMS])
    more = f" (and {len(lost) - ERROR_ITEMS} more)" if len(lost) > ERROR_ITEMS else ""
    return SummarizerError("lossy", f"fold guard: the summary would have lost {named}{more}, {why}")
