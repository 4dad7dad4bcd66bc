"""The beat sweep's judgement: runs a killed worker left "running", and the chats to queue
(retries due, cooled chats with a fold due, chats marked pending whose run died)."""

import logging
from datetime import datetime, timedelta

from django.conf import settings
from django.core.cache import cache
from django.db import transaction
from django.db.models import F, Q

from conversations.models import Brief, Consolidation, ConsolidationStatus
from memory_worker.folds import decide_for_chat
from memory_worker.locks import ChatLock
from memory_worker.retries import CRASH_KIND, fail_brief
from memory_worker.state import read_chat_and_snapshot

log = logging.getLogger("chatmem.fold")


ABANDONED = "abandoned: worker died"


def abandon_stale_runs(now: datetime) -> int:
    """Ledger rows left ``running`` by a killed worker: nothing was written for them (each chunk
    commits atomically), so they are marked failed once no lock can still cover them, and the
    chat's brief counts the failure like a crash. A fold that kills its worker every time (out of
    memory) backs off and turns degraded instead of being retried every lock TTL for ever."""
    cutoff = now - timedelta(seconds=settings.MEMORY_LOCK_TTL_SECONDS)
    stale = list(
        Consolidation.objects.filter(status=ConsolidationStatus.RUNNING, started_at__lt=cutoff)
    )
    abandoned = 0
    for ledger in stale:
        try:
            abandoned += abandon_run(ledger, now)
        except Exception:  # one chat's error must not cancel the rest of the sweep
            log.exception(
                "could not mark an abandoned run failed",
                extra={"event": "sweep_error", "chat_id": ledger.chat_id},
            )
    return abandoned


def abandon_run(ledger: Consolidation, now: datetime) -> int:
    """1 if this sweep marked the run failed. The row and its chat's failure count change
    together: had the count failed alone, the row (then not running) would never be counted
    by a later sweep, and a fold that keeps killing its worker would skip its backoff."""
    with transaction.atomic():
        # Conditional: a row that finished meanwhile keeps its own outcome.
        marked = Consolidation.objects.filter(
            pk=ledger.pk, status=ConsolidationStatus.RUNNING
        ).update(status=ConsolidationStatus.FAILED, error=ABANDONED, finished_at=now)
        # A synchronous fold dies with its web process (a gunicorn timeout): not a reason to
        # hold the chat's background folds back.
        if marked and not ledger.synchronous:
            fail_brief(ledger, ledger.base_version, ABANDONED, CRASH_KIND, now)
    return marked


def sweep_candidates(now: datetime, lock: ChatLock, limit: int) -> list[int]:
    """Chats the beat sweep should look at: failed chats whose retry is due, chats whose
    cooldown has passed with messages beyond the watermark, and chats marked pending whose
    run died."""
    retry_due = Brief.objects.filter(next_attempt_at__lte=now).values_list("chat_id", flat=True)
    chosen = dict.fromkeys([*retry_due[:limit], *lock.pending_chats()[:limit]])
    # Only as many as the batch has room for: the rotation moves past every chat it judges,
    # so a due chat judged and then cut off would wait a whole round.
    room = limit - len(chosen)
    for chat_id in next_cooled_candidates(now, room) if room > 0 else []:
        if cooldown_fold_due(chat_id, now):
            chosen[chat_id] = None
    return list(chosen)[:limit]


def cooldown_fold_due(chat_id: int, now: datetime) -> bool:
    """Whether the sweep should queue this cooled candidate. Never raises: a chat deleted since
    it was listed (its user deleted it mid-sweep) is skipped, and any other error is logged with
    the chat's id and the chat skipped, so one chat cannot cancel the rest of the sweep (the
    retry-due and pending chats already chosen, the daily-notes replay)."""
    try:
        found = read_chat_and_snapshot(chat_id)
        if found is None:
            return False  # deleted since it was listed
        chat, snapshot = found
        return decide_for_chat(chat, snapshot, now) is not None
    except Brief.DoesNotExist:
        return False  # deleted between the chat's read and its brief's (SQLite: two reads)
    except Exception:
        log.exception(
            "sweep could not judge a chat; skipped",
            extra={"event": "sweep_error", "chat_id": chat_id},
        )
        return False


SWEEP_CURSOR_KEY = "chatmem:sweep-cursor"


def next_cooled_candidates(now: datetime, limit: int) -> list[int]:
    """Up to ``limit`` chats with unfolded messages and no fold for the shortest cooldown, taken
    in id order from where the previous sweep stopped, wrapping around. Most such chats have
    nothing due (a short chat, a tail not yet full), and only the engine can tell: a fixed
    order would look at the same ``limit`` chats every sweep and never reach the rest. In
    rotation every candidate is looked at within ceil(candidates / limit) sweeps. The cursor
    lives in the cache: lost, the rotation starts again from the lowest id."""
    cooldown_cutoff = now - timedelta(seconds=settings.MEMORY_SWEEP_MIN_COOLDOWN_SECONDS)
    cooled = (
        Brief.objects.filter(
            Q(last_consolidated_at__lte=cooldown_cutoff) | Q(last_consolidated_at__isnull=True),
            chat__last_seq__gt=F("last_consolidated"),
            next_attempt_at__isnull=True,
        )
        .order_by("chat_id")
        .values_list("chat_id", flat=True)
    )
    cursor = sweep_cursor()
    chat_ids = list(cooled.filter(chat_id__gt=cursor)[:limit])
    if len(chat_ids) < limit:  # wrap around, without looking at any chat twice
        chat_ids += cooled.filter(chat_id__lte=cursor)[: limit - len(chat_ids)]
    if chat_ids:
        set_sweep_cursor(chat_ids[-1])
    return chat_ids


def sweep_cursor() -> int:
    try:
        return int(cache.get(SWEEP_CURSOR_KEY) or 0)
    except Exception:  # the cache is down: start from the lowest id
        log.warning("sweep cursor unreadable; starting from the first chat", exc_info=True)
        return 0


def set_sweep_cursor(chat_id: int) -> None:
    try:
        cache.set(SWEEP_CURSOR_KEY, chat_id, timeout=None)
    except Exception:
        log.warning("sweep cursor not saved", exc_info=True)
