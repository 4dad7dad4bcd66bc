"""Sending a turn's context to the chat model (DESIGN §3 step 5), at once or streamed, with the
thread's database connection given up while the model talks."""

from collections.abc import Callable

from django.db import connections

from conversations.llm import ChatCompletion, ModelError, ModelMessages
from conversations.services.backends import get_chat_model
from conversations.variants import ModelVariant

# How a turn calls the model: messages, variant -> the complete reply (or ModelError).
ModelCall = Callable[[ModelMessages, ModelVariant], ChatCompletion]


def call_model_at_once(messages: ModelMessages, variant: ModelVariant) -> ChatCompletion:
    release_pooled_connection()
    return get_chat_model().complete(messages, variant.model)


def stream_model(
    messages: ModelMessages, variant: ModelVariant, emit: Callable[[str], None]
) -> ChatCompletion:
    """Stream the reply, emitting each delta as it arrives; return the complete reply (the
    whole of it within the model's deadline: conversations.llm)."""
    release_db_connection()  # held by nobody while the model talks; the store reconnects
    stream = get_chat_model().stream(messages, variant.model)
    try:
        for delta in stream:
            emit(delta)
    finally:
        stream.close()
    if stream.result is None:  # exhausted streams always have one; guard the invariant
        raise ModelError("The model's reply stream ended before the reply was complete.")
    return stream.result


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
