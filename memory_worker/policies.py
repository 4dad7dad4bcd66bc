"""A chat's effective policy: its preset, then the operator's environment knobs for that preset,
then the chat's own overrides (most specific wins)."""

import json
from functools import lru_cache

from django.conf import settings

from conversations.models import Chat
from conversations.services.variants import resolve_variant
from memory_worker import policy as engine
from memory_worker.presets import resolve_policy


def env_overrides(preset: str) -> dict[str, object]:
    return dict(settings.MEMORY_PRESET_ENV_OVERRIDES.get(preset, {}))


@lru_cache(maxsize=256)
def _resolve(preset: str, overrides_json: str) -> engine.Policy:
    return resolve_policy(preset, json.loads(overrides_json))


def effective_policy(preset: str, chat_overrides: dict[str, object] | None = None) -> engine.Policy:
    merged = {**env_overrides(preset), **(chat_overrides or {})}
    return _resolve(preset, json.dumps(merged, sort_keys=True))


def policy_for_chat(chat: Chat) -> engine.Policy:
    return effective_policy(chat.policy, chat.policy_overrides)


def variant_context_tokens(chat: Chat) -> int:
    return resolve_variant(chat.model_variant or None).context_tokens
