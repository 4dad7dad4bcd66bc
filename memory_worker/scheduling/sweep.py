"""The beat sweep's judgement: runs whose worker died (their heartbeat stopped), and the chats to
queue (retries due, chats whose fold could not be queued, cooled chats with a fold due, chats
marked pending whose run died)."""

import logging
from dataclasses import dataclass
from datetime import datetime, timedelta

from django.conf import settings
from django.core.cache import cache
from django.db import transaction
from django.db.models import F, Q
from django.db.models.functions import Now

from conversations.models import Brief, Consolidation, ConsolidationStatus, hold_chat
from memory_worker.coordination.deadlines import fold_heartbeat_stale_after
from memory_worker.coordination.dispatch import RequestReason
from memory_worker.coordination.locks import ChatLock
from memory_worker.engine import policy as engine
from memory_worker.folding.execute import decide_for_chat
from memory_worker.folding.ledger import DATABASE_ERROR, failed_fold_fields
from memory_worker.folding.retries import CRASH_AFTER_INTERRUPTIONS, CRASH_KIND, fail_brief
from memory_worker.folding.snapshot import read_chat_and_snapshot
from memory_worker.scheduling.recovery import catch_up

log = logging.getLogger("chatmem.fold")


INTERRUPTED = "interrupted: worker died"
ABANDONED = "abandoned: worker died"


@dataclass(frozen=True)
class Refold:
    """A chat whose run died, to be folded again at once (after the marking committed)."""

    chat_id: int
    trigger: RequestReason


def recover_dead_runs(now: datetime) -> list[Refold]:
    """Ledger rows left ``running`` by a run whose process died (kill -9, out of memory, a node
    drained, a web process gone mid-turn): its chunk wrote nothing (each commits atomically). A
    live fold stamps its row's heartbeat (database time) when it writes the row and before each
    further summarizer call, so a row whose heartbeat is older than one slow call and then some
    (deadlines.fold_heartbeat_stale_after) is dead. The chat's lock does not say: it can lapse
    under a live fold (Redis restarted without persistence, a worker cut off from Redis past
    the lock's TTL, a process stall), a later run may hold it, and a turn's fold may hold none.

    A dead run is marked interrupted, not counted as the chat's failure, and its chat returned
    to be folded at once; one that kills its worker every time (out of memory) is a crash on
    the chat's brief from the CRASH_AFTER_INTERRUPTIONS-th death in a row (backoff, then
    degraded), so it is not retried at once for ever."""
    # Database time: the rows were stamped by many hosts, and this one's clock may differ.
    dead = Consolidation.objects.filter(status=ConsolidationStatus.RUNNING).filter(
        stopped_beating()
    )
    refolds = []
    for ledger in dead.order_by("pk"):  # a chat's earlier deaths are counted first
        try:
            refold = interrupt_run(ledger, now)
            if refold is not None:
                refolds.append(refold)
        except Exception:  # one chat's error must not cancel the rest of the sweep
            log.exception(
                "could not mark a dead run",
                extra={"event": "sweep_error", "chat_id": ledger.chat_id},
            )
    return refolds


def stopped_beating() -> Q:
    """Running rows whose heartbeat is older than the bound, in database time (a row from before
    heartbeats: its start)."""
    stale_before = Now() - timedelta(seconds=fold_heartbeat_stale_after())
    return Q(heartbeat_at__lt=stale_before) | Q(
        heartbeat_at__isnull=True, started_at__lt=stale_before
    )


def interrupt_run(ledger: Consolidation, now: datetime) -> Refold | None:
    """The dead run's row marked, and the chat to fold again if it is to be at once. The row
    and a crash's count on the brief change together: had the count failed alone, the row
    (then not running) would never be counted by a later sweep."""
    crash = not ledger.synchronous and deaths_in_a_row(ledger) >= CRASH_AFTER_INTERRUPTIONS
    status, error = (
        (ConsolidationStatus.FAILED, ABANDONED)
        if crash
        else (ConsolidationStatus.INTERRUPTED, INTERRUPTED)
    )
    with transaction.atomic():
        # The chat first, as a deletion takes it before the ledger and the brief.
        hold_chat(ledger.chat_id)
        # Conditional: a row that finished meanwhile keeps its own outcome, and one whose fold
        # beat meanwhile (it was alive after all) stays running.
        marked = (
            Consolidation.objects.filter(pk=ledger.pk, status=ConsolidationStatus.RUNNING)
            .filter(stopped_beating())
            .update(
                status=status,
                error=error,
                error_kind=CRASH_KIND if crash else "",
                finished_at=now,
            )
        )
        if marked and crash:
            fail_brief(ledger, ledger.base_version, ABANDONED, CRASH_KIND, now)
    if not marked or crash:
        return None
    log.warning(
        "fold interrupted: its worker died",
        extra={
            **failed_fold_fields(ledger),
            "ledger_id": ledger.pk,
            "outcome": str(ConsolidationStatus.INTERRUPTED),
        },
    )
    # A synchronous fold died with its web process: the chat's next turn judges it again.
    if ledger.synchronous:
        return None
    manual = ledger.trigger == engine.Trigger.MANUAL
    return Refold(ledger.chat_id, RequestReason.MANUAL if manual else RequestReason.SWEEP)


def deaths_in_a_row(ledger: Consolidation) -> int:
    """How many of the chat's latest background attempts, this one included, died with their
    worker, up to CRASH_AFTER_INTERRUPTIONS: a fold that commits or fails ends the run."""
    earlier = (
        Consolidation.objects.filter(chat_id=ledger.chat_id, synchronous=False, pk__lt=ledger.pk)
        .exclude(status=ConsolidationStatus.RUNNING)
        # A database outage's interruption says nothing of what the fold does to its worker.
        .exclude(error__endswith=DATABASE_ERROR)
        .order_by("-pk")
        .values_list("status", "error")[: CRASH_AFTER_INTERRUPTIONS - 1]
    )
    deaths = 1
    for status, error in earlier:
        if status != ConsolidationStatus.INTERRUPTED and error != ABANDONED:
            break
        deaths += 1
    return deaths


def sweep_candidates(now: datetime, lock: ChatLock, limit: int) -> list[int]:
    """Chats the beat sweep should look at: failed chats whose retry is due, chats whose
    cooldown has passed with messages beyond the watermark, and chats marked pending that no
    run holds. Provider-wide failures are caught up first once the provider answers again
    (scheduling.recovery)."""
    catch_up(now, limit)
    retry_due = Brief.objects.filter(
        next_attempt_at__lte=now, chat__folds_paused=False
    ).values_list("chat_id", flat=True)
    chosen = dict.fromkeys([*retry_due[:limit], *orphaned_pending(lock, limit)])
    for chat_id in missed_enqueues(now, limit - len(chosen)):
        chosen[chat_id] = None
    # Only as many as the batch has room for: the rotation moves past every chat it judges,
    # so a due chat judged and then cut off would wait a whole round.
    room = limit - len(chosen)
    for chat_id in next_cooled_candidates(now, room) if room > 0 else []:
        if cooldown_fold_due(chat_id, now):
            chosen[chat_id] = None
    return list(chosen)[:limit]


def missed_enqueues(now: datetime, limit: int) -> list[int]:
    """Chats whose fold came due when it could not be queued (runs.mark_enqueue_missed), up to
    ``limit``, with a fold still due, whatever their last fold's age: after a broker outage
    they fold at the sweep's first tick. Each mark judged is cleared; a request that then fails
    to queue marks the chat again."""
    if limit <= 0:
        return []
    marked = list(
        Brief.objects.filter(
            enqueue_missed_at__isnull=False,
            next_attempt_at__isnull=True,
            chat__folds_paused=False,
        )
        .order_by("enqueue_missed_at")
        .values_list("chat_id", flat=True)[:limit]
    )
    due = [chat_id for chat_id in marked if cooldown_fold_due(chat_id, now)]
    # Conditional: a miss marked after this sweep's now stays for the next tick.
    Brief.objects.filter(chat_id__in=marked, enqueue_missed_at__lte=now).update(
        enqueue_missed_at=None
    )
    return due


def orphaned_pending(lock: ChatLock, limit: int) -> list[int]:
    """Chats marked pending that no run holds (its holder died, or Redis failed its hand-on),
    up to ``limit``, their marks taken: a live holder serves its chat's mark itself when it
    releases, and a mark is served once, by whoever takes it first."""
    taken: list[int] = []
    for chat_id in lock.pending_chats():
        if len(taken) >= limit:
            break
        if lock.take_pending(chat_id, only_if_free=True):
            lock.take_manual(chat_id)  # the sweep's fold judges by the policy's triggers
            taken.append(chat_id)
    return taken


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
            chat__folds_paused=False,
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


def beat_pass_due(name: str, interval: float, now: datetime) -> bool:
    """Whether a pass beat queued (the sweep, the recovery) should run: not when the last one
    ran less than half an ``interval`` ago, so a backlog queued while no worker ran costs a
    read each, not a pass each. Timed by the database's clock (``now``), as Celery's expiry
    would not be: it compares beat's clock with the worker's. The cache lost, the pass runs."""
    key = f"chatmem:beat-pass:{name}"
    try:
        last = cache.get(key)
        if last is not None and (now - last).total_seconds() < interval / 2:
            return False
        cache.set(key, now, timeout=None)
    except Exception:
        log.warning("beat pass time unreadable; running the pass", exc_info=True)
    return True
