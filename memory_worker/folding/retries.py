"""How a failed fold is retried (docs/design.md, the fold): its failure class, backoff and degraded
state on the brief, the worker's own fast retry, a manual request's wait for a held lock, and the
end of the failure state once nothing is due."""

import logging
import random
import time
from collections.abc import Sequence
from dataclasses import dataclass
from datetime import datetime, timedelta

from django.conf import settings
from django.db import transaction
from django.db.models.functions import Now

from conversations.models import Brief, Consolidation, ConsolidationStatus, hold_chat
from memory_worker.folding.ledger import failed_fold_fields
from memory_worker.folding.outcomes import FoldOutcome, FoldStatus
from memory_worker.folding.snapshot import MemorySnapshot

log = logging.getLogger("chatmem.fold")


def failure_backoff(consecutive_failures: int) -> timedelta:
    """Exponential with jitter, so a fleet of failing chats does not retry in lockstep."""
    # The exponent is clamped: 2**1024 seconds overflows a float (and a timedelta far sooner),
    # and the cap is reached long before.
    doublings = min(max(consecutive_failures - 1, 0), 64)
    base = settings.MEMORY_FAILURE_BACKOFF_SECONDS * 2**doublings
    return _jittered(min(base, settings.MEMORY_FAILURE_BACKOFF_MAX_SECONDS))


def _jittered(seconds: float) -> timedelta:
    return timedelta(seconds=seconds * random.uniform(0.8, 1.2))


# What retrying can achieve decides how a failure is retried (backoff retries only for transient
# errors; docs/operations.md, "Failures and the degraded state"). Anything not raised by the
# summarizer (a crash, the soft time limit) counts as transient: it says nothing about the request
# itself. Database errors never get here: the task retries them (tasks.fold_chat).
CRASH_KIND = "crash"

# A run whose worker died (memory_worker.scheduling.sweep) is retried at once and not counted, until
# the chat's background folds died this many times in a row: a fold that kills its worker every time
# (out of memory) then counts as a crash, with backoff and then degraded.
CRASH_AFTER_INTERRUPTIONS = 3


TRANSIENT = "transient"  # timeout, connection, 429 rate limit, 5xx: may work in a moment


# Empty, truncated, refused, over cap, not a summary, or one the fold guard refused ("lossy").
INVALID_OUTPUT = "invalid_output"


REJECTED = "rejected"  # exhausted quota, other 4xx: only a human (billing, config) fixes it


INVALID_OUTPUT_KINDS = frozenset(
    {"empty", "truncated", "refused", "over_cap", "malformed", "lossy"}
)


REJECTED_KINDS = frozenset({"quota", "client_error", "request_refused", "too_large"})


# The request was over the summarizer's window (a context-length 400): no refusal; a background
# fold splits the chunk at once (folds.fold_in_smaller_chunks), a turn's falls back (before_turn).
TOO_LARGE = "too_large"


# The provider refused the request for what it holds, or the model refused to summarize it: one
# message may be the cause, so repeated refusals of a range bisect it (folding.isolation).
REFUSAL_KINDS = frozenset({"request_refused", "refused"})


@dataclass(frozen=True)
class RetryPlan:
    failure_class: str
    delay: timedelta  # until the brief's next_attempt_at (turn triggers wait, the sweep retries)
    degraded: bool
    fast_retry: bool  # the worker queues a delayed retry itself instead of waiting for the sweep
    # A background fold commits the offline summarizer's summary now (MEMORY_SUMMARIZER_FALLBACK).
    fall_back: bool = False


@dataclass(frozen=True)
class Failure:
    """One failed fold of a chat's current streak, as its ledger row says."""

    kind: str
    synchronous: bool = False  # a turn's fold, on the request path


def degrading_failures(streak: Sequence[Failure]) -> int:
    """How many failures of ``streak`` (the chat's failed folds since its last success, oldest
    first, the newest last) count towards degraded. Not counted:

    - a turn's fold's failure: the turn folds the range with the offline summarizer at once
      (before_turn), so the chat's memory kept up; the background folds' streak tells whether
      the model keeps failing the chat;
    - a sampling fluke: an invalid output alone among other failures (neither the failure
      before it nor the one after it, where there is one, is an invalid output). One truncated
      or empty answer between rate limits says nothing about the chat; a repeat does. An
      invalid output that is the streak's only failure counts (nothing says which it is yet).
    """
    counted = 0
    for index, failure in enumerate(streak):
        if failure.synchronous:
            continue
        if is_fluke(streak, index):
            continue
        counted += 1
    return counted


def is_fluke(streak: Sequence[Failure], index: int) -> bool:
    """Whether the ``index``-th failure of ``streak`` is an invalid output alone among other
    failures (degrading_failures)."""
    if failure_class(streak[index].kind) != INVALID_OUTPUT or len(streak) == 1:
        return False
    neighbours = [*streak[max(index - 1, 0) : index], *streak[index + 1 : index + 2]]
    return all(failure_class(other.kind) != INVALID_OUTPUT for other in neighbours)


def repeats_invalid_output(streak: Sequence[Failure]) -> bool:
    """Whether the streak's newest failure is an invalid output after another one."""
    return len(streak) >= 2 and all(
        failure_class(failure.kind) == INVALID_OUTPUT for failure in streak[-2:]
    )


def failure_class(kind: str) -> str:
    if kind in INVALID_OUTPUT_KINDS:
        return INVALID_OUTPUT
    if kind in REJECTED_KINDS:
        return REJECTED
    # TRANSIENT_KINDS and crashes; an unknown kind too: retried on the ladder, then degraded.
    return TRANSIENT


def retry_plan(
    kind: str,
    consecutive_failures: int,
    isolate_next: bool = False,
    streak: Sequence[Failure] | None = None,
) -> RetryPlan:
    """The retry policy for the ``consecutive_failures``-th failure in a row, of this kind.
    ``streak``: the failures in a row, this one last (None: ``consecutive_failures`` of this
    kind, background folds all).

    Degraded is one rule for every kind: MEMORY_DEGRADED_AFTER_FAILURES failed folds in a row,
    whatever their kinds, until the next success; counted by ``degrading_failures``, which
    leaves out a turn's fold's failure (its offline fallback commits at once) and a sampling
    fluke (an invalid output alone among other failures). One malformed output or one refused
    request says little about the chat; a streak does, and a flag that followed the latest kind
    would flip back and forth within a streak. The kind decides only when the next attempt
    comes.

    Transient: exponential backoff with jitter, and a fast retry queued by the worker until the
    chat is degraded; from then on only the sweep retries, on the same ladder. Invalid output:
    one is often a fluke of sampling, so unless it repeats an invalid output (the failure
    before it in the streak) it is retried in MEMORY_INVALID_OUTPUT_RETRY_SECONDS (with the
    stricter prompt, folds.summarizer_for), whatever failed before it; a repeat gets no fast
    retry (the same input keeps failing the same way) and starts the ladder where a degraded
    transient chat stands. Rejected: retrying cannot help before someone acts;
    one attempt per maximum backoff. A manual consolidation always tries at once. With
    MEMORY_SUMMARIZER_FALLBACK, every failure the worker will not retry soon falls back to the
    offline summarizer (a transient one only once degraded: the provider usually comes back
    within the fast retries).

    ``isolate_next``: a refusal whose next attempt bisects the range
    (engine.isolation.isolation_due). That attempt can fix it, so it comes soon: a fast retry,
    and due by the next sweep. So does the next attempt after a chunk too large for the
    summarizer (TOO_LARGE): it splits the chunk too."""
    if streak is None:
        streak = [Failure(kind)] * min(max(consecutive_failures, 1), STREAK_LOOKED_AT)
    plan = _plan(kind, consecutive_failures, isolate_next, streak)
    fall_back = settings.MEMORY_SUMMARIZER_FALLBACK == "offline" and not plan.fast_retry
    return RetryPlan(plan.failure_class, plan.delay, plan.degraded, plan.fast_retry, fall_back)


def _plan(
    kind: str, consecutive_failures: int, isolate_next: bool, streak: Sequence[Failure]
) -> RetryPlan:
    degraded_after = settings.MEMORY_DEGRADED_AFTER_FAILURES
    degraded = degrading_failures(streak) >= degraded_after
    klass = failure_class(kind)
    if isolate_next or kind == TOO_LARGE:
        # Half a sweep interval at most: jittered, it is still due by the next sweep.
        soon = min(
            settings.MEMORY_FAILURE_BACKOFF_SECONDS, settings.MEMORY_SWEEP_INTERVAL_SECONDS / 2
        )
        return RetryPlan(klass, _jittered(soon), degraded, fast_retry=True)
    if klass == TRANSIENT:
        return RetryPlan(klass, failure_backoff(consecutive_failures), degraded, not degraded)
    if klass == INVALID_OUTPUT:
        if not repeats_invalid_output(streak):
            delay = _jittered(settings.MEMORY_INVALID_OUTPUT_RETRY_SECONDS)
            return RetryPlan(klass, delay, degraded, fast_retry=True)
        step = consecutive_failures - 1 + max(degraded_after - 1, 0)
        return RetryPlan(klass, failure_backoff(step), degraded, fast_retry=False)
    return RetryPlan(
        klass, _jittered(settings.MEMORY_FAILURE_BACKOFF_MAX_SECONDS), degraded, fast_retry=False
    )


def fast_retry_delay(outcomes: list[FoldOutcome]) -> float | None:
    """Seconds after which the worker should retry the chat itself, judged by the newest
    attempt that did something (a later ``deferred`` rerun does not cancel the retry)."""
    for outcome in reversed(outcomes):
        if outcome.status == FoldStatus.FAILED:
            return within_visibility(outcome.retry_in)
        if outcome.status in (FoldStatus.SUCCEEDED, FoldStatus.SUPERSEDED):
            return None
    return None


def within_visibility(delay: float | None) -> float | None:
    """A delayed task held by a worker longer than the broker's visibility timeout is handed to
    another worker too (Redis' restore ignores the ETA): the fold would run twice. Past half of
    it, no delayed task; the sweep retries the chat when its next_attempt_at is due."""
    if delay is None or delay >= settings.BROKER_VISIBILITY_TIMEOUT / 2:
        return None
    return delay


def record_failure(
    chat_id: int,
    snapshot: MemorySnapshot,
    ledger: Consolidation,
    *,
    error: str,
    kind: str,
    now: datetime,
    started: float,
    isolate_next: bool = False,
    calls: int = 0,  # an isolation's calls; else the row's default
) -> RetryPlan:
    Consolidation.objects.filter(pk=ledger.pk).update(
        status=ConsolidationStatus.FAILED,
        finished_at=Now(),
        duration_ms=int((time.monotonic() - started) * 1000),
        error=error[:2000],
        error_kind=kind[:32],
        summarizer_calls=calls,
    )
    return fail_brief(ledger, snapshot.version, error, kind, now, isolate_next)


def fail_brief(
    ledger: Consolidation,
    version: int,
    error: str,
    kind: str,
    now: datetime,
    isolate_next: bool = False,
) -> RetryPlan:
    """A failed attempt on the chat's brief: one more consecutive failure, the retry time, and
    degraded per the retry plan; and its log line. Filtered by the version the attempt read: if
    another fold committed meanwhile, this failure is old news.

    The brief's row is locked and read, then updated once, with the count it read plus one: two
    failures of the same version (a crash and the sweep's abandonment, two workers) count two,
    the second waiting for the first's commit. The chat row is held first (hold_chat), as a
    deletion holds it before the brief: taken the other way round, the two deadlocked."""
    chat_id = ledger.chat_id
    with transaction.atomic():
        hold_chat(chat_id)
        count = (
            Brief.objects.select_for_update()
            .filter(chat_id=chat_id, version=version)
            .values_list("consecutive_failures", flat=True)
            .first()
        )
        current = count is not None
        if count is None:  # another fold committed meanwhile (or the chat is gone)
            count = (
                Brief.objects.filter(chat_id=chat_id)
                .values_list("consecutive_failures", flat=True)
                .first()
            )
        failures = (count or 0) + 1
        plan = retry_plan(kind, failures, isolate_next, current_streak(ledger, kind, failures))
        if current:
            Brief.objects.filter(chat_id=chat_id, version=version).update(
                consecutive_failures=failures,
                last_error=error[:2000],
                failure_kind=kind[:32],
                degraded=plan.degraded,
                next_attempt_at=now + plan.delay,
                updated_at=Now(),
            )
    if not current:
        # Another fold committed meanwhile: neither a retry nor a fallback of this range is due.
        plan = RetryPlan(plan.failure_class, plan.delay, plan.degraded, fast_retry=False)
    log.warning(
        "fold failed",
        extra={
            **failed_fold_fields(ledger),
            "error_kind": kind,
            "failure_class": plan.failure_class,
            "transient": plan.failure_class == TRANSIENT,
            "consecutive_failures": failures,
            "degraded": plan.degraded,
            "retry_in_seconds": round(plan.delay.total_seconds(), 1),
            "fast_retry": plan.fast_retry,
            "fall_back": plan.fall_back,
            "error": error[:500],
        },
    )
    return plan


# The newest failures of a streak its judgement reads: far more than MEMORY_DEGRADED_AFTER_FAILURES
# with every fluke and turn's failure between them; a chat failing hourly for weeks does not
# read its whole streak at every failure.
STREAK_LOOKED_AT = 50


def current_streak(ledger: Consolidation, kind: str, failures: int) -> list[Failure]:
    """The chat's streak of ``failures`` failed folds, oldest first, ending with this one (of
    ``kind``, ``ledger``'s): the ledger's latest failed rows. A row with no kind is an
    abandoned run's (memory_worker.scheduling.sweep), a crash."""
    earlier = (
        Consolidation.objects.filter(chat_id=ledger.chat_id, status=ConsolidationStatus.FAILED)
        .exclude(pk=ledger.pk)
        .order_by("-id")
        .values_list("error_kind", "synchronous")[: min(failures, STREAK_LOOKED_AT) - 1]
    )
    streak = [Failure(error_kind or CRASH_KIND, synchronous) for error_kind, synchronous in earlier]
    return [*reversed(streak), Failure(kind, ledger.synchronous)]


def prior_refusals(chat_id: int, version: int, from_seq: int) -> int:
    """How many of the latest finished attempts at this summary version and range start, in a
    row, the summarizer refused (REFUSAL_KINDS)."""
    recent = (
        Consolidation.objects.filter(chat_id=chat_id, base_version=version, from_seq=from_seq)
        .exclude(status=ConsolidationStatus.RUNNING)
        .order_by("-id")
        .values_list("status", "error_kind")[:REFUSALS_LOOKED_AT]
    )
    count = 0
    for status, kind in recent:
        if status != ConsolidationStatus.FAILED or kind not in REFUSAL_KINDS:
            break
        count += 1
    return count


# More than the policy ever asks for (engine.isolation.REFUSALS_BEFORE_ISOLATION).
REFUSALS_LOOKED_AT = 10


def clear_failure_state(chat_id: int, next_attempt_at: datetime) -> None:
    """A retry that finds nothing to fold ends the failure state: what failed is not due now (a
    manual fold, which the engine's own triggers would not ask for; a trigger whose condition
    passed). Otherwise the chat would stay degraded, and the sweep would queue its "due" retry
    every minute, for nothing. Only if no newer failure has set another retry time."""
    cleared = Brief.objects.filter(chat_id=chat_id, next_attempt_at=next_attempt_at).update(
        next_attempt_at=None, degraded=False, consecutive_failures=0, failure_kind=""
    )
    if cleared:
        log.info(
            "failure state cleared: nothing is due",
            extra={"event": "failure_cleared", "chat_id": chat_id},
        )


def in_backoff(snapshot: MemorySnapshot, now: datetime) -> bool:
    return snapshot.next_attempt_at is not None and snapshot.next_attempt_at > now


# A database error under a fold (PostgreSQL restarting or failing over, the connection killed
# while the summarizer answered) is retried by the task itself: a delayed task of its own with
# the same trigger (a manual request stays manual) after MEMORY_FAILURE_BACKOFF_SECONDS, doubling
# (with the default settings 30, 60, 120, 240, 480 s, ±20 %), at most DATABASE_ERROR_RETRIES
# times. The count travels with the task, not on the brief: the database may be down, and the
# chat's folds are not what fails. Past the last retry (or a delay past half the visibility
# timeout) the task fails with the error, and the sweep, then turns, find the chat again once
# the database is up.
DATABASE_ERROR_RETRIES = 5


def database_retry_delay(db_retries: int) -> float | None:
    """Seconds until the task that met a database error runs again, or None: no retry left."""
    if db_retries >= DATABASE_ERROR_RETRIES:
        return None
    return within_visibility(failure_backoff(db_retries + 1).total_seconds())
