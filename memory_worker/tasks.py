"""Celery tasks: thin wrappers over the memory services. Arguments are ids only; names are
stable so queued messages survive deploys, and the services publish them by name
(memory_worker.coordination.dispatch.TaskByName)."""

import logging
import time
from datetime import UTC, datetime
from typing import Any

from celery import Task, shared_task
from django.conf import settings

from conversations.rows import DATABASE_ERRORS, database_now
from memory_worker import hooks
from memory_worker.agents import summaries as agent_summaries
from memory_worker.coordination.dispatch import RequestReason, clear_manual_queued
from memory_worker.coordination.runtime import chat_lock
from memory_worker.folding import retries
from memory_worker.folding.ledger import prune_ledger
from memory_worker.folding.outcomes import FoldStatus
from memory_worker.scheduling.runs import (
    CONSOLIDATE_CHAT,
    fold_with_lock,
    request_fold,
)
from memory_worker.scheduling.sweep import beat_pass_due, recover_dead_runs, sweep_candidates

log = logging.getLogger("chatmem.tasks")


class WorkerDeadlinesTask(Task):  # type: ignore[misc]
    """A task whose time limits are the worker's own.

    Celery writes the publishing process's time limits into every message, and a worker obeys the
    message's over its own. So a web process (or beat) with other deadlines than the workers' set
    the limits of every fold it queued, while the lock TTL they must nest within (docs/design.md,
    the fold; checked at the worker's start-up) is the worker's. Published with no limits, a message
    runs under the worker's MEMORY_TASK_SOFT_TIME_LIMIT and MEMORY_TASK_TIME_LIMIT.
    """

    def apply_async(self, args: Any = None, kwargs: Any = None, *extra: Any, **options: Any) -> Any:
        options.setdefault("time_limit", None)
        options.setdefault("soft_time_limit", None)
        return super().apply_async(args, kwargs, *extra, **options)


@shared_task(
    name=CONSOLIDATE_CHAT.name,
    queue=CONSOLIDATE_CHAT.queue,
    acks_late=True,
    base=WorkerDeadlinesTask,
)
def fold_chat(
    chat_id: int,
    trigger: str = RequestReason.TURN,  # a string in the message: converted below
    due_at: float | None = None,
    waited: float = 0.0,  # a keyword messages already in the broker may carry; unused
    db_retries: int = 0,
) -> list[str]:
    started = time.monotonic()  # Celery's time limits count from here
    # Before reading anything: a manual request from here on queues a new task (dispatch). The
    # turn's queued marker is cleared once the lock is taken (runs.fold_with_lock).
    requested = RequestReason(trigger)
    if requested == RequestReason.MANUAL:
        try:
            clear_manual_queued(chat_id)
        except Exception:
            # Redis is down: the marker expires on its own; the lock below will fail the task.
            log.warning("could not clear the manual marker", extra={"chat_id": chat_id})
    due = datetime.fromtimestamp(due_at, UTC) if due_at is not None else None
    try:
        outcomes = fold_with_lock(chat_id, requested, chat_lock(), due_at=due, started=started)
    except DATABASE_ERRORS as error:
        # The lock is already released (fold_with_lock) and the ledger row marked
        # interrupted if the database let it be (folding.ledger.record_interrupted).
        if not _retry_after_database_error(chat_id, requested, due_at, db_retries, error):
            raise
        return [FoldStatus.DATABASE_ERROR]
    # The policy lives in the service; the task only queues what it says.
    delay = retries.fast_retry_delay(outcomes)
    if delay is not None:
        _queue_again(chat_id, RequestReason.RETRY, delay)
    return [outcome.status for outcome in outcomes]


def _retry_after_database_error(
    chat_id: int,
    trigger: RequestReason,
    due_at: float | None,
    db_retries: int,
    error: BaseException,
) -> bool:
    """Whether a retry was asked for (queued, or its publish failed and was logged)."""
    context = {"chat_id": chat_id, "trigger": trigger, "db_retries": db_retries}
    delay = retries.database_retry_delay(db_retries)
    if delay is None:
        # The task then fails with the error: Celery logs it, with its traceback.
        log.warning("database error; no retry left", extra=context)
        return False
    log.warning(
        "database error; retrying in %.0f s: %s",
        delay,
        f"{type(error).__name__}: {str(error)[:300]}",
        extra={**context, "event": "db_retry", "retry_in_seconds": round(delay, 1)},
    )
    kwargs: dict[str, float] = {"db_retries": db_retries + 1}
    if due_at is not None:
        kwargs["due_at"] = due_at
    _queue_again(chat_id, trigger, delay, kwargs)
    return True


def _queue_again(
    chat_id: int, trigger: RequestReason, delay: float, kwargs: dict[str, float] | None = None
) -> None:
    # A new delayed task rather than Celery's retry(): the attempt is already recorded, so this
    # one ends cleanly. If the broker refuses, the sweep retries a failed fold once
    # next_attempt_at is due; a waiting manual request is lost (logged) and can be asked again.
    try:
        fold_chat.apply_async(
            args=(chat_id, trigger), kwargs=kwargs or {}, countdown=delay, retry=False
        )
    except Exception:
        log.exception(
            "could not queue the task again; the sweep will pick the chat up",
            extra={"event": "enqueue_failed", "chat_id": chat_id, "trigger": trigger},
        )


# Its own queue (settings.MEMORY_SWEEP_QUEUE), consumed by every worker of the memory queue: on
# the memory queue it would wait behind the fold backlog it is meant to catch up.
@shared_task(name="chatmem.sweep", queue=settings.MEMORY_SWEEP_QUEUE, base=WorkerDeadlinesTask)
def sweep(scheduled: bool = False) -> int:
    now = database_now()
    if scheduled and not beat_pass_due("sweep", settings.MEMORY_SWEEP_INTERVAL_SECONDS, now):
        return 0
    recover_runs()  # also here: beat's own recovery entry may be missing (an older beat)
    chat_ids = sweep_candidates(now, chat_lock(), settings.MEMORY_SWEEP_BATCH)
    for chat_id in chat_ids:
        request_fold(chat_id, RequestReason.SWEEP)
    hooks.replay_missed_daily_notes(now)  # daily-notes hooks whose publish failed
    prune_ledger()
    log.info("sweep", extra={"event": "sweep", "enqueued": len(chat_ids)})
    return len(chat_ids)


# Every MEMORY_RECOVERY_INTERVAL_SECONDS, on the sweep's queue: a run whose worker died is
# found once its heartbeat is stale (deadlines.fold_heartbeat_stale_after), and its chat folded
# at once.
@shared_task(
    name="chatmem.recover_runs", queue=settings.MEMORY_SWEEP_QUEUE, base=WorkerDeadlinesTask
)
def recover_runs(scheduled: bool = False) -> int:
    now = database_now()
    interval = settings.MEMORY_RECOVERY_INTERVAL_SECONDS
    if scheduled and not beat_pass_due("recover_runs", interval, now):
        return 0
    refolds = recover_dead_runs(now)
    for refold in refolds:  # after the rows' marking committed
        request_fold(refold.chat_id, refold.trigger)
    return len(refolds)


# A hook that fails (the daily notes' model call hit a 429, the database blinked, the soft time
# limit) is retried with backoff, 30 s doubling to 480 s (no jitter: each task is its own fold
# range, there is no herd to spread): once its task was acknowledged, nothing else would ever
# run that fold range through it again. Hooks must therefore be idempotent per range (the daily
# notes merge a range at most once). A hook whose process dies (out of memory) is retried the
# same number of times, 3 minutes apart, not put back on the queue at once for ever
# (retry_on_worker_lost; reject_on_worker_lost alone requeues without counting).
FLUSH_HOOK_RETRIES = 5


@shared_task(
    base=WorkerDeadlinesTask,
    name=hooks.RUN_FLUSH_HOOK.name,
    queue=hooks.RUN_FLUSH_HOOK.queue,
    acks_late=True,
    autoretry_for=(Exception,),
    max_retries=FLUSH_HOOK_RETRIES,
    retry_backoff=30,
    retry_backoff_max=480,
    retry_jitter=False,
    retry_on_worker_lost=True,
)
def run_flush_hook(hook_path: str, chat_id: int, from_seq: int, to_seq: int, version: int) -> None:
    hooks.run_hook(hook_path, chat_id, from_seq, to_seq, version)


@shared_task(
    name=agent_summaries.SUMMARIZE_AGENT_TURNS.name,
    queue=agent_summaries.SUMMARIZE_AGENT_TURNS.queue,
    acks_late=True,
    base=WorkerDeadlinesTask,
    # No lock bounds it: a task whose process dies is retried (3 times, 3 minutes apart), not
    # put back on the queue at once for ever (reject_on_worker_lost alone requeues uncounted).
    retry_on_worker_lost=True,
)
def summarize_agent_turns(chat_id: int, from_seq: int | None = None) -> int:
    started = time.monotonic()  # Celery's time limits count from here
    # Late ack is safe: the service applies each turn once (a conditional commit on its
    # watermark), so a redelivered task finds nothing left to do. The service commits turn by
    # turn and hands on what would not finish before the soft time limit.
    return agent_summaries.summarize_turns(chat_id, from_seq, started=started)
