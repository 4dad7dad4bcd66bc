"""chatmem's memory controls on /v1/chat/completions (docs/openai-compatible.md, "Memory
controls"): a ``chatmem`` object in the request body, which the OpenAI SDKs send with
``extra_body={"chatmem": {...}}``, and the memory's state in the answer's ``chatmem`` object.

    {"pin": "text",                     # pinned (counted in the bound; 400 if it cannot fit)
     "fold": "now" | "pause" | "resume",
     "policy": "contract", "policy_overrides": {...}}   # a new conversation's memory

Everything is checked before anything is applied, and the controls apply before the turn (a
pin is in this turn's context); a turn that then fails leaves them applied."""

import contextlib
from collections.abc import Iterator, Mapping
from dataclasses import dataclass, field
from typing import Any

from rest_framework import status

from conversations.api.openai_request import OpenAIError
from conversations.models import Chat
from conversations.services import chats as chat_service
from conversations.services import pins
from memory_worker.memory import ManualRequest, request_manual_fold

CONTROL_KEYS = ("pin", "fold", "policy", "policy_overrides")
FOLD_VALUES = ("now", "pause", "resume")


@dataclass(frozen=True)
class Controls:
    pin: str | None = None
    fold: str | None = None
    policy: str | None = None
    policy_overrides: dict[str, object] | None = None
    # What applying them did, for the answer's chatmem object.
    applied: dict[str, Any] = field(default_factory=dict)
    added_pins: list[int] = field(default_factory=list)  # taken back if the request fails


def controls_of(body: Mapping[str, Any]) -> Controls:
    """The request's ``chatmem`` object, checked: unknown keys and wrong types are a 400, as for
    the REST API (a misspelt control silently ignored would do nothing the client asked)."""
    raw = body.get("chatmem")
    if raw is None:
        return Controls()
    if not isinstance(raw, dict):
        raise OpenAIError("chatmem must be an object.", param="chatmem")
    unknown = sorted(str(key) for key in raw if key not in CONTROL_KEYS)
    if unknown:
        raise OpenAIError(
            f"Unknown chatmem key {', '.join(unknown)}; the keys are {', '.join(CONTROL_KEYS)}.",
            param=f"chatmem.{unknown[0]}",
        )
    pin, fold = raw.get("pin"), raw.get("fold")
    policy, overrides = raw.get("policy"), raw.get("policy_overrides")
    if pin is not None and (not isinstance(pin, str) or not pin.strip()):
        raise OpenAIError("chatmem.pin must be a non-empty string.", param="chatmem.pin")
    if fold is not None and fold not in FOLD_VALUES:
        raise OpenAIError(
            f"chatmem.fold must be one of {', '.join(FOLD_VALUES)}.", param="chatmem.fold"
        )
    if policy is not None and not isinstance(policy, str):
        raise OpenAIError("chatmem.policy must be a preset's name.", param="chatmem.policy")
    if overrides is not None and not isinstance(overrides, dict):
        raise OpenAIError(
            "chatmem.policy_overrides must be an object of knobs and their values.",
            param="chatmem.policy_overrides",
        )
    return Controls(pin, fold, policy, overrides)


def check_settings_match(chat: Chat, controls: Controls) -> None:
    """``policy`` and ``policy_overrides`` choose a new conversation's memory; sent again with
    later requests they must say the same (an existing chat's are changed with PATCH
    /api/v1/chats/{id}/, which re-checks them)."""
    if controls.policy is not None and controls.policy != chat.policy:
        raise OpenAIError(
            f'This conversation exists with policy "{chat.policy}"; chatmem.policy applies to '
            f"a new conversation. Change it with PATCH /api/v1/chats/{chat.pk}/.",
            param="chatmem.policy",
        )
    if controls.policy_overrides is not None and controls.policy_overrides != (
        chat.policy_overrides or {}
    ):
        raise OpenAIError(
            "This conversation exists with other policy_overrides; chatmem.policy_overrides "
            f"applies to a new conversation. Change them with PATCH /api/v1/chats/{chat.pk}/.",
            param="chatmem.policy_overrides",
        )


@contextlib.contextmanager
def conversation_gone() -> Iterator[None]:
    """A conversation deleted while its controls applied: 404, as the REST API answers."""
    try:
        yield
    except Chat.DoesNotExist as error:
        raise OpenAIError(
            "The conversation was deleted meanwhile.", status.HTTP_404_NOT_FOUND, code="not_found"
        ) from error


def apply_pin(chat: Chat, controls: Controls, user: Any) -> None:
    """The pin, first of the controls: one that does not fit is a 400 naming the room left,
    and nothing of the request is applied before it."""
    if controls.pin is None:
        return
    try:
        pin = pins.add_pin(chat, text=controls.pin, user=user)
    except pins.PinRefused as error:
        raise OpenAIError(str(error), param="chatmem.pin", code="pin_refused") from error
    controls.applied["pinned"] = True
    controls.added_pins.append(pin.pk)


def apply_controls(chat: Chat, controls: Controls) -> Chat:
    """After apply_pin: pauses or resumes folds, or asks for a fold; returns the chat as it
    now is."""
    if controls.fold in ("pause", "resume"):
        paused = controls.fold == "pause"
        if chat.folds_paused != paused:
            chat = chat_service.update_chat(chat.owner_id, chat.pk, {"folds_paused": paused})
    elif controls.fold == "now":
        # The REST endpoint's judgement: nothing to fold is answered, one queued fold at a time.
        answer = request_manual_fold(chat.pk)
        if answer == ManualRequest.NOT_QUEUED:
            # A request answered 503 applies nothing: the client retries it whole, pin and all.
            for pin_id in controls.added_pins:
                pins.remove_pin(chat, pin_id)
            raise OpenAIError(
                "The fold could not be queued (the task broker is unavailable); nothing was "
                "sent to the model and nothing applied. Retry later, or send the turn without "
                "chatmem.fold.",
                status.HTTP_503_SERVICE_UNAVAILABLE,
                param="chatmem.fold",
                code="not_queued",
            )
        controls.applied["fold_queued"] = answer != ManualRequest.NOTHING_TO_FOLD
        controls.applied["fold"] = str(answer)
    return chat


def memory_of(chat: Chat, controls: Controls) -> dict[str, Any]:
    """The answer's memory state: summary version, unfolded count, degraded, paused."""
    return {**chat_service.memory_status(chat.pk), **controls.applied}
