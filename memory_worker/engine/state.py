"""A chat as the policy engine sees it (pure, like memory_worker.engine.policy): its unfolded
messages, their turn boundaries and token measures. memory_worker.folding.snapshot builds one from
the database.

- W (``last_consolidated``): every message with ``seq <= W`` is folded into the summary; every
  message with ``seq > W`` ("unfolded") is verbatim in the context.
- Turn boundary: ``b`` is a boundary when ``b == W`` or message ``b + 1`` is a user message, so
  a user message, its reply, assistant tool calls and their results always stay together.
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass
from datetime import datetime
from functools import cached_property
from statistics import median
from typing import NamedTuple

from memory_worker.engine.turn_groups import turns_of

ROLE_OVERHEAD_TOKENS = 4  # per chat message: role and separators
PROMPT_PRIMING_TOKENS = 3  # every reply is primed with a few tokens

# A chat's turn size: the median of its newest unfolded turns. Typical growth, not one long
# reply's: a turn far larger than the chat's others waits for the fold in flight instead of
# lowering every threshold for as long as it is among the newest.
RECENT_TURNS = 8


class Msg(NamedTuple):
    # A tuple, not a dataclass: a turn and a fold build one per unfolded message, and a frozen
    # dataclass's __init__ sets each field through object.__setattr__.
    seq: int
    role: str
    tokens: int


@dataclass(frozen=True)
class ChatState:
    last_consolidated: int
    last_seq: int
    unfolded: tuple[Msg, ...]
    summary_tokens: int
    system_tokens: int
    turns_mark: int
    last_consolidated_at: datetime | None
    model_context_tokens: int
    # The pinned block with every pin in it (memory_worker.pinned): in every context beside the
    # summary, so it counts in the bound like the summary. A pinned message still in the
    # verbatim tail is counted twice: its pin's room is kept for when it folds.
    pinned_tokens: int = 0

    @cached_property
    def boundary_table(self) -> Mapping[int, After]:
        """after_boundaries, computed once per state: one decision consults it from several
        places (backlog, each trigger's range, the turn limit), and the state never changes."""
        return _after_boundaries(self)

    @cached_property
    def turn_size(self) -> tuple[float, float]:
        """Median tokens (role overhead included) and messages of the newest RECENT_TURNS
        unfolded turns; computed once, as every trigger's threshold uses it."""
        turns = turns_of(sorted(self.unfolded, key=lambda m: m.seq))[-RECENT_TURNS:]
        if not turns:
            return 0.0, 0.0
        tokens = [sum(m.tokens + ROLE_OVERHEAD_TOKENS for m in turn) for turn in turns]
        return float(median(tokens)), float(median(len(turn) for turn in turns))

    @cached_property
    def suffix_sums(self) -> tuple[list[int], list[int]]:
        """The unfolded seqs ascending, and for each index i the tokens of messages i and after
        (one more entry: 0): what remains after any boundary, by bisection, when the request
        path tries boundary after boundary."""
        ordered = sorted(self.unfolded, key=lambda m: m.seq)
        suffix = [0] * (len(ordered) + 1)
        for index in range(len(ordered) - 1, -1, -1):
            suffix[index] = suffix[index + 1] + ordered[index].tokens
        return [m.seq for m in ordered], suffix


def history_tokens(state: ChatState) -> int:
    return state.summary_tokens + state.pinned_tokens + sum(m.tokens for m in state.unfolded)


def prompt_tokens(state: ChatState, new_message_tokens: int = 0) -> int:
    """The whole prompt: system prompt, summary, pinned block, unfolded messages and the new
    message, each with its role overhead, plus the reply priming."""
    return prompt_total(
        state.system_tokens,
        state.summary_tokens,
        len(state.unfolded),
        sum(m.tokens for m in state.unfolded),
        new_message_tokens,
        state.pinned_tokens,
    )


def prompt_total(
    system: int, summary: int, messages: int, tokens: int, new: int, pinned: int = 0
) -> int:
    """prompt_tokens from its parts: ``messages`` unfolded messages of ``tokens`` in all."""
    total = PROMPT_PRIMING_TOKENS + tokens + messages * ROLE_OVERHEAD_TOKENS
    for part in (system, summary, pinned, new):
        if part:
            total += part + ROLE_OVERHEAD_TOKENS
    return total


class After(NamedTuple):
    """What lies after a boundary: the unfolded user messages and tokens with a greater seq."""

    users: int
    tokens: int


def after_boundaries(state: ChatState) -> Mapping[int, After]:
    """Every boundary b >= W (ascending, see boundaries) with what lies after it."""
    return state.boundary_table


def _after_boundaries(state: ChatState) -> Mapping[int, After]:
    """In one pass from the newest message: the folding decisions look at every boundary, and
    recounting the messages after each one would be quadratic in the backlog (a chat whose
    workers are down)."""
    watermark = state.last_consolidated
    users = tokens = 0
    found: dict[int, After] = {}
    for message in sorted(state.unfolded, key=lambda m: m.seq, reverse=True):
        if message.seq <= watermark:
            continue  # not unfolded: after no boundary >= W
        users += message.role == "user"
        tokens += message.tokens
        if message.role == "user" and message.seq - 1 > watermark:
            found[message.seq - 1] = After(users, tokens)
    found[watermark] = After(users, tokens)
    return dict(sorted(found.items()))


def boundaries(state: ChatState) -> list[int]:
    """Every boundary b >= W, ascending: folding (W, b] never splits a turn."""
    return list(after_boundaries(state))
