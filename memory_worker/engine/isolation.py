"""When a range the summarizer keeps refusing is bisected, how many calls that may cost, and
where a refused piece is halved (pure; docs/policies.md, "Poison messages")."""

from __future__ import annotations

from collections.abc import Sequence
from math import ceil, log2

# Poison messages (docs/policies.md): a range the provider keeps refusing is folded piece by
# piece, and the message it refuses on its own is withheld. Two refusals first, so one odd answer
# does not cost a bisection; the second is the attempt that bisects.
REFUSALS_BEFORE_ISOLATION = 2


def isolation_due(refusals: int) -> bool:
    """Whether a range refused ``refusals`` times in a row (this attempt's included) is bisected
    now."""
    return refusals >= REFUSALS_BEFORE_ISOLATION


def isolation_call_budget(messages: int) -> int:
    """The most summarizer calls one isolation of ``messages`` may make. One refused message
    costs at most two calls per halving (the refused half, then the accepted one) and its one
    retry alone: a budget with room for a second refused message, never one call per
    message."""
    return 2 * ceil(log2(max(messages, 1))) + 6


def split_index(roles: Sequence[str]) -> int:
    """Where a refused piece (the messages' roles, in order; two or more) is halved: at the turn
    boundary (a user message) nearest its middle, so whole turns stay together; a single turn
    is halved by message (one withheld message, not its whole turn)."""
    starts = [index for index, role in enumerate(roles) if index and role == "user"]
    middle = len(roles) / 2
    if not starts:
        return len(roles) // 2
    return min(starts, key=lambda index: (abs(index - middle), index))
