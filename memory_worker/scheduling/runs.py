"""The run loop of a chat's consolidation: one run at a time under the chat's lock, reruns while
a request marked the chat pending, and the hand-off of what is left to a fresh task. Also how a
consolidation is asked for (``request_fold``): after a turn commits, by the sweep, the
API and the admin."""

import contextlib
import logging
import time
import uuid
from datetime import datetime

from django.conf import settings
from django.db.models.functions import Now

from conversations.models import Brief
from memory_worker.coordination.deadlines import task_deadline, time_for_a_chunk
from memory_worker.coordination.dispatch import (
    RequestReason,
    TaskByName,
    clear_queued,
    hand_off,
    mark_queued,
)
from memory_worker.coordination.lease import Lease
from memory_worker.coordination.locks import ChatLock, Release
from memory_worker.coordination.request_redis import is_timeout
from memory_worker.coordination.runtime import chat_lock
from memory_worker.folding.execute import fold_once
from memory_worker.folding.outcomes import FoldOutcome, FoldStatus

log = logging.getLogger("chatmem.fold")

CONSOLIDATE_CHAT = TaskByName("chatmem.consolidate_chat")


def request_fold(chat_id: int, trigger: RequestReason, due_at: datetime | None = None) -> bool:
    """Returns whether the request was handed on (queued or started); never raises. ``due_at``:
    when a turn found a fold due, carried to the fold's ledger row (consolidation lag). One
    that could not be handed on is marked on the chat's brief for the sweep's next tick."""
    handed_on = hand_off(
        "consolidation; the sweep will pick the chat up",
        {"chat_id": chat_id, "trigger": trigger},
        lambda: _publish(chat_id, trigger, due_at),
        _run_inline,
        chat_id,
        trigger,
        due_at,
    )
    if not handed_on and settings.MEMORY_DISPATCH != "off":
        mark_enqueue_missed(chat_id)
    return handed_on


def mark_enqueue_missed(chat_id: int) -> None:
    try:
        # Every miss writes its own time: a sweep clears only the marks older than its start,
        # so a miss while it judges the chat is kept for the next tick.
        Brief.objects.filter(chat_id=chat_id).update(enqueue_missed_at=Now())
    except Exception:  # the database too: the cooldown sweep still finds the chat, later
        log.exception(
            "could not mark a missed enqueue", extra={"event": "mark_failed", "chat_id": chat_id}
        )


def _publish(chat_id: int, trigger: RequestReason, due_at: datetime | None) -> None:
    if trigger == RequestReason.TURN and not mark_queued(chat_id):
        return  # a task queued for this chat has not started: it will see this turn (dispatch)
    # An optional keyword, so messages queued without it still run.
    kwargs = {"due_at": due_at.timestamp()} if due_at is not None else {}
    try:
        # retry=False: a dead broker must fail fast instead of holding the request.
        CONSOLIDATE_CHAT.apply_async(args=(chat_id, trigger), kwargs=kwargs, retry=False)
    except Exception as error:
        # After a timeout another call would wait as long again; the marker expires on its own.
        if trigger == RequestReason.TURN and not is_timeout(error):
            with contextlib.suppress(Exception):
                clear_queued(chat_id)
        raise


def _run_inline(chat_id: int, trigger: RequestReason, due_at: datetime | None = None) -> None:
    fold_with_lock(chat_id, trigger, chat_lock(), due_at=due_at)


def fold_with_lock(
    chat_id: int,
    trigger: RequestReason,
    lock: ChatLock,
    *,
    max_runs: int | None = None,
    due_at: datetime | None = None,
    started: float | None = None,
) -> list[FoldOutcome]:
    """sliding-window's is_consolidating / pending_consolidation, made atomic: acquire or mark
    pending; after each run release, or (pending was set) clear it and re-judge once more. Bounded
    by ``max_runs``; past it the lock is released and a fresh task takes over.

    ``due_at`` stays with every fold of this task, reruns included: a rerun's fold was due at
    the latest since then, so its lag is an upper bound. A request that only marked pending
    (the lock was busy) is served by the holder's reruns, timed from the holder's ``due_at``."""
    max_runs = max_runs or settings.MEMORY_MAX_RERUNS_PER_TASK
    token = uuid.uuid4().hex
    # A manual request meeting a held lock leaves one pending mark that says "manual": the
    # holder's rerun serves it; the request does not come back to make the holder run again.
    manual = trigger == RequestReason.MANUAL
    try:
        claimed = lock.acquire_or_mark_pending(chat_id, token, manual=manual)
    finally:
        # Only now, still before reading anything (dispatch), the queued marker goes: a turn over
        # its bound must see this fold queued, then held (or pending on the holder), never
        # neither, or it folds the range itself (before_turn.acquire_or_wait). A lock call that
        # failed gives it up too: no task is left to serve it.
        _give_up_queued_marker(chat_id)
    if not claimed:
        # The holder may have read the chat between that mark and the marker's delete, and a turn
        # committed then found the marker taken and queued nothing: marked again (or taken) after
        # the delete, the holder's next read, or this run's, comes after that turn.
        claimed = lock.acquire_or_mark_pending(chat_id, token, manual=manual)
    if not claimed:
        log.info("lock busy, rerun marked", extra={"event": "lock_contended", "chat_id": chat_id})
        return []
    # Reruns and a fold's later chunks stop in time to end the task before its soft time limit:
    # what they leave is marked pending and handed to a fresh task. ``started``: the task's.
    started = time.monotonic() if started is None else started
    deadline = task_deadline(started)
    # Renewed until the run ends or its hard time limit, when the task is killed anyway.
    lease = Lease(lock, chat_id, token, until=started + settings.MEMORY_TASK_TIME_LIMIT)
    outcomes: list[FoldOutcome] = []
    next_trigger = RequestReason.RERUN
    try:
        with lease:  # stopped before the lock is released, however the run ends
            while True:
                outcome = fold_once(chat_id, trigger, due_at=due_at, deadline=deadline, lease=lease)
                outcomes.append(outcome)
                if outcome.more_due:
                    # One fold per cycle; the backlog left another due: run again, on a fresh
                    # read.
                    lock.mark_pending(chat_id)
                # What a manual fold left was asked for by hand, whether the deadline cut it short
                # or an edit of the summary (or another fold) superseded it: a rerun judged by
                # the policy's own triggers might leave it, and the 202 promised a fold.
                next_trigger = (
                    RequestReason.MANUAL
                    if trigger == RequestReason.MANUAL and manual_left_over(outcome)
                    else RequestReason.RERUN
                )
                # A lost lease hands on (what is left is marked pending).
                if len(outcomes) >= max_runs or not time_for_a_chunk(deadline) or lease.lost:
                    break
                release = lease.release_or_rerun()
                if release is Release.LOST:
                    log.warning("lock expired during a run", extra={"chat_id": chat_id})
                    hand_on_pending(chat_id, lock, next_trigger, due_at)
                if release is not Release.RERUN:
                    return outcomes
                trigger = RequestReason.MANUAL if lock.take_manual(chat_id) else next_trigger
    except BaseException:
        lock.release(chat_id, token)
        hand_on_pending(chat_id, lock, next_trigger, due_at)
        raise
    lock.release(chat_id, token)
    hand_on_pending(chat_id, lock, next_trigger, due_at)
    return outcomes


def _give_up_queued_marker(chat_id: int) -> None:
    try:
        clear_queued(chat_id)
    except Exception:
        # Redis failed after the lock call: the marker expires on its own.
        log.warning("could not clear the queued marker", extra={"chat_id": chat_id})


def manual_left_over(outcome: FoldOutcome) -> bool:
    """Whether a manual fold's outcome leaves part of what was asked for by hand undone."""
    return outcome.cut_short or outcome.status == FoldStatus.SUPERSEDED


def hand_on_pending(
    chat_id: int, lock: ChatLock, trigger: RequestReason, due_at: datetime | None
) -> None:
    """A run ending without serving the chat's pending mark (its own "more due", or a request
    during it) asks for the rerun at once, whatever ended it. The mark is taken in one atomic
    step, so the rerun is asked for once, by whoever takes it first (this, or the sweep once the
    lock is free). Never raises: with Redis down, the mark stays for the sweep."""
    try:
        if not lock.take_pending(chat_id):
            return
        manual = lock.take_manual(chat_id)
    except Exception:
        log.warning("pending mark not read; left to the sweep", extra={"chat_id": chat_id})
        return
    request_fold(chat_id, RequestReason.MANUAL if manual else trigger, due_at)
