"""Sending a turn's context to the chat model (docs/design.md, the turn, step 5), at once or
streamed, with the thread's database connection given up while the model talks, and the reply's
output limit."""

import json
from collections.abc import Callable

from django.conf import settings
from django.db import connections

from conversations.chat_model.contract import (
    PROMPT_CACHE_KEY,
    ChatCompletion,
    ModelError,
    ModelMessages,
    ToolOptions,
)
from conversations.chat_model.tokens import count_tokens
from conversations.chat_model.transport import LIMIT_KEYS
from conversations.models import Chat
from conversations.services.chat_backend import get_chat_model
from conversations.variants import ModelVariant
from memory_worker.engine.state import prompt_tokens
from memory_worker.memory import MemorySnapshot, engine_state

# How a turn calls the model: messages, variant, request options -> the complete reply (or
# ModelError).
ModelCall = Callable[[ModelMessages, ModelVariant, ToolOptions], ChatCompletion]

# CHAT_MAX_REPLY_TOKENS=0: a quarter of the window, at most this. The prompt may take up to 90 %
# of the window (policy.PROMPT_WINDOW_SHARE); a reply rarely needs more than a few pages.
DEFAULT_REPLY_TOKENS = 4096
DEFAULT_REPLY_WINDOW_SHARE = 0.25
# The key the reply's limit travels under to the ChatModel; the OpenAI model sends it in the
# field its endpoint honours (OPENAI_TOKEN_LIMIT_FIELD).
REPLY_LIMIT_KEY = "max_completion_tokens"


def call_model_at_once(
    messages: ModelMessages, variant: ModelVariant, options: ToolOptions
) -> ChatCompletion:
    release_pooled_connection()
    return get_chat_model().complete(messages, variant.model, options)


def stream_model(
    messages: ModelMessages,
    variant: ModelVariant,
    options: ToolOptions,
    emit: Callable[[str], None],
) -> ChatCompletion:
    """Stream the reply, emitting each delta as it arrives; return the complete reply (the
    whole of it within the model's deadline: conversations.chat_model.contract)."""
    release_db_connection()  # held by nobody while the model talks; the store reconnects
    stream = get_chat_model().stream(messages, variant.model, options)
    try:
        for delta in stream:
            emit(delta)
    finally:
        stream.close()
    if stream.result is None:  # exhausted streams always have one; guard the invariant
        raise ModelError("The model's reply stream ended before the reply was complete.")
    return stream.result


def turn_prompt_tokens(
    chat: Chat, snapshot: MemorySnapshot, variant: ModelVariant, new_tokens: int
) -> int:
    """The prompt of a turn built from ``snapshot`` with ``new_tokens`` of new messages, as the
    bound counts it."""
    return prompt_tokens(engine_state(chat, snapshot, variant.context_tokens), new_tokens)


def reply_options(
    variant: ModelVariant, prompt: int, options: ToolOptions | None = None, *, chat_id: int
) -> dict[str, object]:
    """The request's ``options`` (a /v1 client's) with the reply's output limit in
    REPLY_LIMIT_KEY alone: CHAT_MAX_REPLY_TOKENS (0: its default for the variant's window), or
    the client's own ``max_tokens`` / ``max_completion_tokens`` when smaller, and never more
    than the window has left after the ``prompt`` and the tools offered; and the chat's
    ``prompt_cache_key`` for a variant it is sent to (``cache_routing``)."""
    given = dict(options or {})
    limits = [reply_tokens_setting(variant)]
    limits += [value for key in LIMIT_KEYS if isinstance(value := given.get(key), int)]
    tools = given.get("tools")
    offered = count_tokens(json.dumps(tools), variant.model) if tools else 0
    limits.append(variant.context_tokens - prompt - offered)
    limited = {key: value for key, value in given.items() if key not in LIMIT_KEYS}
    limited[REPLY_LIMIT_KEY] = max(1, min(limits))
    return {**limited, **cache_routing(chat_id, variant)}


def cache_routing(chat_id: int, variant: ModelVariant) -> dict[str, object]:
    """OpenAI's ``prompt_cache_key``, one per chat: the provider routes a chat's requests to
    the machines that hold its prefix cached (PROMPT_CACHE_KEY_VARIANTS: the variants it is
    sent to, ``*`` every one). An endpoint that refuses the parameter is asked again without
    it and never sent it again (conversations.chat_model.openai_backend)."""
    wanted = {name.strip() for name in settings.PROMPT_CACHE_KEY_VARIANTS.split(",")}
    if "*" in wanted or variant.name in wanted:
        return {PROMPT_CACHE_KEY: f"chatmem-chat-{chat_id}"}
    return {}


def reply_tokens_setting(variant: ModelVariant) -> int:
    configured = int(settings.CHAT_MAX_REPLY_TOKENS)
    if configured > 0:
        return configured
    return max(
        1, min(DEFAULT_REPLY_TOKENS, int(variant.context_tokens * DEFAULT_REPLY_WINDOW_SHARE))
    )


def release_pooled_connection() -> None:
    """Before waiting on the model: the pooled connection goes back to the pool, otherwise a pool
    of N connections caps a process at N turns in flight however many threads it has. Not
    without a pool, where closing would mean a new PostgreSQL connection (a process fork) on
    every turn."""
    if connection_is_pooled():
        release_db_connection()


def connection_is_pooled() -> bool:
    return bool(connections["default"].settings_dict.get("OPTIONS", {}).get("pool"))


def release_db_connection() -> None:
    """Close this thread's database connection unless a transaction needs it: a streamed reply
    lasts as long as the model talks, and every open stream would otherwise hold a PostgreSQL
    connection for its whole length, not just for its few queries."""
    connection = connections["default"]
    if not connection.in_atomic_block:
        connection.close()
