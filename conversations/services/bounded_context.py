"""The memory a turn's context is built from, within the policy's bound (docs/design.md, the turn,
step 4): when background folding fell behind, the turn folds synchronously first, then calls the
model (summarize, then complete), or waits for a fold of its chat already in flight. The message
list itself: services.context."""

import time
import uuid
from dataclasses import dataclass

from django.conf import settings

from conversations.models import Brief, Chat
from conversations.services.turn_slot import TurnSlotLease, raise_if_deleted, renew_turn_slot
from conversations.variants import ModelVariant
from memory_worker.engine import policy as engine
from memory_worker.engine.state import history_tokens, prompt_tokens
from memory_worker.memory import (
    FoldStatus,
    MemorySnapshot,
    engine_state,
    fold_before_turn,
    load_snapshot,
    policy_for_chat,
    time_for_a_chunk,
    turn_fold_deadline,
)

SYNC_FOLD_ATTEMPTS = 3


class ContextOverBound(Exception):
    """The context cannot be brought within the policy's bound right now (the synchronous fold
    failed, or even a full fold would not fit). Nothing is dropped: the turn is refused.
    ``retryable`` is False when the same request can never fit, so clients must not resend it."""

    def __init__(self, message: str, *, retryable: bool = True) -> None:
        super().__init__(message)
        self.retryable = retryable


@dataclass(frozen=True, slots=True)
class Bounded:
    """The snapshot a turn's context is built from, the history's tokens in it as the bound
    counts them, and how long the turn waited for a fold in flight before it fit (None: it did
    not wait); its reply's metadata keeps them."""

    snapshot: MemorySnapshot
    history_tokens: int
    waited_ms: int | None = None


def bounded_snapshot(
    chat: Chat,
    token: uuid.UUID,
    variant: ModelVariant,
    user_tokens: int,
    *,
    first: MemorySnapshot | None = None,
    opens_turn: bool = True,
) -> Bounded:
    """The memory snapshot to build the context from (``first``, when the caller has read it
    since claiming the slot ``token``), folding first when the context with the new message
    would exceed the policy's hard bound."""
    policy = policy_for_chat(chat)
    # Waiting for folds in flight (each commit is re-read) is bounded in time, not in count: a
    # background fold may free less than this turn needs, and the next one is waited for too.
    started = time.monotonic()
    wait_deadline = started + settings.MEMORY_LLM_TIMEOUT_SECONDS
    # The turn's own folding is bounded too, within its slot's lifetime: no summarizer chunk
    # starts that could not end by then, and the slot is renewed before each one.
    fold_deadline = turn_fold_deadline(started)
    slot = TurnSlotLease(chat, token)
    folds = 0
    waited_ms: int | None = None
    snapshot = first if first is not None else snapshot_of_live_chat(chat)
    while folds < SYNC_FOLD_ATTEMPTS:
        state = engine_state(chat, snapshot, variant.context_tokens)
        pre_turn = engine.decide_before_turn(state, policy, user_tokens, opens_turn=opens_turn)
        if not pre_turn.fits:
            raise ContextOverBound(too_big_message(opens_turn), retryable=False)
        if pre_turn.fold is None:
            return Bounded(snapshot, history_tokens(state), waited_ms)
        if folds and not time_for_a_chunk(fold_deadline):
            # The turn folded what its deadline allowed, and that is not enough: what it folded
            # stays, and a retry (or the chat's background fold) goes on from there.
            raise ContextOverBound(
                "The memory fold needed before this turn is longer than a turn may wait; what "
                "was folded is kept and nothing was stored: retry to continue."
            )
        asked = time.monotonic()
        outcome = fold_before_turn(
            chat,
            snapshot,
            pre_turn.fold,
            prompt_tokens(state, user_tokens),
            wait_deadline=wait_deadline,
            deadline=fold_deadline,
            slot=slot,
        )
        if outcome.status == FoldStatus.FAILED:
            raise ContextOverBound(
                "Memory consolidation is needed before this turn and it failed "
                f"({outcome.error}); nothing was stored, retry later."
            )
        folds += outcome.status != FoldStatus.WAITED
        if outcome.status == FoldStatus.WAITED:
            waited_ms = (waited_ms or 0) + round((time.monotonic() - asked) * 1000)
        # succeeded, superseded, or waited for a fold in flight: re-read and check again
        renew_turn_slot(chat, token)
        snapshot = snapshot_of_live_chat(chat)
    raise ContextOverBound("The context could not be brought within its bound; retry later.")


def too_big_message(opens_turn: bool) -> str:
    if opens_turn:
        return (
            "This message does not fit the chat's context bound even after folding the whole "
            "history into the summary; send a shorter message."
        )
    # Folding part of the turn would send these results without the calls they answer.
    return (
        "These tool results and the turn they continue do not fit the chat's context bound, "
        "and a turn is never split by a fold; start a new turn with a user message, or use a "
        "policy with a larger bound."
    )


def snapshot_of_live_chat(chat: Chat) -> MemorySnapshot:
    """Chat.DoesNotExist (the turn's 404 ``chat_deleted``) when the chat was deleted since the
    claim: its brief went with it, and a missing brief is otherwise a bug's 500."""
    try:
        return load_snapshot(chat.pk)
    except Brief.DoesNotExist:
        raise_if_deleted(chat)
        raise
