"""Creating and reading chats and their memory state."""

import logging
from dataclasses import dataclass
from datetime import datetime
from functools import partial

from django.conf import settings
from django.contrib.auth.models import User
from django.db import transaction
from django.db.models import Max
from django.db.models.functions import Coalesce

from conversations import rows
from conversations.chat_model.tokens import count_tokens
from conversations.models import Brief, Chat, Message
from conversations.services.context import build_model_messages
from conversations.services.pins import pins_problem, recount_pins
from conversations.variants import ModelVariant, resolve_variant
from memory_worker.engine import policy as engine
from memory_worker.engine.presets import PolicyError
from memory_worker.engine.state import PROMPT_PRIMING_TOKENS, ROLE_OVERHEAD_TOKENS
from memory_worker.memory import (
    MemorySnapshot,
    RequestReason,
    breaker_open,
    decide_for_chat,
    effective_policy,
    load_snapshot,
    policy_for_new_settings,
    request_chat_lock,
    request_fold,
    trip_if_timeout,
)

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
    prompt = settings.CHATMEM_DEFAULT_SYSTEM_PROMPT if system_prompt is None else system_prompt
    chat = Chat(
        owner=owner,
        title=title,
        system_prompt=prompt,
        policy=preset,
        policy_overrides=overrides,
        model_variant=model_variant,
    )
    validate_chat_settings(chat)
    with transaction.atomic():
        save_chat(chat)
    return chat


# What an owner may change through the API (PATCH): EDITABLE_FIELDS less the owner and the
# OpenAI-compatible name, which only the admin edits.
API_EDITABLE_FIELDS = (
    "title",
    "system_prompt",
    "policy",
    "policy_overrides",
    "model_variant",
    "folds_paused",
)


# The settings that size the room a chat keeps for its pins.
ROOM_FIELDS = frozenset({"policy", "policy_overrides", "system_prompt", "model_variant"})


def update_chat(owner_id: int, chat_id: int, changes: dict[str, object]) -> Chat:
    """Applies ``changes`` (API_EDITABLE_FIELDS) to the owner's chat with the checks creation
    makes, on the row as it is now (locked, so two edits cannot each pass the checks and
    combine into a chat that fails them), or stores nothing: Chat.DoesNotExist, PolicyError,
    NoRoomInWindow, UnknownVariant. The brief is not touched: W and the summary stay valid, and
    a new policy applies from the chat's next fold decision."""
    unknown = set(changes) - set(API_EDITABLE_FIELDS)
    if unknown:
        raise ValueError(f"not editable: {sorted(unknown)}")
    with transaction.atomic():
        chat = Chat.objects.select_for_update().get(pk=chat_id, owner_id=owner_id)
        if not changes:
            return chat
        resumed = chat.folds_paused and changes.get("folds_paused") is False
        for field, value in changes.items():
            setattr(chat, field, value)
        validate_chat_settings(chat)
        save_chat(chat)
        # Checked on the saved row (the prompt recounted); refused, the transaction undoes it.
        problem = pins_problem(chat) if ROOM_FIELDS & set(changes) else None
        if problem:
            raise PolicyError(problem)
        if resumed:
            # What fell due while paused is folded now, not at the next turn or cooldown.
            transaction.on_commit(partial(request_fold, chat.pk, RequestReason.RERUN))
    return chat


EDITABLE_FIELDS = (
    "title",
    "owner",
    "external_id",
    "system_prompt",
    "policy",
    "policy_overrides",
    "model_variant",
    "folds_paused",
)


@dataclass(frozen=True)
class ChatListing:
    id: int
    title: str
    messages: int
    last_activity: datetime  # its newest message's time, else the chat's own


def chats_of(user: User) -> list[ChatListing]:
    """A user's chats, the most recently active first (a turn does not change ``updated_at``)."""
    rows = (
        Chat.objects.filter(owner=user)
        .annotate(last_activity=Coalesce(Max("messages__created_at"), "updated_at"))
        .order_by("-last_activity", "-pk")
        .values_list("pk", "title", "last_seq", "last_activity")
    )
    return [ChatListing(*row) for row in rows]


def validate_chat_settings(chat: Chat) -> None:
    """Raises PolicyError (NoRoomInWindow for the system prompt) or UnknownVariant, with the
    reason, for a chat whose turns would fail."""
    if not isinstance(chat.policy_overrides, dict):
        raise PolicyError("policy_overrides must be an object of knobs and their values.")
    policy = policy_for_new_settings(chat.policy, chat.policy_overrides or {})
    variant = resolve_variant(chat.model_variant or None)
    problem = room_problem(chat.system_prompt, policy.summary_token_cap, variant)
    # Refused only when the chat's own choices cause it: a deployment whose defaults leave no
    # room is the operator's to fix (a start-up warning, chatmem.W001), not every client's 400.
    if problem and operator_defaults_room_problem(chat.policy) is None:
        raise NoRoomInWindow(problem)


class NoRoomInWindow(PolicyError):
    """The system prompt and the summary cap leave the conversation too little of the window."""


# Of what a turn may send the model (PROMPT_WINDOW_SHARE of the window), the share that must be
# left for the conversation once the system prompt and a summary at its cap are in: what folding
# can make room in. Without it every turn of the chat, once it has to fold, would be a 503 (a
# summary cap, or a system prompt, nearly as large as the model's window).
MIN_CONVERSATION_SHARE = 0.25


def room_problem(system_prompt: str, summary_cap: int, variant: ModelVariant) -> str | None:
    window = int(engine.PROMPT_WINDOW_SHARE * variant.context_tokens)
    prompt = count_tokens(system_prompt, variant.model) if system_prompt else 0
    fixed = PROMPT_PRIMING_TOKENS + prompt + summary_cap + 2 * ROLE_OVERHEAD_TOKENS
    if window - fixed >= MIN_CONVERSATION_SHARE * window:
        return None
    return (
        f"The system prompt ({prompt} tokens) and a summary at its cap ({summary_cap} tokens) "
        f'take {fixed} of the {window} tokens a turn may send model variant "{variant.name}" '
        f"({variant.context_tokens}-token window); at least a quarter must be left for the "
        "conversation. Shorten the system prompt, lower summary_token_cap, or choose a variant "
        "with a larger window."
    )


def operator_defaults_room_problem(preset: str) -> str | None:
    """room_problem for a chat made of the operator's defaults alone: the default system
    prompt, the preset with the environment's knobs, the default variant."""
    return room_problem(
        settings.CHATMEM_DEFAULT_SYSTEM_PROMPT,
        effective_policy(preset).summary_token_cap,
        resolve_variant(None),
    )


def save_chat(chat: Chat) -> None:
    """Saves a validated chat, new or edited (the admin): the system prompt's and the pins'
    stored token counts follow its text and variant (every bound counts them), and a new chat
    gets its brief, which every turn reads. Call inside a transaction."""
    variant = resolve_variant(chat.model_variant or None)
    prompt = chat.system_prompt
    chat.system_prompt_tokens = count_tokens(prompt, variant.model) if prompt else 0
    if chat._state.adding:
        chat.save()
        # Database time: until the first fold a policy's cooldown counts from the chat's
        # creation, judged by workers and sweeps on other hosts, whose clocks differ.
        chat.created_at = chat.updated_at = rows.database_now()
        Chat.objects.filter(pk=chat.pk).update(
            created_at=chat.created_at, updated_at=chat.created_at
        )
        Brief.objects.create(chat=chat)
        return
    # Locked before the pins are recounted, so a pin added meanwhile is counted after the change.
    stored = Chat.objects.select_for_update().filter(pk=chat.pk)
    stored_variant = stored.values_list("model_variant", flat=True).first()
    # Only what an editor may change: the counter, the turn slot and the rest belong to turns,
    # which may have moved them since this instance was read.
    chat.save(update_fields=[*EDITABLE_FIELDS, "system_prompt_tokens", "updated_at"])
    if stored_variant != chat.model_variant:
        # The pins' stored counts were the old model's; the bound must count the new one's.
        recount_pins(chat)


@dataclass(frozen=True)
class MemoryView:
    snapshot: MemorySnapshot
    pending: bool
    unfolded: int
    # The RunningSummary view (docs/policies.md, token-budget) names the last summarized message
    # by id; with contiguous seqs the summarized messages are exactly seq 1..W.
    last_summarized_message_id: int | None


def memory_view(chat: Chat) -> MemoryView:
    snapshot = load_snapshot(chat.pk)
    due = decide_for_chat(chat, snapshot, rows.database_now()) is not None
    watermark = snapshot.last_consolidated
    last_id = (
        Message.objects.filter(chat=chat, seq=watermark).values_list("id", flat=True).first()
        if watermark
        else None
    )
    return MemoryView(snapshot, due or _rerun_marked(chat.pk), len(snapshot.unfolded), last_id)


# A fold or an edit committing between the brief's read and the view's comes once in a blue
# moon; three in a row while a person reads the brief is a chat folding without pause.
CONSISTENT_READS = 3


def brief_and_view(chat: Chat) -> tuple[Brief, MemoryView]:
    """The brief and its memory view from the same version: read apart, a fold committing
    between them would pair the new version's ETag with the old summary. Raises
    Brief.DoesNotExist when the chat is gone."""
    for _ in range(CONSISTENT_READS):
        brief = Brief.objects.get(chat=chat)
        view = memory_view(chat)
        if view.snapshot.version == brief.version:
            return brief, view
    # Still moving: what the ETag names is the view's version, so the summary is the view's.
    brief.version, brief.summary = view.snapshot.version, view.snapshot.summary
    brief.last_consolidated = view.snapshot.last_consolidated
    return brief, view


def _rerun_marked(chat_id: int) -> bool:
    # Reading memory state must not fail or wait because Redis does: the flag is then unknown
    # (False), and after a timeout not asked for while the breaker is open.
    if breaker_open():
        return False
    try:
        return request_chat_lock().is_pending(chat_id)
    except Exception as error:
        trip_if_timeout(error)
        log.warning("could not read the pending flag", extra={"chat_id": chat_id})
        return False


def memory_status(chat_id: int) -> dict[str, object]:
    """The memory's state in brief, as /v1 answers carry it: one query."""
    found = (
        Brief.objects.filter(chat_id=chat_id)
        .values_list(
            "version", "last_consolidated", "degraded", "chat__last_seq", "chat__folds_paused"
        )
        .first()
    )
    if found is None:  # deleted meanwhile
        return {}
    version, watermark, degraded, last_seq, paused = found
    return {
        "summary_version": version,
        "unfolded": last_seq - watermark,
        "degraded": degraded,
        "folds_paused": paused,
    }


def next_context(chat: Chat) -> list[dict[str, object]]:
    """Exactly what the model would receive for the next turn, before the new user message."""
    return build_model_messages(chat, load_snapshot(chat.pk))
