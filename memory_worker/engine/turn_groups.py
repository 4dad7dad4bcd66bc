"""Turns of a conversation, for the engine and the summarizer's input: a user message opens a
turn, and a turn (the message, its reply, tool calls and their results) is never split. Pure:
standard library only."""

from __future__ import annotations

from collections.abc import Sequence
from typing import Protocol, TypeVar


class HasRole(Protocol):
    @property
    def role(self) -> str: ...


class SizedMessage(HasRole, Protocol):
    @property
    def seq(self) -> int: ...

    @property
    def tokens(self) -> int: ...


RoleT = TypeVar("RoleT", bound=HasRole)


def turns_of(msgs: Sequence[RoleT]) -> list[list[RoleT]]:
    """Group messages (the engine's Msg, or stored messages) into turns: each user message
    opens one; a leading non-user message opens one too."""
    grouped: list[list[RoleT]] = []
    for message in msgs:
        if message.role == "user" or not grouped:
            grouped.append([message])
        else:
            grouped[-1].append(message)
    return grouped


def split_for_summarizer(
    msgs: Sequence[SizedMessage], max_input_tokens: int
) -> list[tuple[int, int]]:
    """Consecutive (from_seq, to_seq) chunks of whole turns, each within ``max_input_tokens``
    where possible; a turn larger than the budget is a chunk of its own, never trimmed."""
    chunks: list[tuple[int, int]] = []
    current: list[SizedMessage] = []
    current_tokens = 0
    for turn in turns_of(msgs):
        turn_tokens = sum(m.tokens for m in turn)
        if current and current_tokens + turn_tokens > max_input_tokens:
            chunks.append((current[0].seq, current[-1].seq))
            current, current_tokens = [], 0
        current.extend(turn)
        current_tokens += turn_tokens
    if current:
        chunks.append((current[0].seq, current[-1].seq))
    return chunks
