"""The chat turn (DESIGN §3): claim the chat's turn slot, make sure the context is within the
policy's bound (folding synchronously if background folding fell behind), call the model, then
store the user message and the reply together in one transaction and queue the consolidation
check after commit. A turn that fails stores nothing."""

import logging
import uuid
from dataclasses import dataclass
from datetime import timedelta
from functools import partial

from django.conf import settings
from django.db import transaction
from django.db.models import Q
from django.utils import timezone

from conversations.llm import ChatCompletion, ModelError
from conversations.models import Chat, Message, Role
from conversations.services.backends import get_chat_model
from conversations.services.context import build_model_messages
from conversations.services.variants import ModelVariant, resolve_variant
from memory_worker import policy as engine
from memory_worker.consolidation import decide_for_chat, execute_fold
from memory_worker.dispatch import request_consolidation
from memory_worker.policies import policy_for_chat
from memory_worker.state import MemorySnapshot, engine_state, load_snapshot, with_appended
from memory_worker.tokens import count_tokens

log = logging.getLogger("chatmem.turn")

SYNC_FOLD_ATTEMPTS = 3


class TurnInProgress(Exception):
    pass


class ContextOverBound(Exception):
    """The context cannot be brought within the policy's bound right now (the synchronous fold
    failed, or even a full fold would not fit). Nothing is dropped: the turn is refused."""


@dataclass(frozen=True)
class TurnResult:
    user_message: Message
    assistant_message: Message


def claim_turn_slot(chat: Chat) -> uuid.UUID:
    """One turn at a time per chat: a conditional UPDATE, so two requests cannot both win. A slot
    older than TURN_SLOT_STALE_SECONDS belonged to a process that died mid-turn."""
    token = uuid.uuid4()
    now = timezone.now()
    stale_before = now - timedelta(seconds=settings.TURN_SLOT_STALE_SECONDS)
    claimed = (
        Chat.objects.filter(pk=chat.pk)
        .filter(Q(turn_token__isnull=True) | Q(turn_started_at__lt=stale_before))
        .update(turn_token=token, turn_started_at=now)
    )
    if not claimed:
        raise TurnInProgress("Another turn of this chat is in progress; retry when it completes.")
    return token


def release_turn_slot(chat: Chat, token: uuid.UUID) -> None:
    Chat.objects.filter(pk=chat.pk, turn_token=token).update(turn_token=None, turn_started_at=None)


def run_turn(
    chat: Chat, content: str, variant_name: str | None = None, metadata: dict | None = None
) -> TurnResult:
    variant = resolve_variant(variant_name or chat.model_variant or None)
    token = claim_turn_slot(chat)
    try:
        user_tokens = count_tokens(content, variant.model)
        snapshot = bounded_snapshot(chat, variant, user_tokens)
        messages = build_model_messages(chat, snapshot.summary, snapshot.unfolded, content)
        completion = get_chat_model().complete(messages, variant.model)
        return store_turn(
            chat, token, snapshot, content, user_tokens, completion, variant, metadata
        )
    finally:
        release_turn_slot(chat, token)


def bounded_snapshot(chat: Chat, variant: ModelVariant, user_tokens: int) -> MemorySnapshot:
    """The memory snapshot to build the context from, folding synchronously first when the
    context with the new message would exceed the policy's hard bound (seed 000 §7)."""
    policy = policy_for_chat(chat)
    for _attempt in range(SYNC_FOLD_ATTEMPTS):
        snapshot = load_snapshot(chat.pk)
        state = engine_state(chat, snapshot, variant.context_tokens)
        pre_turn = engine.decide_before_turn(state, policy, user_tokens)
        if not pre_turn.fits:
            raise ContextOverBound(
                "This message does not fit the chat's context bound even after folding the "
                "whole history into the summary; send a shorter message."
            )
        if pre_turn.fold is None:
            return snapshot
        log.info(
            "synchronous fold before the model call",
            extra={
                "event": "sync_fold",
                "chat_id": chat.pk,
                "from_seq": pre_turn.fold.from_seq,
                "to_seq": pre_turn.fold.to_seq,
                "prompt_tokens": engine.prompt_tokens(state, user_tokens),
            },
        )
        outcome = execute_fold(chat, snapshot, pre_turn.fold, now=timezone.now(), synchronous=True)
        if outcome.status == "failed":
            raise ContextOverBound(
                "Memory consolidation is needed before this turn and it failed "
                f"({outcome.error}); nothing was stored, retry later."
            )
        # succeeded or superseded (a background fold won): re-read and check again
    raise ContextOverBound("The context could not be brought within its bound; retry later.")


def store_turn(
    chat: Chat,
    token: uuid.UUID,
    snapshot: MemorySnapshot,
    content: str,
    user_tokens: int,
    completion: ChatCompletion,
    variant: ModelVariant,
    metadata: dict | None,
) -> TurnResult:
    reply = completion.content
    reply_tokens = count_tokens(reply, variant.model)
    with transaction.atomic():
        # The row lock serialises seq allocation: seq order is commit order, no gaps.
        locked = Chat.objects.select_for_update().only("last_seq", "turn_token").get(pk=chat.pk)
        first_seq = locked.last_seq + 1
        user_message, assistant_message = Message.objects.bulk_create(
            [
                Message(
                    chat_id=chat.pk,
                    seq=first_seq,
                    role=Role.USER,
                    content=content,
                    token_count=user_tokens,
                    metadata=metadata or {},
                ),
                Message(
                    chat_id=chat.pk,
                    seq=first_seq + 1,
                    role=Role.ASSISTANT,
                    content=reply,
                    token_count=reply_tokens,
                    model_variant=variant.name,
                    metadata={
                        "model": completion.model,
                        "finish_reason": completion.finish_reason,
                        "prompt_tokens": completion.prompt_tokens,
                        "completion_tokens": completion.completion_tokens,
                    },
                ),
            ]
        )
        Chat.objects.filter(pk=chat.pk).update(
            last_seq=first_seq + 1, turn_token=None, turn_started_at=None, updated_at=timezone.now()
        )
        after = with_appended(snapshot, [user_message, assistant_message])
        transaction.on_commit(partial(queue_consolidation_if_due, chat, after))
    return TurnResult(user_message, assistant_message)


def queue_consolidation_if_due(chat: Chat, snapshot: MemorySnapshot) -> None:
    """Runs after commit, on the request thread but after the turn is durable: a pure decision
    on state already in memory, then (only if a fold is due) one enqueue that never raises."""
    try:
        if decide_for_chat(chat, snapshot, "turn", timezone.now()) is not None:
            request_consolidation(chat.pk, "turn")
    except Exception:
        log.exception("post-turn consolidation check failed", extra={"chat_id": chat.pk})


__all__ = ["ContextOverBound", "ModelError", "TurnInProgress", "TurnResult", "run_turn"]
