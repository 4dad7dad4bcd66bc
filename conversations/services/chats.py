"""Creating and reading chats and their memory state."""

import logging
from dataclasses import dataclass

from django.conf import settings
from django.contrib.auth.models import User
from django.db import transaction
from django.utils import timezone

from conversations.models import Brief, Chat, Message
from conversations.services.context import build_model_messages
from conversations.services.variants import resolve_variant
from memory_worker.consolidation import decide_for_chat
from memory_worker.policies import effective_policy
from memory_worker.runtime import chat_lock
from memory_worker.state import MemorySnapshot, load_snapshot
from memory_worker.tokens import count_tokens

log = logging.getLogger("chatmem.chats")

MAX_SYSTEM_PROMPT_CHARS = 20000


def create_chat(
    owner: User,
    *,
    title: str = "",
    system_prompt: str | None = None,
    policy: str | None = None,
    policy_overrides: dict[str, object] | None = None,
    model_variant: str = "",
) -> Chat:
    """Validates everything before writing, so a bad request stores nothing."""
    preset = policy or settings.MEMORY_POLICY
    overrides = policy_overrides or {}
    effective_policy(preset, overrides)  # raises PolicyError with the reason
    variant = resolve_variant(model_variant or None)  # raises UnknownVariant
    prompt = settings.CHATMEM_DEFAULT_SYSTEM_PROMPT if system_prompt is None else system_prompt
    with transaction.atomic():
        chat = Chat.objects.create(
            owner=owner,
            title=title,
            system_prompt=prompt,
            system_prompt_tokens=count_tokens(prompt, variant.model) if prompt else 0,
            policy=preset,
            policy_overrides=overrides,
            model_variant=model_variant,
        )
        Brief.objects.create(chat=chat)
    return chat


@dataclass(frozen=True)
class MemoryView:
    snapshot: MemorySnapshot
    pending: bool
    unfolded: int
    # Seed 002's RunningSummary names the last summarized message by id; with contiguous seqs the
    # summarized messages are exactly seq 1..W.
    last_summarized_message_id: int | None


def memory_view(chat: Chat) -> MemoryView:
    snapshot = load_snapshot(chat.pk)
    due = decide_for_chat(chat, snapshot, "check", timezone.now()) is not None
    watermark = snapshot.last_consolidated
    last_id = (
        Message.objects.filter(chat=chat, seq=watermark).values_list("id", flat=True).first()
        if watermark
        else None
    )
    return MemoryView(snapshot, due or _rerun_marked(chat.pk), len(snapshot.unfolded), last_id)


def _rerun_marked(chat_id: int) -> bool:
    # Reading memory state must not fail because Redis does: the flag is then unknown (False).
    try:
        return chat_lock().is_pending(chat_id)
    except Exception:
        log.warning("could not read the pending flag", extra={"chat_id": chat_id})
        return False


def next_context(chat: Chat) -> list[dict[str, object]]:
    """Exactly what the model would receive for the next turn, before the new user message."""
    snapshot = load_snapshot(chat.pk)
    return build_model_messages(
        chat, snapshot.summary, snapshot.unfolded, agent_context=snapshot.agent_context
    )
