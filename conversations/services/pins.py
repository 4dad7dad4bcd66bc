"""A chat's pins: texts and stored messages the user keeps verbatim in every context
(docs/policies.md, "Pins").

A pin counts in the policy's bound (memory_worker.pinned.pin_room), so one that does not fit
is refused and nothing is stored. The check and the insert hold the chat's row lock: two pins
added at once cannot each fit alone and together overrun the room."""

from dataclasses import replace
from functools import partial

from django.contrib.auth.models import AbstractBaseUser, AnonymousUser
from django.db import transaction

from conversations.models import Chat, Message, Pin
from conversations.services.turn_store import queue_fold_if_due
from memory_worker.memory import (
    MemorySnapshot,
    PinnedItem,
    chat_tokens,
    engine_state,
    load_snapshot,
    pin_room,
    pinned_block_tokens,
    pinned_message_text,
    policy_for_chat,
    variant_context_tokens,
)

MAX_PIN_CHARS = 20000


class PinRefused(ValueError):
    """A pin that cannot be added, with the reason; ``field`` names the input at fault and
    ``room_left`` the tokens still free for pins when it did not fit (None otherwise)."""

    def __init__(self, message: str, *, field: str, room_left: int | None = None) -> None:
        super().__init__(message)
        self.field = field
        self.room_left = room_left


def add_pin(
    chat: Chat,
    *,
    text: str | None = None,
    seq: int | None = None,
    user: AbstractBaseUser | AnonymousUser | None = None,
) -> Pin:
    """Pins ``text``, or the chat's stored message ``seq`` (exactly one), or raises PinRefused
    and stores nothing. Chat.DoesNotExist when the chat was deleted meanwhile."""
    if (text is None) == (seq is None):
        raise PinRefused('Send exactly one of "text" and "seq".', field="non_field_errors")
    with transaction.atomic():
        locked = Chat.objects.select_for_update().get(pk=chat.pk)
        if seq is None:
            field, content = "text", _checked_text(text or "")
        else:
            field, content = "seq", _message_text(locked, seq)
        tokens = pin_tokens(locked, content)
        snapshot = load_snapshot(locked.pk)
        if seq is not None and any(pin.seq == seq for pin in snapshot.pins):
            raise PinRefused(f"Message {seq} is already pinned.", field="seq")
        refuse_unless_room(locked, snapshot, [pin.tokens for pin in snapshot.pins], tokens, field)
        pin = Pin.objects.create(
            chat=locked,
            text=content,
            seq=seq,
            tokens=tokens,
            created_by_id=user.pk if user is not None and user.is_authenticated else None,
        )
        # Less room for the history now: a fold may be due.
        pinned = replace(snapshot, pins=(*snapshot.pins, PinnedItem(pin.pk, seq, content, tokens)))
        transaction.on_commit(partial(queue_fold_if_due, locked, pinned))
    return pin


def change_pin_text(chat: Chat, pin_id: int, text: str) -> Pin:
    """A pinned text rewritten (the admin), with add_pin's checks; a pinned message's text is
    its message's. Pin.DoesNotExist, PinRefused."""
    with transaction.atomic():
        locked = Chat.objects.select_for_update().get(pk=chat.pk)
        pin = Pin.objects.get(chat=locked, pk=pin_id)
        if pin.text == text:
            return pin
        if pin.seq is not None:
            raise PinRefused("A pinned message's text is its message's.", field="text")
        tokens = pin_tokens(locked, _checked_text(text))
        snapshot = load_snapshot(locked.pk)
        others = [item.tokens for item in snapshot.pins if item.id != pin.pk]
        refuse_unless_room(locked, snapshot, others, tokens, "text")
        pin.text, pin.tokens = text, tokens
        pin.save(update_fields=["text", "tokens"])
        changed = replace(
            snapshot,
            pins=tuple(
                item._replace(text=text, tokens=tokens) if item.id == pin.pk else item
                for item in snapshot.pins
            ),
        )
        transaction.on_commit(partial(queue_fold_if_due, locked, changed))
    return pin


def pin_tokens(chat: Chat, text: str) -> int:
    # A variant the operator removed counts with the default's model, as its turns run on it.
    return chat_tokens(chat, text)


def recount_pins(chat: Chat) -> None:
    """Each pin's stored count as the chat's model now counts it: the bound adds up the stored
    counts. Called in the transaction that changes the chat's variant, under its row lock."""
    found = list(Pin.objects.filter(chat=chat).only("id", "text", "tokens"))
    for pin in found:
        pin.tokens = pin_tokens(chat, pin.text)
    Pin.objects.bulk_update(found, ["tokens"])


def refuse_unless_room(
    chat: Chat, snapshot: MemorySnapshot, others: list[int], tokens: int, field: str
) -> None:
    """PinRefused unless the pinned block with ``others`` (the other pins' tokens) and a pin of
    ``tokens`` fits the room the chat's policy keeps for pins (pinned.pin_room)."""
    state = engine_state(chat, snapshot, variant_context_tokens(chat))
    room = pin_room(state, policy_for_chat(chat))
    used = pinned_block_tokens(others)
    needed = pinned_block_tokens([*others, tokens]) - used
    if used + needed > room:
        left = max(room - used, 0)
        raise PinRefused(
            f"This pin needs {needed} tokens of the chat's context and only {left} of the "
            f"{room} tokens kept for pins are left; unpin something, or pin a shorter text.",
            field=field,
            room_left=left,
        )


def _checked_text(text: str) -> str:
    if not text.strip():
        raise PinRefused("A pinned text cannot be blank.", field="text")
    if len(text) > MAX_PIN_CHARS:
        raise PinRefused(
            f"A pinned text is at most {MAX_PIN_CHARS} characters ({len(text)} sent).",
            field="text",
        )
    return text


def check_pins_fit(chat: Chat, texts: list[str]) -> None:
    """PinRefused unless pins of ``texts`` (all of the chat's, as an editor would leave them)
    fit the room its policy keeps for pins. The writes check again, under the chat's lock."""
    if not texts:
        return
    tokens = [pin_tokens(chat, text) for text in texts]
    refuse_unless_room(chat, load_snapshot(chat.pk), tokens[:-1], tokens[-1], "text")


def message_pin_text(chat: Chat, seq: int) -> str:
    """The text a pin of the chat's message ``seq`` shows; PinRefused when there is none."""
    return _message_text(chat, seq)


def _message_text(chat: Chat, seq: int) -> str:
    found = Message.objects.filter(chat=chat, seq=seq).values_list("role", "content").first()
    if found is None:
        raise PinRefused(
            f"This chat has no message {seq} (its messages are 1..{chat.last_seq}).", field="seq"
        )
    return pinned_message_text(*found)


def pins_problem(chat: Chat) -> str | None:
    """Why the chat's pins no longer fit the room its settings (as they are on ``chat`` now)
    keep for pins, or None: a policy or prompt change that would leave every turn refused."""
    tokens = list(Pin.objects.filter(chat=chat).values_list("tokens", flat=True))
    if not tokens:
        return None
    state = engine_state(chat, load_snapshot(chat.pk), variant_context_tokens(chat))
    room, used = pin_room(state, policy_for_chat(chat)), pinned_block_tokens(tokens)
    if used <= room:
        return None
    return (
        f"The chat's pins take {used} tokens and these settings keep only {room} for pins; "
        "unpin something first, or choose a larger bound."
    )


def list_pins(chat: Chat) -> list[Pin]:
    return list(Pin.objects.filter(chat=chat).order_by("id"))


def remove_pin(chat: Chat, pin_id: int) -> None:
    """Pin.DoesNotExist when the chat has no such pin."""
    deleted, _ = Pin.objects.filter(chat=chat, pk=pin_id).delete()
    if not deleted:
        raise Pin.DoesNotExist(f"chat {chat.pk} has no pin {pin_id}")
