"""A chat's turn slot (docs/design.md, the turn, step 2): one turn at a time per chat, claimed by a
conditional UPDATE of the chat row and freed by the statement that stores the turn, or here when it
fails."""

import contextlib
import logging
import uuid
from collections.abc import Iterator
from dataclasses import dataclass
from datetime import timedelta

from django.conf import settings
from django.db import connection
from django.db.models.functions import Now
from django.utils import timezone

from conversations import rows
from conversations.models import Chat
from conversations.rows import DATABASE_ERRORS, database_unreachable
from memory_worker.memory import MemorySnapshot, chat_with_snapshot_query, fetch_chat_with_snapshot

log = logging.getLogger("chatmem.turn")

BUSY = "Another turn of this chat is in progress; retry when it completes."


class TurnInProgress(Exception):
    pass


@dataclass(frozen=True)
class Claimed:
    chat: Chat
    token: uuid.UUID
    # PostgreSQL: the chat's memory snapshot, read in the claiming statement; None when it may
    # miss a turn stored while the claim waited (read it again then), and on other databases.
    snapshot: MemorySnapshot | None


def claim_turn_slot(chat: Chat) -> uuid.UUID:
    """Claim the turn slot of a chat already read (see claim_owned_chat)."""
    return claim_owned_chat(chat.owner_id, chat.pk).token


def claim_owned_chat(owner_id: int, chat_id: int) -> Claimed:
    """The owner's chat, read and with its turn slot claimed in one statement: a turn's first
    round trip after authentication. A conditional UPDATE, so two requests cannot both win; a
    slot older than TURN_SLOT_STALE_SECONDS belonged to a process that died mid-turn. Raises
    Chat.DoesNotExist when no chat of that id is the owner's, and TurnInProgress when another
    turn holds the slot.

    On PostgreSQL the same statement also reads the memory snapshot (state.snapshot_query). A
    statement reads one snapshot, taken when it starts, but an UPDATE that waited for the row's
    lock claims the newest version of the row: a stale turn may store its messages, and free the
    slot, while this claim waits, leaving a snapshot older than the counter it claimed. So the
    snapshot is kept only if its newest message is the counter's ``last_seq`` (messages commit
    with the counter, in seq order, so then it holds every stored message).

    The claim's commit does not wait for a disk flush (rows.NO_FLUSH_WAIT): a claim lost in a
    database crash loses nothing (the turn's append then fails and stores nothing), and the
    append's own synchronous commit flushes the WAL up to its record, the claim's included."""
    low, high = connection.ops.integer_field_range(Chat._meta.pk.get_internal_type())  # type: ignore[union-attr]
    if not low <= chat_id <= high:
        raise Chat.DoesNotExist(f"no chat {chat_id}")
    token = uuid.uuid4()
    postgresql = connection.vendor == "postgresql"
    token_value = Chat._meta.get_field("turn_token").get_db_prep_value(token, connection)
    if postgresql:
        # Database time: the slot's start is compared by other web hosts, whose clocks differ.
        started, stale_before = "statement_timestamp()", "statement_timestamp() - %s"
        params = [
            token_value,
            chat_id,
            owner_id,
            timedelta(seconds=settings.TURN_SLOT_STALE_SECONDS),
        ]
    else:  # SQLite: one host
        now = timezone.now()
        adapt_time = connection.ops.adapt_datetimefield_value
        started, stale_before = "%s", "%s"
        params = [
            token_value,
            adapt_time(now),
            chat_id,
            owner_id,
            adapt_time(now - timedelta(seconds=settings.TURN_SLOT_STALE_SECONDS)),
        ]
    claim = (
        f"UPDATE {rows.quoted_table(Chat)} SET turn_token = %s, turn_started_at = {started} "
        + (f"FROM {rows.NO_FLUSH_WAIT} " if postgresql else "")
        + "WHERE id = %s AND owner_id = %s "
        f"AND (turn_token IS NULL OR turn_started_at < {stale_before}) "
        f"RETURNING {rows.column_list(rows.selected_fields(Chat))}"
    )
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
    while a turn's own error propagates, which a database error here would replace (and a
    stream waiting for that error would miss its last event). A connection the failure broke is
    replaced once; a slot that cannot be freed goes stale after TURN_SLOT_STALE_SECONDS."""
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
            # The store frees the slot in the statement that stores the turn: after a lost
            # connection, a slot this turn does not hold (or cannot read) means the turn may have
            # been stored.
            error.turn_may_be_stored = True  # type: ignore[attr-defined]
        raise


def renew_turn_slot(chat: Chat, token: uuid.UUID) -> None:
    """After a synchronous fold: the slot's age counts from now again, since summarizer calls
    can outlast TURN_SLOT_STALE_SECONDS before the model is even called. Raises TurnInProgress
    when another request has taken the slot over: this turn stops, having stored nothing."""
    if not TurnSlotLease(chat, token).renew():
        raise_if_deleted(chat)
        raise TurnInProgress(
            "The memory fold before this turn took so long that another turn of this chat "
            "started; nothing was stored. Retry when it completes."
        )


def raise_if_deleted(chat: Chat) -> None:
    if not Chat.objects.filter(pk=chat.pk).exists():
        raise Chat.DoesNotExist(f"chat {chat.pk} was deleted during its turn")


@dataclass(frozen=True)
class TurnSlotLease:
    """The turn's slot as its synchronous fold keeps it
    (memory_worker.folding.execute.execute_fold's ``lease``): renewed before every summarizer chunk,
    so a backlog of chunks longer than TURN_SLOT_STALE_SECONDS never leaves a live turn's slot
    looking abandoned to a retry."""

    chat: Chat
    token: uuid.UUID

    def renew(self) -> bool:
        """The slot's age counts from now (database time: other hosts judge it), if the slot is
        still this turn's; whether it was."""
        renewed = Chat.objects.filter(pk=self.chat.pk, turn_token=self.token).update(
            turn_started_at=Now()
        )
        return bool(renewed)
