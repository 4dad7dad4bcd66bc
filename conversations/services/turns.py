"""The chat turn (DESIGN §3): claim the chat's turn slot, make sure the context is within the
policy's bound (folding synchronously if background folding fell behind), call the model, then
store the user message and the reply together in one transaction and queue the consolidation
check after commit. A turn that fails stores nothing.

Two ways to run the same turn: ``run_turn`` answers when the reply is stored (the JSON API);
``start_streamed_turn`` runs it on its own thread and hands out its events (accepted, deltas,
done or failed) as they happen (server-sent events). Both go through ``complete_turn``; only the
model call differs."""

import asyncio
import contextlib
import contextvars
import json
import logging
import queue
import threading
import time
import uuid
from collections.abc import AsyncIterator, Callable, Iterator
from dataclasses import dataclass
from datetime import timedelta
from functools import partial
from typing import Any

from django.conf import settings
from django.db import connection, connections, transaction
from django.utils import timezone

from conversations import rows
from conversations.llm import ChatCompletion, ModelError, ModelMessages
from conversations.models import Brief, Chat, Message, Role
from conversations.rows import database_unreachable
from conversations.services.agent_state import queue_agent_summary
from conversations.services.backends import get_chat_model
from conversations.services.context import build_model_messages
from conversations.services.variants import ModelVariant, turn_variant
from memory_worker import policy as engine
from memory_worker.folds import DATABASE_ERRORS, decide_for_chat
from memory_worker.policies import policy_for_chat
from memory_worker.runs import request_consolidation
from memory_worker.state import (
    MemorySnapshot,
    chat_with_snapshot_query,
    engine_state,
    fetch_chat_with_snapshot,
    load_snapshot,
    with_appended,
)
from memory_worker.tokens import count_tokens
from memory_worker.turn_fold import WAITED, fold_before_turn

log = logging.getLogger("chatmem.turn")

SYNC_FOLD_ATTEMPTS = 3


class TurnInProgress(Exception):
    pass


class ContextOverBound(Exception):
    """The context cannot be brought within the policy's bound right now (the synchronous fold
    failed, or even a full fold would not fit). Nothing is dropped: the turn is refused."""


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


@dataclass(frozen=True)
class TurnResult:
    user_message: Message
    assistant_message: Message


BUSY = "Another turn of this chat is in progress; retry when it completes."


def claim_turn_slot(chat: Chat) -> uuid.UUID:
    """Claim the turn slot of a chat already read (see claim_owned_chat)."""
    return claim_owned_chat(chat.owner_id, chat.pk).token


@dataclass(frozen=True)
class Claimed:
    chat: Chat
    token: uuid.UUID
    # PostgreSQL: the chat's memory snapshot, read in the claiming statement; None when it may
    # miss a turn stored while the claim waited (read it again then), and on other databases.
    snapshot: MemorySnapshot | None


def claim_owned_chat(owner_id: int, chat_id: int) -> Claimed:
    """The owner's chat, read and with its turn slot claimed in one statement: a turn's first
    round trip after authentication. One turn at a time per chat: a conditional UPDATE, so two
    requests cannot both win; a slot older than TURN_SLOT_STALE_SECONDS belonged to a process
    that died mid-turn. Raises Chat.DoesNotExist when no chat of that id is the owner's, and
    TurnInProgress when another turn holds the slot.

    On PostgreSQL the same statement also reads the memory snapshot (state.snapshot_query),
    which saves the turn a round trip. A statement reads one snapshot, taken when it starts, but
    an UPDATE that waited for the row's lock claims the newest version of the row. A turn whose
    slot went stale (it outlived TURN_SLOT_STALE_SECONDS) may store its messages, and free the
    slot, while this claim waits: the claim then succeeds on the counter that turn advanced,
    with a snapshot older than its messages. So the snapshot is kept only if its newest message
    is the counter's ``last_seq``: messages commit with the counter, in seq order, so then it
    holds every stored message.

    On PostgreSQL the claim's commit does not wait for a disk flush (rows.NO_FLUSH_WAIT): a claim
    lost in a database crash loses nothing (the turn's connection breaks with it, so its append
    fails and stores nothing), and the append's own synchronous commit flushes the WAL up to
    its record, the claim's included."""
    low, high = connection.ops.integer_field_range(Chat._meta.pk.get_internal_type())  # type: ignore[union-attr]
    if not low <= chat_id <= high:
        raise Chat.DoesNotExist(f"no chat {chat_id}")
    token = uuid.uuid4()
    now = timezone.now()
    stale_before = now - timedelta(seconds=settings.TURN_SLOT_STALE_SECONDS)
    adapt_time = connection.ops.adapt_datetimefield_value
    postgresql = connection.vendor == "postgresql"
    claim = (
        f"UPDATE {rows.quoted_table(Chat)} SET turn_token = %s, turn_started_at = %s "
        + (f"FROM {rows.NO_FLUSH_WAIT} " if postgresql else "")
        + "WHERE id = %s AND owner_id = %s "
        "AND (turn_token IS NULL OR turn_started_at < %s) "
        f"RETURNING {rows.column_list(rows.selected_fields(Chat))}"
    )
    params = [
        Chat._meta.get_field("turn_token").get_db_prep_value(token, connection),
        adapt_time(now),
        chat_id,
        owner_id,
        adapt_time(stale_before),
    ]
    if postgresql:
        # A chat without a brief still comes back: its turn then fails, and releases the slot,
        # when it reads the snapshot.
        found = fetch_chat_with_snapshot(
            f"WITH claimed AS ({claim}) {chat_with_snapshot_query('claimed')}", params
        )
    else:
        claimed = rows.fetch_instances(Chat, rows.selected_fields(Chat), claim, params)
        found = (claimed[0][0], None) if claimed else None
    if found is not None:
        chat, snapshot = found
        if snapshot is not None and snapshot.last_seq != chat.last_seq:
            snapshot = None  # it predates a turn stored while the claim waited: read it again
        return Claimed(chat, token, snapshot)
    if Chat.objects.filter(pk=chat_id, owner_id=owner_id).exists():
        raise TurnInProgress(BUSY)
    raise Chat.DoesNotExist(f"no chat {chat_id} of user {owner_id}")


def release_turn_slot(chat: Chat, token: uuid.UUID) -> bool:
    """Frees the slot if it is still this turn's, and says whether it was. Never raises: it runs
    while a turn's own error propagates, and a database error here would replace that error, and
    leave the stream that waits for it without its last event. A connection the failure broke
    is replaced once (the database may well be back); a slot that cannot be freed goes stale
    after TURN_SLOT_STALE_SECONDS, when the next turn takes it over."""
    for attempt in (1, 2):
        try:
            freed = Chat.objects.filter(pk=chat.pk, turn_token=token).update(
                turn_token=None, turn_started_at=None
            )
            return bool(freed)
        except DATABASE_ERRORS:
            if attempt == 2 or connection.in_atomic_block:
                break
            connection.close()  # the next query opens a new connection
    log.warning(
        "turn slot not released; it goes stale after TURN_SLOT_STALE_SECONDS",
        extra={"chat_id": chat.pk},
        exc_info=True,
    )
    return False


@contextlib.contextmanager
def turn_slot(chat: Chat, token: uuid.UUID | None) -> Iterator[uuid.UUID]:
    """The chat's turn slot (claimed here unless the caller has: ``token``), released if what
    follows raises. A stored turn freed the slot in the statement that stored it; only a failed
    or never-started turn still holds it."""
    token = token or claim_turn_slot(chat)
    try:
        yield token
    except BaseException as error:
        freed = release_turn_slot(chat, token)
        if not freed and database_unreachable(error):
            # The store frees the slot in the statement that stores the turn: a slot no longer
            # held (or unreadable) after a lost connection means the turn may have been stored.
            error.turn_may_be_stored = True  # type: ignore[attr-defined]
        raise


def turn_input(chat: Chat, variant_name: str | None, content: str) -> tuple[ModelVariant, int]:
    """The turn's model variant (UnknownVariant if not configured) and the new message's
    tokens, counted for that variant's model."""
    variant = turn_variant(variant_name, chat.model_variant)
    return variant, count_tokens(content, variant.model)


# How a turn calls the model: messages, variant -> the complete reply (or ModelError).
ModelCall = Callable[[ModelMessages, ModelVariant], ChatCompletion]


def run_turn(
    chat: Chat,
    content: str,
    variant_name: str | None = None,
    metadata: dict | None = None,
    *,
    claimed: Claimed | None = None,
) -> TurnResult:
    """``claimed``: the chat's claim when the caller has made it (claim_owned_chat)."""
    with turn_slot(chat, claimed.token if claimed else None) as slot:
        variant, user_tokens = turn_input(chat, variant_name, content)
        snapshot = claimed.snapshot if claimed else None
        return complete_turn(
            chat,
            slot,
            variant,
            content,
            user_tokens,
            metadata,
            call_model_at_once,
            snapshot=snapshot,
        )


def complete_turn(
    chat: Chat,
    token: uuid.UUID,
    variant: ModelVariant,
    content: str,
    user_tokens: int,
    metadata: dict | None,
    call_model: ModelCall,
    on_stored: Callable[[TurnResult], None] | None = None,
    snapshot: MemorySnapshot | None = None,
) -> TurnResult:
    """Steps 3-7 of DESIGN §3, with the turn slot already claimed by the caller (``snapshot``:
    the memory snapshot read since the claim, if any)."""
    snapshot = bounded_snapshot(chat, token, variant, user_tokens, snapshot)
    messages = build_model_messages(
        chat, snapshot.summary, snapshot.unfolded, content, snapshot.agent_context
    )
    completion = call_model(messages, variant)
    return store_turn(
        chat, token, snapshot, content, user_tokens, completion, variant, metadata, on_stored
    )


def call_model_at_once(messages: ModelMessages, variant: ModelVariant) -> ChatCompletion:
    release_pooled_connection()
    return get_chat_model().complete(messages, variant.model)


def release_pooled_connection() -> None:
    """Before waiting on the model: the pooled connection goes back to the pool, otherwise a pool
    of N connections caps a process at N turns in flight however many threads it has. Not
    without a pool, where closing would mean a new PostgreSQL connection (a process fork) on
    every turn."""
    if connection_is_pooled():
        release_db_connection()


def connection_is_pooled() -> bool:
    return bool(connections["default"].settings_dict.get("OPTIONS", {}).get("pool"))


def bounded_snapshot(
    chat: Chat,
    token: uuid.UUID,
    variant: ModelVariant,
    user_tokens: int,
    first: MemorySnapshot | None = None,
    *,
    opens_turn: bool = True,
) -> MemorySnapshot:
    """The memory snapshot to build the context from (``first``, when the caller has read it
    since claiming the slot), folding synchronously first when the context with the new message
    would exceed the policy's hard bound (seed 000 §7)."""
    policy = policy_for_chat(chat)
    # Waiting for folds in flight (each commit is re-read) is bounded in time, not in count: a
    # background fold may free less than this turn needs, and the next one is waited for too.
    wait_deadline = time.monotonic() + settings.MEMORY_LLM_TIMEOUT_SECONDS
    folds = 0
    snapshot = first if first is not None else snapshot_of_live_chat(chat)
    while folds < SYNC_FOLD_ATTEMPTS:
        state = engine_state(chat, snapshot, variant.context_tokens)
        pre_turn = engine.decide_before_turn(state, policy, user_tokens, opens_turn=opens_turn)
        if not pre_turn.fits:
            raise ContextOverBound(too_big_message(opens_turn))
        if pre_turn.fold is None:
            return snapshot
        outcome = fold_before_turn(
            chat,
            snapshot,
            pre_turn.fold,
            engine.prompt_tokens(state, user_tokens),
            wait_deadline=wait_deadline,
            before_fold=partial(renew_turn_slot, chat, token),
        )
        if outcome.status == "failed":
            raise ContextOverBound(
                "Memory consolidation is needed before this turn and it failed "
                f"({outcome.error}); nothing was stored, retry later."
            )
        folds += outcome.status != WAITED
        # succeeded, superseded, or waited for a fold in flight: re-read and check again
        renew_turn_slot(chat, token)
        snapshot = snapshot_of_live_chat(chat)
    raise ContextOverBound("The context could not be brought within its bound; retry later.")


def too_big_message(opens_turn: bool) -> str:
    if opens_turn:
        return (
            "This message does not fit the chat's context bound even after folding the whole "
            "history into the summary; send a shorter message."
        )
    # Folding part of the turn would send these results without the calls they answer.
    return (
        "These tool results and the turn they continue do not fit the chat's context bound, "
        "and a turn is never split by a fold; start a new turn with a user message, or use a "
        "policy with a larger bound."
    )


def snapshot_of_live_chat(chat: Chat) -> MemorySnapshot:
    """Chat.DoesNotExist (the turn's 404 ``chat_deleted``) when the chat was deleted since the
    claim: its brief went with it, and a missing brief is otherwise a bug's 500."""
    try:
        return load_snapshot(chat.pk)
    except Brief.DoesNotExist:
        raise_if_deleted(chat)
        raise


def raise_if_deleted(chat: Chat) -> None:
    if not Chat.objects.filter(pk=chat.pk).exists():
        raise Chat.DoesNotExist(f"chat {chat.pk} was deleted during its turn")


def renew_turn_slot(chat: Chat, token: uuid.UUID) -> None:
    """After a synchronous fold: the slot's age counts from now again. A slot older than
    TURN_SLOT_STALE_SECONDS (the model's deadline and a margin) is taken to be a dead process's,
    and summarizer calls (each up to its own deadline, retried, in chunks) can outlast that
    before the model is even called. Raises TurnInProgress when another request has already
    taken the slot over: this turn stops before calling the model, having stored nothing."""
    renewed = Chat.objects.filter(pk=chat.pk, turn_token=token).update(
        turn_started_at=timezone.now()
    )
    if not renewed:
        raise_if_deleted(chat)
        raise TurnInProgress(
            "The memory fold before this turn took so long that another turn of this chat "
            "started; nothing was stored. Retry when it completes."
        )


def store_turn(
    chat: Chat,
    token: uuid.UUID,
    snapshot: MemorySnapshot,
    content: str,
    user_tokens: int,
    completion: ChatCompletion,
    variant: ModelVariant,
    metadata: dict | None,
    on_stored: Callable[[TurnResult], None] | None = None,
) -> TurnResult:
    """``on_stored`` runs right after the commit, before the memory hooks below, so a streamed
    turn's final event never waits for them (an enqueue can take seconds if the broker is down;
    seed 003 §9.2)."""
    user_row = Message(
        chat_id=chat.pk,
        role=Role.USER,
        content=content,
        token_count=user_tokens,
        metadata=metadata or {},
    )
    user_message, assistant_message = append_messages(
        chat, token, [user_row, reply_row(chat, completion, variant)]
    )
    result = TurnResult(user_message, assistant_message)
    # After commit: at once when the append was its own transaction, else when the caller's ends.
    if on_stored is not None:
        transaction.on_commit(partial(on_stored, result))  # registered first: runs first
    after = with_appended(snapshot, [user_message, assistant_message])
    transaction.on_commit(partial(queue_consolidation_if_due, chat, after))
    transaction.on_commit(
        partial(queue_agent_summary, chat, user_message, snapshot.has_agent_state)
    )
    return result


def reply_row(chat: Chat, completion: ChatCompletion, variant: ModelVariant) -> Message:
    """The assistant message of a completion, not yet numbered or saved."""
    metadata: dict[str, object] = {
        "model": completion.model,
        "finish_reason": completion.finish_reason,
        "prompt_tokens": completion.prompt_tokens,
        "completion_tokens": completion.completion_tokens,
    }
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


def append_messages(chat: Chat, token: uuid.UUID, rows: list[Message]) -> list[Message]:
    """Number ``rows`` after the chat's last message, store them and free the chat's turn slot
    (``token``'s, if still held), all or nothing (in the caller's transaction if there is one).
    The counter row's lock serialises appends: seq order is commit order, no gaps. Register
    on_commit work after this returns: outside a transaction it runs at once, the rows being
    committed.

    PostgreSQL does it in one statement (no BEGIN/COMMIT round trips: a turn's store is a third
    of its database time); other databases in a transaction."""
    if connection.vendor == "postgresql":
        return append_in_one_statement(chat.pk, token, rows)
    return append_in_transaction(chat.pk, token, rows)


def append_in_transaction(chat_id: int, token: uuid.UUID, rows: list[Message]) -> list[Message]:
    with transaction.atomic():
        first_seq = reserve_seqs(chat_id, token, len(rows))
        for offset, row in enumerate(rows):
            row.seq = first_seq + offset
        return Message.objects.bulk_create(rows)


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
    it is still this turn's (SQLite >= 3.35, PostgreSQL). The ORM's update() cannot return the
    new value, hence SQL.

    Still this turn's: a turn that outlived TURN_SLOT_STALE_SECONDS (a long stream, a slow
    model) may find its slot taken over by the next request. It still stores (its reply is not
    lost, and seqs stay in commit order), but freeing the slot then would let a third request
    start while the second runs. SET reads the row as it was, so both CASEs see the old token."""
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


def queue_consolidation_if_due(chat: Chat, snapshot: MemorySnapshot) -> None:
    """Runs after commit, on the request thread but after the turn is durable: a pure decision
    on state already in memory, then (only if a fold is due) one enqueue that never raises."""
    try:
        now = timezone.now()
        if decide_for_chat(chat, snapshot, "turn", now) is not None:
            request_consolidation(chat.pk, "turn", due_at=now)
    except Exception:
        log.exception("post-turn consolidation check failed", extra={"chat_id": chat.pk})


# ---------------------------------------------------------------------------------------------
# Streamed turns


@dataclass(frozen=True)
class TurnDelta:
    content: str


@dataclass(frozen=True)
class TurnDone:
    result: TurnResult


@dataclass(frozen=True)
class TurnFailed:
    """The turn failed and stored nothing; ``error`` is a ModelError, ContextOverBound, or
    anything unexpected (already logged)."""

    error: Exception


TurnEvent = TurnDelta | TurnDone | TurnFailed


class TurnEvents:
    """The events of one streamed turn, from the turn's thread to whoever serves the response.

    Unbounded on purpose: the turn's thread must never block on a slow or vanished reader, so a
    client that stops reading cannot stall the model stream or keep the turn slot. A reply is a
    few thousand deltas at most. Readable from a thread (``get``) or an event loop (``aget``)."""

    def __init__(self) -> None:
        self._queue: queue.SimpleQueue[TurnEvent] = queue.SimpleQueue()
        self._lock = threading.Lock()
        self._wakeups: list[tuple[asyncio.AbstractEventLoop, asyncio.Event]] = []

    def put(self, event: TurnEvent) -> None:
        self._queue.put(event)
        with self._lock:
            wakeups = list(self._wakeups)
        for loop, ready in wakeups:
            with contextlib.suppress(RuntimeError):  # that loop is closed: its reader is gone
                loop.call_soon_threadsafe(ready.set)

    def get(self, timeout: float) -> TurnEvent | None:
        """The next event, or None when none came within ``timeout`` seconds."""
        try:
            return self._queue.get(timeout=timeout)
        except queue.Empty:
            return None

    async def aget(self, timeout: float) -> TurnEvent | None:
        """``get`` for an event loop, without holding a thread while waiting."""
        ready = asyncio.Event()
        entry = (asyncio.get_running_loop(), ready)
        with self._lock:
            self._wakeups.append(entry)
        try:
            # Registered before looking: an event put after this look also sets `ready`.
            with contextlib.suppress(queue.Empty):
                return self._queue.get_nowait()
            with contextlib.suppress(TimeoutError):
                await asyncio.wait_for(ready.wait(), timeout)
            with contextlib.suppress(queue.Empty):
                return self._queue.get_nowait()
            return None
        finally:
            with self._lock:
                self._wakeups.remove(entry)


@dataclass
class StreamedTurn:
    """A turn accepted for streaming: its slot is claimed and its thread is running."""

    chat: Chat
    content: str
    user_tokens: int
    variant: ModelVariant
    events: TurnEvents
    thread: threading.Thread

    def iter_events(self, heartbeat: float) -> Iterator[TurnEvent | None]:
        """Events until the last one (done or failed); None every ``heartbeat`` seconds without
        one, so the caller can keep the connection alive (and notice a vanished client)."""
        while True:
            event = self.events.get(heartbeat)
            yield event
            if isinstance(event, TurnDone | TurnFailed):
                return

    async def aiter_events(self, heartbeat: float) -> AsyncIterator[TurnEvent | None]:
        while True:
            event = await self.events.aget(heartbeat)
            yield event
            if isinstance(event, TurnDone | TurnFailed):
                return


def start_streamed_turn(
    chat: Chat,
    content: str,
    variant_name: str | None = None,
    metadata: dict | None = None,
    *,
    claimed: Claimed | None = None,
) -> StreamedTurn:
    """Claim the slot (unless the caller did: ``claimed``) and resolve the variant here, so
    TurnInProgress and UnknownVariant raise before any response has started (plain 4xx), then
    run the rest of the turn on its own thread.

    The turn runs on its own thread, not in the response generator, because the server closes
    the generator when the client disconnects (WSGI: close() -> GeneratorExit at the pending
    yield; ASGI: the task is cancelled). A turn the server accepted must still complete and be
    stored (DESIGN §3.6), so nothing the turn does may depend on the client still reading."""
    with turn_slot(chat, claimed.token if claimed else None) as slot:
        variant, user_tokens = turn_input(chat, variant_name, content)
        events = TurnEvents()
        thread = threading.Thread(
            # The copied context carries the request id into the turn's log lines.
            target=contextvars.copy_context().run,
            args=(
                _run_streamed_turn,
                chat,
                slot,
                variant,
                content,
                user_tokens,
                metadata,
                events,
                claimed.snapshot if claimed else None,
            ),
            name=f"chatmem-turn-{chat.pk}",
            # Not a daemon: a graceful shutdown waits for accepted turns to be stored.
            daemon=False,
        )
        thread.start()
    return StreamedTurn(chat, content, user_tokens, variant, events, thread)


def _run_streamed_turn(
    chat: Chat,
    token: uuid.UUID,
    variant: ModelVariant,
    content: str,
    user_tokens: int,
    metadata: dict | None,
    events: TurnEvents,
    snapshot: MemorySnapshot | None = None,
) -> None:
    announced: list[TurnResult] = []
    # A failure is told after the slot is freed: a client retrying as soon as it reads the error
    # would otherwise meet its own turn's slot (a 409).
    failure: TurnFailed | None = None

    def announce(result: TurnResult) -> None:
        announced.append(result)
        events.put(TurnDone(result))

    try:
        call_model = partial(stream_model, emit=events.put)
        result = complete_turn(
            chat,
            token,
            variant,
            content,
            user_tokens,
            metadata,
            call_model,
            on_stored=announce,
            snapshot=snapshot,
        )
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
            release_turn_slot(chat, token)  # store_turn released it already when it succeeded
        finally:
            if failure is not None:  # whatever happened above: the stream must get its end
                events.put(failure)
            # This thread's own database connection: it would otherwise stay open until the
            # garbage collector finds the dead thread's connection handler.
            connections.close_all()


def release_db_connection() -> None:
    """Close this thread's database connection unless a transaction needs it. A streamed reply
    lasts as long as the model talks: without this, every open stream would hold a PostgreSQL
    connection (100 by default) for its whole length, not just for its few queries."""
    connection = connections["default"]
    if not connection.in_atomic_block:
        connection.close()


def stream_model(
    messages: ModelMessages, variant: ModelVariant, emit: Callable[[TurnEvent], None]
) -> ChatCompletion:
    """Stream the reply, emitting each delta as it arrives; return the complete reply (the
    whole of it within the model's deadline: conversations.llm)."""
    release_db_connection()  # held by nobody while the model talks; store_turn reconnects
    stream = get_chat_model().stream(messages, variant.model)
    try:
        for delta in stream:
            emit(TurnDelta(delta))
    finally:
        stream.close()
    if stream.result is None:  # exhausted streams always have one; guard the invariant
        raise ModelError("The model's reply stream ended before the reply was complete.")
    return stream.result


__all__ = [
    "ContextOverBound",
    "ModelError",
    "StreamedTurn",
    "TurnDelta",
    "TurnDone",
    "TurnEvent",
    "TurnFailed",
    "TurnInProgress",
    "TurnResult",
    "run_turn",
    "start_streamed_turn",
]
