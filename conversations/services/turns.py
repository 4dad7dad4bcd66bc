"""The REST chat turn (docs/design.md, the turn), step by step: claim the chat's turn slot
(turn_slot), bound the context (bounded_context, context), call the model (turn_model), store both
messages in one transaction and queue the memory work after commit (turn_store). A turn that fails
stores nothing.

Two ways to run the same turn: ``run_turn`` answers when the reply is stored (the JSON API);
``start_streamed_turn`` runs it on its own thread and hands out its events as they happen
(turn_stream, server-sent events). Both go through ``complete_turn``; only the model call
differs."""

import logging
import uuid
from collections.abc import Callable
from functools import partial

from django.db import connections

from conversations.chat_model.contract import ModelError
from conversations.chat_model.tokens import count_tokens
from conversations.models import Chat, Role
from conversations.rows import database_unreachable
from conversations.services.bounded_context import ContextOverBound, bounded_snapshot
from conversations.services.context import build_model_messages
from conversations.services.turn_model import (
    ModelCall,
    call_model_at_once,
    reply_options,
    stream_model,
    turn_prompt_tokens,
)
from conversations.services.turn_slot import (
    Claimed,
    TurnInProgress,
    release_turn_slot,
    turn_slot,
)
from conversations.services.turn_store import TurnRequest, TurnResult, store_turn
from conversations.services.turn_stream import (
    StreamedTurn,
    TurnDone,
    TurnEvents,
    TurnFailed,
    start_turn_thread,
)
from conversations.variants import turn_variant
from memory_worker.memory import MemorySnapshot

log = logging.getLogger("chatmem.turn")

# A turn's failures the client is told about, with no bug behind them (no traceback logged): the
# model failed, the context could not be bounded, the slot was taken over during a long fold, the
# chat was deleted meanwhile.
EXPECTED_REFUSALS = (ModelError, ContextOverBound, TurnInProgress, Chat.DoesNotExist)


def log_turn_failure(what: str, error: BaseException, chat_id: int) -> None:
    """A failed turn in the log as what it is. Call it while handling ``error``: a refusal the
    client is told about is no news; a database out of reach is an outage (the client gets a
    503), a warning; anything else is a bug, with its traceback."""
    if isinstance(error, EXPECTED_REFUSALS):
        return
    if database_unreachable(error):
        log.warning("%s: database error: %s", what, error, extra={"chat_id": chat_id})
    else:
        log.exception(what, extra={"chat_id": chat_id})


def turn_request(
    chat: Chat,
    token: uuid.UUID,
    content: str,
    *,
    variant_name: str | None,
    metadata: dict | None,
) -> TurnRequest:
    """The turn's model variant (UnknownVariant if not configured), and the new message's tokens
    counted for that variant's model."""
    variant = turn_variant(variant_name, chat.model_variant)
    user_tokens = count_tokens(content, variant.model)
    return TurnRequest(chat, token, variant, content, user_tokens, metadata)


def run_turn(
    chat: Chat,
    content: str,
    *,
    variant_name: str | None = None,
    metadata: dict | None = None,
    claimed: Claimed | None = None,
) -> TurnResult:
    """``claimed``: the chat's claim when the caller has made it (claim_owned_chat)."""
    with turn_slot(chat, claimed.token if claimed else None) as slot:
        request = turn_request(chat, slot, content, variant_name=variant_name, metadata=metadata)
        snapshot = claimed.snapshot if claimed else None
        return complete_turn(request, call_model_at_once, snapshot=snapshot)


def complete_turn(
    request: TurnRequest,
    call_model: ModelCall,
    *,
    snapshot: MemorySnapshot | None = None,
    on_stored: Callable[[TurnResult], None] | None = None,
) -> TurnResult:
    """Steps 3-7 of the turn (docs/design.md), with the turn slot already claimed by the caller
    (``snapshot``: the memory snapshot read since the claim, if any)."""
    chat = request.chat
    bounded = bounded_snapshot(
        chat, request.token, request.variant, request.user_tokens, first=snapshot
    )
    snapshot = bounded.snapshot
    messages = build_model_messages(
        chat, snapshot, [{"role": Role.USER.value, "content": request.content}]
    )
    prompt = turn_prompt_tokens(chat, snapshot, request.variant, request.user_tokens)
    options = reply_options(request.variant, prompt, chat_id=chat.pk)
    completion = call_model(messages, request.variant, options)
    return store_turn(request, bounded, completion, on_stored=on_stored)


def start_streamed_turn(
    chat: Chat,
    content: str,
    *,
    variant_name: str | None = None,
    metadata: dict | None = None,
    claimed: Claimed | None = None,
) -> StreamedTurn:
    """Claim the slot (unless the caller did: ``claimed``) and resolve the variant here, so
    TurnInProgress and UnknownVariant raise before any response has started (plain 4xx), then
    run the rest of the turn on its own thread (turn_stream says why)."""
    with turn_slot(chat, claimed.token if claimed else None) as slot:
        request = turn_request(chat, slot, content, variant_name=variant_name, metadata=metadata)
        events = TurnEvents()
        snapshot = claimed.snapshot if claimed else None
        thread = start_turn_thread(
            f"chatmem-turn-{chat.pk}", _run_streamed_turn, request, events, snapshot
        )
    return StreamedTurn(request, events, thread)


def _run_streamed_turn(
    request: TurnRequest, events: TurnEvents, snapshot: MemorySnapshot | None
) -> None:
    chat = request.chat
    announced: list[TurnResult] = []
    # A failure is told after the slot is freed: a client retrying as soon as it reads the error
    # would otherwise meet its own turn's slot (a 409).
    failure: TurnFailed | None = None

    def announce(result: TurnResult) -> None:
        announced.append(result)
        events.put(TurnDone(result))

    try:
        call_model = partial(stream_model, emit=events.put_delta)
        result = complete_turn(request, call_model, snapshot=snapshot, on_stored=announce)
    except Exception as error:
        if announced and not isinstance(error, EXPECTED_REFUSALS):
            # Stored and announced; only an after-commit hook failed.
            log.exception("after-commit hook of a streamed turn failed", extra={"chat_id": chat.pk})
        else:
            log_turn_failure("streamed turn failed", error, chat.pk)
            failure = TurnFailed(error)
    else:
        if not announced:  # inside an outer transaction (tests): on_commit has not run yet
            events.put(TurnDone(result))
    finally:
        try:
            release_turn_slot(chat, request.token)  # the store freed it when it succeeded
        finally:
            if failure is not None:  # whatever happened above: the stream must get its end
                events.put(failure)
            # This thread's own database connection: it would otherwise stay open until the
            # garbage collector finds the dead thread's connection handler.
            connections.close_all()
