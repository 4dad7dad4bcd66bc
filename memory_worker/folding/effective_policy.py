"""A chat's effective policy: its preset, then the operator's environment knobs for that preset,
then the chat's own overrides (most specific wins)."""

import json
import logging
from functools import lru_cache

from django.conf import settings

from conversations.chat_model.tokens import count_tokens
from conversations.models import Chat
from conversations.variants import chat_variant
from memory_worker import knobs
from memory_worker.engine import policy as engine
from memory_worker.engine.presets import PolicyError, resolve_policy, synchronous_only

log = logging.getLogger(__name__)


def env_overrides(preset: str) -> dict[str, object]:
    configured = settings.MEMORY_PRESET_ENV_OVERRIDES
    return dict((knobs.operator_overrides() if configured is None else configured).get(preset, {}))


@lru_cache(maxsize=256)
def _resolve(preset: str, overrides_json: str) -> engine.Policy:
    return resolve_policy(preset, json.loads(overrides_json))


def effective_policy(preset: str, chat_overrides: dict[str, object] | None = None) -> engine.Policy:
    merged = {**env_overrides(preset), **(chat_overrides or {})}
    return _resolve(preset, json.dumps(merged, sort_keys=True))


def policy_for_new_settings(preset: str, chat_overrides: dict[str, object]) -> engine.Policy:
    """The policy of a chat being created or edited; PolicyError when its overrides are
    unusable, including overrides that would leave every fold to the request path (a trigger
    at or past the hard bound). A configuration the operator chose is not refused here."""
    policy = effective_policy(preset, chat_overrides)
    problem = synchronous_only(policy)
    if problem and chat_overrides and synchronous_only(effective_policy(preset)) is None:
        raise PolicyError(problem)
    return policy


def policy_for_chat(chat: Chat) -> engine.Policy:
    """A stored chat's policy. Its overrides were checked against the operator's knobs when it
    was saved; knobs changed since (MEMORY_CONTEXT_SIZE=45 under a chat's tail_messages 50) can
    make the two inconsistent, and every turn, fold and read of that chat failed with a 500.
    Then the chat's own overrides win over the operator's knobs (most specific wins, as ever),
    and if even they clash with the preset, the operator's knobs alone (checked at start-up)
    apply; logged. An unknown preset still raises."""
    overrides = chat.policy_overrides or {}
    try:
        return effective_policy(chat.policy, overrides)
    except PolicyError as clash:
        _log_clash(chat.policy, overrides, str(clash))
    try:
        return _resolve(chat.policy, json.dumps(overrides, sort_keys=True))
    except PolicyError:
        return effective_policy(chat.policy)


_clashes_logged: set[tuple[str, str]] = set()


def _log_clash(preset: str, overrides: dict[str, object], error: str) -> None:
    # Once per process and combination: every turn and fold of such a chat resolves its policy.
    key = (preset, json.dumps({**env_overrides(preset), **overrides}, sort_keys=True))
    if key in _clashes_logged:
        return
    _clashes_logged.add(key)
    log.warning(
        "a chat's policy overrides clash with the environment's knobs",
        extra={"event": "policy_clash", "policy": preset, "error": error},
    )


def variant_context_tokens(chat: Chat) -> int:
    return chat_variant(chat.model_variant).context_tokens


def chat_tokens(chat: Chat, text: str) -> int:
    """``text`` as the chat's model counts it (its variant's; a variant since removed, the
    default's, as its turns run): a summary or a pin is part of every prompt that model is sent."""
    return count_tokens(text, chat_variant(chat.model_variant).model)
