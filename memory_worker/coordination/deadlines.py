"""When a memory task stops starting summarizer calls: its soft time limit, less room for the
commit and the hand-off of what is left to a fresh task; when a turn's fold stops starting them;
and how stale a running fold's heartbeat may grow."""

import time

from django.conf import settings


def time_for_a_chunk(deadline: float | None) -> bool:
    """Whether one more summarizer call, at its slowest (MEMORY_LLM_TIMEOUT_SECONDS), still ends
    before ``deadline``. A rare stricter retry after an over-cap summary can still outrun it;
    the soft time limit then fails that one chunk, and the chunks before it stay committed."""
    if deadline is None:
        return True
    return time.monotonic() + settings.MEMORY_LLM_TIMEOUT_SECONDS <= deadline


def turn_fold_deadline(started: float) -> float:
    """When a turn's synchronous folding, which started at ``started`` (``time.monotonic()``,
    when the turn first judged its context), stops starting summarizer calls: within the turn
    slot's lifetime (TURN_SLOT_STALE_SECONDS), so a live turn's slot never looks abandoned, and
    within the wait and the fold a turn is given by WEB_GRACEFUL_TIMEOUT_SECONDS
    (MEMORY_LLM_TIMEOUT_SECONDS each). What is left is the next fold's."""
    budget = min(settings.TURN_SLOT_STALE_SECONDS, 2 * settings.MEMORY_LLM_TIMEOUT_SECONDS)
    return started + budget


def fold_heartbeat_stale_after() -> float:
    """How old a running fold's heartbeat (its ledger row's ``heartbeat_at``) may grow while
    the fold lives, in seconds: MEMORY_LOCK_TTL_SECONDS, the time a dead holder keeps its chat's
    lock. A thread renews it four times as often (folding.ledger.Heartbeat), so a database blink
    or a short process stall is not a death. A row whose heartbeat is older is a dead fold's
    (memory_worker.scheduling.sweep)."""
    return float(settings.MEMORY_LOCK_TTL_SECONDS)


def call_lifetime() -> float:
    """How long a fold's heartbeat thread goes on after a summarizer call started: that call at
    its slowest, which may hold a stricter retry after an over-cap summary (two model requests
    of MEMORY_LLM_TIMEOUT_SECONDS each), and MEMORY_LOCK_TTL_SECONDS more for the database work
    around it."""
    return 2 * settings.MEMORY_LLM_TIMEOUT_SECONDS + settings.MEMORY_LOCK_TTL_SECONDS


def task_deadline(started: float) -> float:
    """When a task that started at ``started`` (``time.monotonic()``) stops starting summarizer
    calls: its soft time limit, less a tenth for the commit and the hand-off (Celery's limit
    counts from the task's start, before the lock was even asked for)."""
    return started + 0.9 * settings.MEMORY_TASK_SOFT_TIME_LIMIT
