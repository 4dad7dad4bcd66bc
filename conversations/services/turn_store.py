"""Storing a turn (docs/design.md, the turn, steps 6-7): the new messages and the reply in one
transaction, numbered from the chat's counter row, the turn slot freed by the same statement; the
memory work queued after commit."""

import json
import logging
import uuid
from collections.abc import Callable
from dataclasses import dataclass
from functools import partial
from typing import Any

from django.db import connection, transaction
from django.utils import timezone

from conversations import rows
from conversations.chat_model.contract import ChatCompletion, cached_prompt_tokens
from conversations.chat_model.tokens import count_tokens
from conversations.models import Chat, Message, Role
from conversations.services.agent_state import queue_agent_summary
from conversations.services.bounded_context import Bounded
from conversations.variants import ModelVariant
from memory_worker.memory import (
    MemorySnapshot,
    RequestReason,
    decide_for_chat,
    request_fold,
    with_appended,
)

log = logging.getLogger("chatmem.turn")


@dataclass(frozen=True)
class TurnRequest:
    """A REST turn whose slot (``token``) is claimed: what it sends and stores."""

    chat: Chat
    token: uuid.UUID
    variant: ModelVariant
    content: str
    user_tokens: int  # the content's, counted for the variant's model
    metadata: dict | None = None


@dataclass(frozen=True)
class TurnResult:
    user_message: Message
    assistant_message: Message


def store_turn(
    request: TurnRequest,
    bounded: Bounded,
    completion: ChatCompletion,
    *,
    on_stored: Callable[[TurnResult], None] | None = None,
) -> TurnResult:
    """``on_stored`` runs right after the commit, before the memory hooks, so a streamed turn's
    final event never waits for them (an enqueue can take seconds if the broker is down)."""
    chat = request.chat
    user_row = Message(
        chat_id=chat.pk,
        role=Role.USER,
        content=request.content,
        token_count=request.user_tokens,
        # Both messages of a turn name its variant: it counted the user's tokens too.
        model_variant=request.variant.name,
        metadata=request.metadata or {},
    )
    user_message, assistant_message = append_messages(
        chat,
        request.token,
        [user_row, reply_row(chat, completion, request.variant, bounded)],
    )
    result = TurnResult(user_message, assistant_message)
    # After commit: at once when the append was its own transaction, else when the caller's ends.
    if on_stored is not None:
        transaction.on_commit(partial(on_stored, result))  # registered first: runs first
    queue_memory_work(chat, bounded.snapshot, [user_message, assistant_message])
    return result


def reply_row(
    chat: Chat, completion: ChatCompletion, variant: ModelVariant, bounded: Bounded | None = None
) -> Message:
    """The assistant message of a completion, not yet numbered or saved. Its metadata keeps the
    memory its context was built from (``bounded``: W, the unfolded messages and the history's
    tokens as the bound counts them) and how long its turn waited for a fold in flight: the
    admin's timeline draws them."""
    metadata: dict[str, object] = {
        "model": completion.model,
        "finish_reason": completion.finish_reason,
        "prompt_tokens": completion.prompt_tokens,
        "completion_tokens": completion.completion_tokens,
    }
    if completion.capped_at_chars is not None:
        metadata["capped_at_chars"] = completion.capped_at_chars
    metadata.update(completion.cache)
    if bounded is not None:
        metadata["context"] = {
            "watermark": bounded.snapshot.last_consolidated,
            "unfolded": len(bounded.snapshot.unfolded),
            "history_tokens": bounded.history_tokens,
        }
        if bounded.waited_ms is not None:
            metadata["waited_for_fold_ms"] = bounded.waited_ms
    # Counted here, once per reply the model produced (chatmem_model_input_tokens_total).
    log.info(
        "model usage",
        extra={
            "event": "model_usage",
            "chat_id": chat.pk,
            "variant": variant.name,
            "prompt_tokens": completion.prompt_tokens,
            "cached_tokens": cached_prompt_tokens(completion.cache),
        },
    )
    tokens = count_tokens(completion.content, variant.model)
    if completion.tool_calls:
        metadata["tool_calls"] = list(completion.tool_calls)
        # The calls travel in every later context: they count toward the bound.
        tokens += count_tokens(json.dumps(metadata["tool_calls"]), variant.model)
    return Message(
        chat_id=chat.pk,
        role=Role.ASSISTANT,
        content=completion.content,
        token_count=tokens,
        model_variant=variant.name,
        metadata=metadata,
    )


def append_messages(chat: Chat, token: uuid.UUID, messages: list[Message]) -> list[Message]:
    """Number ``messages`` after the chat's last message, store them and free the chat's turn
    slot (``token``'s, if still held), all or nothing (in the caller's transaction if there is
    one). The counter row's lock serialises appends: seq order is commit order, no gaps.
    Register on_commit work after this returns: outside a transaction it runs at once.

    PostgreSQL does it in one statement, sparing the BEGIN/COMMIT round trips; other databases
    in a transaction."""
    if connection.vendor == "postgresql":
        return append_in_one_statement(chat.pk, token, messages)
    return append_in_transaction(chat.pk, token, messages)


def append_in_transaction(chat_id: int, token: uuid.UUID, messages: list[Message]) -> list[Message]:
    with transaction.atomic():
        first_seq = reserve_seqs(chat_id, token, len(messages))
        for offset, row in enumerate(messages):
            row.seq = first_seq + offset
        return Message.objects.bulk_create(messages)


def reserve_seqs(chat_id: int, token: uuid.UUID, count: int) -> int:
    """Advance the chat's counter row by ``count`` and free its turn slot; returns the first
    reserved seq. The row lock the UPDATE takes is held until the caller's transaction ends, so
    a concurrent append waits and then reads the advanced counter."""
    assert connection.in_atomic_block, "the seqs must commit with the messages that use them"
    sql, params = advance_counter(chat_id, token, count)
    with connection.cursor() as cursor:
        cursor.execute(sql, params)
        advanced = cursor.fetchone()
    if advanced is None:
        raise Chat.DoesNotExist(f"chat {chat_id} was deleted during the turn")
    return int(advanced[0]) - count + 1


def advance_counter(chat_id: int, token: uuid.UUID, count: int) -> tuple[str, list[Any]]:
    """``UPDATE … RETURNING last_seq`` on the chat's counter row, also freeing the turn slot if
    it is still this turn's (SQLite >= 3.35, PostgreSQL); the ORM's update() cannot return the
    new value.

    A turn that outlived TURN_SLOT_STALE_SECONDS may find its slot taken over by the next
    request: it still stores (its reply is not lost, seqs stay in commit order), but freeing the
    slot then would let a third request start while the second runs. SET reads the row as it
    was, so both CASEs see the old token."""
    mine = "turn_token = %s"
    sql = (
        f"UPDATE {rows.quoted_table(Chat)} SET last_seq = last_seq + %s, "
        f"turn_token = CASE WHEN {mine} THEN NULL ELSE turn_token END, "
        f"turn_started_at = CASE WHEN {mine} THEN NULL ELSE turn_started_at END, "
        "updated_at = %s WHERE id = %s RETURNING last_seq"
    )
    token_value = Chat._meta.get_field("turn_token").get_db_prep_value(token, connection)
    now = connection.ops.adapt_datetimefield_value(timezone.now())
    return sql, [count, token_value, token_value, now, chat_id]


def append_in_one_statement(
    chat_id: int, token: uuid.UUID, messages: list[Message]
) -> list[Message]:
    """PostgreSQL: the counter UPDATE in a data-modifying CTE feeding the INSERT, so one
    statement (atomic on its own) both reserves the seqs and stores the messages. Under READ
    COMMITTED a concurrent append blocks on the chat row and, once it is free, re-reads the
    advanced counter before inserting. The columns come from the model, so a new field cannot be
    left out; each row's ``seq`` is sent as its offset (1, 2, ...) and added to the counter."""
    quote = connection.ops.quote_name
    fields = rows.insert_fields(Message)
    columns = [quote(str(field.column)) for field in fields]
    advance, params = advance_counter(chat_id, token, len(messages))
    params.append(len(messages))  # the SELECT's "counter.last_seq - %s": the seq before them
    for offset, row in enumerate(messages, start=1):
        row.seq = offset
        params.extend(rows.insert_values(row, fields))
    select = ", ".join(
        f"counter.last_seq - %s + new.{column}" if field.name == "seq" else f"new.{column}"
        for field, column in zip(fields, columns, strict=True)
    )
    one_row = "(" + ", ".join(["%s"] * len(fields)) + ")"
    sql = (
        f"WITH counter AS ({advance}) "
        f"INSERT INTO {quote(Message._meta.db_table)} ({', '.join(columns)}) "
        f"SELECT {select} FROM counter, (VALUES {', '.join([one_row] * len(messages))}) "
        f"AS new ({', '.join(columns)}) "
        f"RETURNING {quote(str(Message._meta.get_field('id').column))}, {quote('seq')}"
    )
    with connection.cursor() as cursor:
        cursor.execute(sql, params)
        stored = {seq: pk for pk, seq in cursor.fetchall()}
    if not stored:
        raise Chat.DoesNotExist(f"chat {chat_id} was deleted during the turn")
    base = min(stored) - 1
    for offset, row in enumerate(messages, start=1):
        row.seq = base + offset
        row.pk = stored[row.seq]
        row._state.adding = False
        row._state.db = connection.alias
    return messages


def queue_memory_work(chat: Chat, snapshot: MemorySnapshot, stored: list[Message]) -> None:
    """After the commit of a turn that stored ``stored`` (its first message opens it) on top of
    ``snapshot``: the consolidation check, then the agent state's work (docs/agent-state.md),
    whichever API the turn came by."""
    after = with_appended(snapshot, stored)
    transaction.on_commit(partial(queue_fold_if_due, chat, after))
    transaction.on_commit(partial(queue_agent_summary, chat, stored[0], snapshot.has_agent_state))


def queue_fold_if_due(chat: Chat, snapshot: MemorySnapshot) -> None:
    """Runs after commit, on the request thread but after the turn is durable: a pure decision
    on state already in memory, then (only if a fold is due) one enqueue that never raises."""
    try:
        # Database time: cooldowns and backoff were stamped by other hosts.
        now = rows.database_now()
        # A chat whose owner paused folds queues none (its turns fold only over the hard bound).
        if not chat.folds_paused and decide_for_chat(chat, snapshot, now) is not None:
            request_fold(chat.pk, RequestReason.TURN, due_at=now)
    except Exception:
        log.exception("post-turn consolidation check failed", extra={"chat_id": chat.pk})
