"""A manual fold asked for by the API or the admin: judged at once (nothing to fold is answered
and recorded in the ledger, not queued), and at most one queued per chat at a time."""

from enum import StrEnum

from django.db import transaction
from django.db.models.functions import Now

from conversations.models import Chat, Consolidation, ConsolidationStatus, hold_chat
from conversations.rows import database_now
from memory_worker.coordination.dispatch import (
    RequestReason,
    clear_manual_queued,
    mark_manual_queued,
)
from memory_worker.folding.execute import decide_for_chat
from memory_worker.folding.ledger import WORKER_NAME
from memory_worker.folding.snapshot import MemorySnapshot, read_chat_and_snapshot
from memory_worker.scheduling.runs import request_fold


class ManualRequest(StrEnum):
    QUEUED = "queued"
    ALREADY_QUEUED = "already_queued"  # a queued manual fold of the chat has not started yet
    NOTHING_TO_FOLD = "nothing_to_fold"  # every message a manual fold may fold is folded
    NOT_QUEUED = "not_queued"  # the broker refused (logged); nothing was queued


def request_manual_fold(chat_id: int) -> ManualRequest:
    """Raises Chat.DoesNotExist for a chat deleted meanwhile."""
    found = read_chat_and_snapshot(chat_id)
    if found is None:
        raise Chat.DoesNotExist(f"chat {chat_id} does not exist")
    chat, snapshot = found
    if decide_for_chat(chat, snapshot, database_now(), manual=True) is None:
        record_nothing_to_fold(snapshot)
        return ManualRequest.NOTHING_TO_FOLD
    if not mark_manual_queued(chat_id):
        return ManualRequest.ALREADY_QUEUED
    if request_fold(chat_id, RequestReason.MANUAL):
        return ManualRequest.QUEUED
    clear_manual_queued(chat_id)
    return ManualRequest.NOT_QUEUED


def record_nothing_to_fold(snapshot: MemorySnapshot) -> None:
    """The request's trace in the ledger: an empty range after the watermark. Chat.DoesNotExist
    for a chat deleted meanwhile."""
    watermark = snapshot.last_consolidated
    with transaction.atomic():
        # The chat held first, as a deletion takes it before the ledger: unheld, the row's
        # foreign key failed at commit for a chat being deleted (an IntegrityError, a 500).
        if not hold_chat(snapshot.chat_id):
            raise Chat.DoesNotExist(f"chat {snapshot.chat_id} does not exist")
        Consolidation.objects.create(
            chat_id=snapshot.chat_id,
            trigger=RequestReason.MANUAL.value,
            status=ConsolidationStatus.NOTHING_TO_FOLD,
            from_seq=watermark + 1,
            to_seq=watermark,
            base_version=snapshot.version,
            summary_tokens_before=snapshot.summary_tokens,
            summary_tokens_after=snapshot.summary_tokens,
            finished_at=Now(),
            duration_ms=0,
            worker=WORKER_NAME,
        )
