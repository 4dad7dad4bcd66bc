"""The chats of bench.topology: each chat's own tags on bench.cost's conversation, and the fake
model server's answers to them.

Every request at the fake server names its chat by these tags (``chat_ordinal``): the fake answers
a turn's request with its own chat's reply, and bench.topology_measures attributes each recorded
request to its chat.
"""

from __future__ import annotations

import re
import threading
from collections.abc import Mapping, Sequence
from typing import Any

from bench import cost
from tests.support.fake_openai import last_user_text, summary_text

# --- one workload per chat -----------------------------------------------------------------

# Chat g's turn n is numbered CHAT_BASE + g * TURNS_PER_CHAT + n. Its tags keep bench.cost's
# "[t<number>u]" form, so bench.cost's measuring functions work on them unchanged; they are
# unique across the chats of a run (across configurations too, so a request that strays from
# one configuration into the next is not taken for its own); and they have one width, so a tag
# costs the same tokens in every chat (cl100k splits digits in groups of three).
TURNS_PER_CHAT = 10_000
CHAT_BASE = 10_000_000
MAX_CHAT_ORDINAL = 999  # keeps every turn number at 8 digits
USER_TAG = re.compile(r"\[t(\d+)u\]")
REPLY_TAG = re.compile(r"\[t(\d+)a\]")


def chat_ordinal(number: int) -> int:
    return (number - CHAT_BASE) // TURNS_PER_CHAT


def renumbered(turn: cost.Turn, number: int) -> cost.Turn:
    user = cost.user_tag(number) + turn.user.removeprefix(cost.user_tag(turn.number))
    reply = cost.reply_tag(number) + turn.reply.removeprefix(cost.reply_tag(turn.number))
    return cost.Turn(number, user, reply, turn.fact)


def chat_workload(base: Sequence[cost.Turn], ordinal: int) -> list[cost.Turn]:
    """bench.cost's conversation ``base`` as chat ``ordinal``'s: the same text, its own tags."""
    if not 1 <= ordinal <= MAX_CHAT_ORDINAL or len(base) >= TURNS_PER_CHAT:
        raise SystemExit(f"at most {MAX_CHAT_ORDINAL} chats of {TURNS_PER_CHAT - 1} turns")
    offset = CHAT_BASE + ordinal * TURNS_PER_CHAT
    return [renumbered(turn, offset + turn.number) for turn in base]


# --- the fake model's answers --------------------------------------------------------------

# bench.cost's fake summary (325 words on its own tags) is about 470 tokens, under the 500-token
# cap of the summarizer (MEMORY_SUMMARY_TOKEN_CAP). This benchmark's tags are longer (8 digits),
# and the summary's bullets open with them: at the same word cap it passed 500 tokens and the
# summarizer refused it ("over_cap"). So the fake's summary is held to bench.cost's token size.
SUMMARY_TOKENS = 470
SUMMARY_WORDS_STEP = 25


def capped_summary(body: dict[str, Any], habits: Sequence[str] = ()) -> str:
    """tests.support.fake_openai's summary at bench.cost's word cap, with fewer words (the oldest
    bullets go first) until it is at most SUMMARY_TOKENS tokens; with the summarizer's bad
    ``habits`` (tests.support.fake_openai.SUMMARY_HABITS)."""
    words = cost.SUMMARY_CAP_WORDS
    text = summary_text(body, words, habits)
    while cost.tokens(text) > SUMMARY_TOKENS and words > SUMMARY_WORDS_STEP:
        words -= SUMMARY_WORDS_STEP
        text = summary_text(body, words, habits)
    return text


# How the fake names the reply an agent-state digest is of; it is not a message tag, so bench.cost
# does not count a digest as carrying its reply.
DIGEST_PREFIX = "(digest of "
DIGEST_LINE = re.compile(r"^Assistant: \(digest of (\[t\d+a\])\)", re.MULTILINE)
DIGEST_WORDS = 12


def turn_request_number(body: Mapping[str, Any]) -> int | None:
    """The turn a chat request is the model call of: its last user message opens with a user
    tag. None for any other chat request (the agent state's, which quote a reply)."""
    found = USER_TAG.match(last_user_text(dict(body)))
    return int(found.group(1)) if found else None


def digest_reply(body: Mapping[str, Any]) -> str:
    """A one-sentence response summary (turn-digest, docs/agent-state.md) naming its reply."""
    text = last_user_text(dict(body))
    found = REPLY_TAG.search(text)
    if found is None:
        return "Noted."
    words = text[found.end() :].split()[:DIGEST_WORDS]
    return f"{DIGEST_PREFIX}{found.group(0)}) {' '.join(words).rstrip('.')}."


class ChatReplies:
    """The fake model's chat answers for every chat of a configuration at once (the server
    calls it from its threads). A turn's request gets the reply of the turn its chat's client
    is sending (``sending``), as bench.cost's ReplyScript does for its one chat, and is noted
    in that chat's ``served``; any other chat request gets a digest."""

    def __init__(self, workloads: Mapping[int, Sequence[cost.Turn]]) -> None:
        self.replies = {turn.number: turn.reply for turns in workloads.values() for turn in turns}
        self.served: dict[int, list[int]] = {ordinal: [] for ordinal in workloads}
        self.strays = 0  # turn requests of a chat with no turn being sent
        self._sending: dict[int, int] = {}
        self._lock = threading.Lock()

    def sending(self, ordinal: int, number: int) -> None:
        with self._lock:
            self._sending[ordinal] = number

    def __call__(self, body: dict[str, Any]) -> str:
        number = turn_request_number(body)
        if number is None:
            return digest_reply(body)
        ordinal = chat_ordinal(number)
        with self._lock:
            current = self._sending.get(ordinal)
            if current is None:
                self.strays += 1
                return "(no turn of this chat is being sent)"
            self.served[ordinal].append(current)
        return self.replies[current]
