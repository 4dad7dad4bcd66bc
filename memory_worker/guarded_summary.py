"""A fold's summary as the fold guard lets it through (docs/policies.md, "The fold guard"): the
summarizer's valid summary, checked against the old summary and the folded messages
(memory_worker.fold_guard); on a loss, one repair call naming what is missing; a repair that
still drops it is a non-transient ``SummarizerError`` ("lossy"), so nothing is written. Plain
Python (no Django)."""

import logging
from collections.abc import Collection, Sequence
from dataclasses import dataclass

from memory_worker import fold_guard
from memory_worker.summarizers import (
    FoldMessage,
    RepairingSummarizer,
    Summarizer,
    SummarizerError,
    SummaryResult,
)

log = logging.getLogger("chatmem.fold")

# The ledger row keeps this many of a fold's dropped details (the metric counts them all).
DROPPED_DETAILS_KEPT = 50
# How much of what would have been lost a failed fold's error names.
ERROR_ITEMS = 10


@dataclass(frozen=True)
class GuardedSummary:
    result: SummaryResult  # its calls and tokens include the repair's
    dropped_details: list[str]  # all of them, in input order (fold_guard.dropped_details)
    repaired: bool = False


def summarize_guarded(
    summarizer: Summarizer,
    current_summary: str,
    messages: Sequence[FoldMessage],
    cap_tokens: int | None = None,
    pinned: Sequence[str] = (),
    user_lines: Collection[str] = (),
) -> GuardedSummary:
    """``cap_tokens``: the summary's cap (the chat's ``summary_token_cap``); a line dropped from
    a summary with no room left for it is the cap biting, not a loss (fold_guard.losses).
    ``pinned``: the chat's pinned items, in every context beside the summary: a line they
    carry is not lost when the summary leaves it to them. ``user_lines``: the summary's lines
    a person wrote, kept like rules."""
    result = summarizer.summarize(current_summary, messages)
    kept = "\n".join([result.text, *pinned])
    lost = fold_guard.losses(current_summary, messages, kept, cap_tokens, user_lines)
    repaired = False
    if lost:
        result = repair(summarizer, current_summary, messages, result, lost, cap_tokens, user_lines)
        repaired = True
    details = fold_guard.dropped_details(current_summary, messages, result.text)
    return GuardedSummary(result, details, repaired)


def repair(
    summarizer: Summarizer,
    current_summary: str,
    messages: Sequence[FoldMessage],
    draft: SummaryResult,
    lost: list[fold_guard.Loss],
    cap_tokens: int | None,
    user_lines: Collection[str] = (),
) -> SummaryResult:
    """The one repair call; its summary must keep every line the draft lost. What it drops
    instead to stay within the cap is not refused again: it is in the loss report."""
    fields = {"event": "fold_guard", "backend": summarizer.name, "lost": len(lost)}
    if not isinstance(summarizer, RepairingSummarizer):
        log.warning("fold guard refused a summary", extra={**fields, "outcome": "refused"})
        raise lossy_error(lost, "and this summarizer cannot repair")
    log.info("fold guard asks for a repair", extra={**fields, "outcome": "repair"})
    keep = [loss.line for loss in lost]
    fixed = summarizer.repair(current_summary, messages, draft.text, keep)
    still = fold_guard.still_lost(lost, fixed.text, cap_tokens, user_lines)
    if still:
        log.warning("fold guard refused the repair", extra={**fields, "outcome": "refused"})
        raise lossy_error(still, "and the repair did not keep it")
    log.info("fold guard accepted the repair", extra={**fields, "outcome": "repaired"})
    return SummaryResult(
        fixed.text,
        draft.input_tokens + fixed.input_tokens,
        draft.output_tokens + fixed.output_tokens,
        fixed.backend,
        calls=draft.calls + fixed.calls,
    )


def lossy_error(lost: list[fold_guard.Loss], why: str) -> SummarizerError:
    named = "; ".join(loss.describe() for loss in lost[:ERROR_ITEMS])
    more = f" (and {len(lost) - ERROR_ITEMS} more)" if len(lost) > ERROR_ITEMS else ""
    return SummarizerError("lossy", f"fold guard: the summary would have lost {named}{more}, {why}")
