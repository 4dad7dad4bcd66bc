"""Folding messages into the summary (DESIGN §6). Called by the Celery tasks, the in-process
runner of the embedded mode, the turn (synchronous fold) and the admin.

The fold is: read a snapshot (brief and unfolded messages), let the pure engine decide, call
the summarizer with no database transaction open, then commit with ONE conditional UPDATE of the
brief (``WHERE version = v AND last_consolidated = W``). Zero rows means another fold committed
first: this result is stale, nothing is written, the ledger row says ``superseded``. That UPDATE,
not the Redis lock, is what makes folding exactly-once. On PostgreSQL the ledger row's outcome is
written in the same statement (commit_in_one_statement), elsewhere in the same transaction.
"""

import logging
import random
import socket
import time
import uuid
from dataclasses import dataclass, replace
from datetime import datetime, timedelta
from functools import partial
from typing import Any

from django.conf import settings
from django.core.cache import cache
from django.db import IntegrityError, InterfaceError, OperationalError, connection, transaction
from django.db.models import F, Field, Model, Q
from django.utils import timezone

from conversations import rows
from conversations.models import Brief, Chat, Consolidation, ConsolidationStatus, Message
from memory_worker import policy as engine
from memory_worker.backends import get_summarizer
from memory_worker.chat_policy import policy_for_chat, variant_context_tokens
from memory_worker.engine_state import Msg
from memory_worker.locks import ChatLock, Release
from memory_worker.signals import messages_folded
from memory_worker.state import (
    MemorySnapshot,
    after_fold,
    engine_state,
    read_chat_and_snapshot,
)
from memory_worker.summarizers import FoldMessage, Summarizer, SummarizerError, SummaryResult
from memory_worker.tokens import count_tokens
from memory_worker.turn_groups import split_for_summarizer

log = logging.getLogger("chatmem.fold")

WORKER_NAME = f"{socket.gethostname()}:{uuid.uuid4().hex[:6]}"


@dataclass(frozen=True)
class FoldOutcome:
    status: str  # "nothing" | "deferred" | "succeeded" | "superseded" | "failed"
    decision: engine.Decision | None = None
    ledger_id: int | None = None
    error: str = ""
    transient: bool = False
    kind: str = ""  # the summarizer's error kind when failed ("crash" for anything else)
    retry_in: float | None = None  # seconds until the worker's own retry; None: no fast retry
    # Succeeded: whether the state this fold committed, judged on the messages it read, still
    # has a fold due (one fold per cycle: a long backlog takes several).
    more_due: bool = False
    # Succeeded: the deadline stopped it before the end of the decided range.
    cut_short: bool = False


def decide_for_chat(
    chat: Chat, snapshot: MemorySnapshot, trigger: str, now: datetime
) -> engine.Decision | None:
    state = engine_state(chat, snapshot, variant_context_tokens(chat))
    policy = policy_for_chat(chat)
    if trigger == "manual":
        return engine.decide_manual(state, policy)
    return engine.decide(state, policy, now)


def consolidate_once(
    chat_id: int,
    trigger: str,
    now: datetime | None = None,
    due_at: datetime | None = None,
    deadline: float | None = None,
) -> FoldOutcome:
    """One policy evaluation and at most one fold (seed 000 §7: one summarization per cycle).
    ``due_at``: when the turn that asked for this run found a fold due (for the lag figure);
    ``deadline``: see ``execute_fold``."""
    now = now or timezone.now()
    found = read_chat_and_snapshot(chat_id)
    if found is None:  # deleted while queued
        return FoldOutcome("nothing")
    chat, snapshot = found
    if trigger != "manual" and in_backoff(snapshot, now):
        return FoldOutcome("deferred")
    decision = decide_for_chat(chat, snapshot, trigger, now)
    if decision is None:
        if snapshot.next_attempt_at is not None:
            clear_failure_state(chat_id, snapshot.next_attempt_at)
        return FoldOutcome("nothing")
    return execute_fold(chat, snapshot, decision, now=now, due_at=due_at, deadline=deadline)


def clear_failure_state(chat_id: int, next_attempt_at: datetime) -> None:
    """A retry that finds nothing to fold ends the failure state: what failed is no longer due
    (a manual fold, which the engine's own triggers would not have asked for; a trigger whose
    condition passed). Otherwise the chat stayed degraded, and the sweep queued its "due" retry
    every minute, for nothing. Only if no newer failure has set another retry time."""
    cleared = Brief.objects.filter(chat_id=chat_id, next_attempt_at=next_attempt_at).update(
        next_attempt_at=None, degraded=False, consecutive_failures=0
    )
    if cleared:
        log.info(
            "failure state cleared: nothing is due",
            extra={"event": "failure_cleared", "chat_id": chat_id},
        )


def in_backoff(snapshot: MemorySnapshot, now: datetime) -> bool:
    return snapshot.next_attempt_at is not None and snapshot.next_attempt_at > now


def execute_fold(
    chat: Chat,
    snapshot: MemorySnapshot,
    decision: engine.Decision,
    *,
    now: datetime,
    synchronous: bool = False,
    due_at: datetime | None = None,
    deadline: float | None = None,
    summarizer: Summarizer | None = None,
) -> FoldOutcome:
    """The decided range, summarized and committed chunk by chunk. A range larger than the
    summarizer's input budget is split at turn boundaries (DESIGN §5: chunks, never trimming),
    and each chunk is a fold of its own: one summarizer call, its own fencing step, summary
    version and ledger row. A later chunk's failure, the task's time limit or the worker's death
    keeps the chunks already committed, so the next attempt starts where they left off: when all
    chunks committed together, a backlog whose chunks took longer than the task's time limit was
    summarized again from its start by every retry, and never folded.

    ``deadline`` (``time.monotonic()``): no chunk after the first starts unless it can finish
    by then (``time_for_a_chunk``); the outcome then says more is due and the caller hands on.
    The outcome is the last chunk's; ``decision`` stays the whole range's. ``summarizer``: the
    configured one (for the chat's cap) unless given."""
    to_fold = [m for m in snapshot.unfolded if decision.from_seq <= m.seq <= decision.to_seq]
    chunks = split_for_summarizer(
        [Msg(m.seq, m.role, m.token_count) for m in to_fold],
        settings.MEMORY_SUMMARIZER_INPUT_BUDGET,
    )
    # The chat's own summary cap: its policy's bound and the synchronous fold's plan count on it.
    summarizer = summarizer or get_summarizer(policy_for_chat(chat).summary_token_cap)
    outcome = FoldOutcome("nothing", decision)
    for index, (first, last) in enumerate(chunks):
        if index and not time_for_a_chunk(deadline):
            return replace(outcome, decision=decision, more_due=True, cut_short=True)
        chunk = engine.Decision(decision.trigger, first, last)
        batch = [m for m in to_fold if first <= m.seq <= last]
        outcome, snapshot = fold_chunk(
            chat,
            snapshot,
            chunk,
            batch,
            summarizer,
            now=now,
            synchronous=synchronous,
            due_at=due_at,
        )
        if outcome.status != ConsolidationStatus.SUCCEEDED:
            return replace(outcome, decision=decision)
    more_due = still_due(chat, snapshot, now)
    return replace(outcome, decision=decision, more_due=more_due)


def time_for_a_chunk(deadline: float | None) -> bool:
    """Whether one more summarizer call, at its slowest (MEMORY_LLM_TIMEOUT_SECONDS), still ends
    before ``deadline``. A rare stricter retry after an over-cap summary can still outrun it;
    the soft time limit then fails that one chunk, and the chunks before it stay committed."""
    if deadline is None:
        return True
    return time.monotonic() + settings.MEMORY_LLM_TIMEOUT_SECONDS <= deadline


def task_deadline(started: float) -> float:
    """When a task that started at ``started`` (``time.monotonic()``) stops starting summarizer
    calls: its soft time limit, less a tenth for the commit and the hand-off (Celery's limit
    counts from the task's start, before the lock was even asked for)."""
    return started + 0.9 * settings.MEMORY_TASK_SOFT_TIME_LIMIT


def fold_chunk(
    chat: Chat,
    snapshot: MemorySnapshot,
    chunk: engine.Decision,
    batch: list[Message],
    summarizer: Summarizer,
    *,
    now: datetime,
    synchronous: bool,
    due_at: datetime | None,
) -> tuple[FoldOutcome, MemorySnapshot]:
    """One summarizer call over ``batch`` (the chunk's messages) and its commit. Returns the
    outcome and the snapshot as it stands after it (``snapshot`` unless it committed)."""
    started = time.monotonic()
    ledger = Consolidation(
        chat=chat,
        due_at=due_at,
        trigger=chunk.trigger,
        from_seq=chunk.from_seq,
        to_seq=chunk.to_seq,
        base_version=snapshot.version,
        synchronous=synchronous,
        summary_tokens_before=snapshot.summary_tokens,
        worker=WORKER_NAME,
    )
    try:
        record_running(ledger)
    except IntegrityError:
        # The ledger row's chat is gone: deleted after this fold read its snapshot (its foreign
        # key is checked at the insert's commit). Nothing to fold; a turn folding
        # synchronously re-reads the chat and answers its 404.
        if Chat.objects.filter(pk=chat.pk).exists():
            raise
        log.info("chat deleted before its fold started", extra={"chat_id": chat.pk})
        return FoldOutcome("nothing", chunk), snapshot
    try:
        return summarize_and_commit(
            chat, snapshot, chunk, batch, summarizer, ledger, now=now, started=started
        )
    except DATABASE_ERRORS as error:
        # The database failed under the fold (PostgreSQL restarting, the connection killed
        # while the summarizer answered): the attempt says nothing about the chat. Its row is
        # not left "running" for the sweep to abandon a lock TTL later if it can be marked
        # now; the caller retries (tasks.consolidate_chat).
        record_interrupted(ledger, error, started)
        raise


# Errors of the database itself, not of what was asked of it: a lost or refused connection, a
# restart, a cancelled statement, a deadlock. Retrying later may work (tasks.consolidate_chat).
DATABASE_ERRORS = (OperationalError, InterfaceError)


def summarize_and_commit(
    chat: Chat,
    snapshot: MemorySnapshot,
    chunk: engine.Decision,
    batch: list[Message],
    summarizer: Summarizer,
    ledger: Consolidation,
    *,
    now: datetime,
    started: float,
) -> tuple[FoldOutcome, MemorySnapshot]:
    """The summarizer call, with no transaction open, then the commit (or the failure's record)
    of the chunk whose ledger row ``record_running`` wrote."""
    try:
        result = summarizer.summarize(
            snapshot.summary, [FoldMessage(m.seq, m.role, m.content) for m in batch]
        )
    except SummarizerError as error:
        plan = record_failure(chat.pk, snapshot, ledger, str(error), error.kind, now, started)
        failed = FoldOutcome(
            "failed",
            chunk,
            ledger.pk,
            str(error),
            error.transient,
            error.kind,
            plan.delay.total_seconds() if plan.fast_retry else None,
        )
        return failed, snapshot
    except Exception as error:
        # Includes Celery's soft time limit: the ledger must not stay "running".
        # The name only: the error's text may hold anything (SQL, a provider's account details),
        # and the brief's last_error is shown to the chat's owner; the traceback goes to the log
        # with the task's failure.
        failure = f"{type(error).__name__} (crashed; see the worker's log)"
        record_failure(chat.pk, snapshot, ledger, failure, CRASH_KIND, now, started)
        raise
    return commit_fold(chat, snapshot, chunk, ledger, result, now, started)


def record_interrupted(ledger: Consolidation, error: BaseException, started: float) -> None:
    """Best effort: the ledger row of a fold a database error interrupted, marked failed, and
    the attempt's ``fold`` log line. Only a row still "running": the error may have come after
    the commit itself landed (the connection lost before its answer), and then the row says so.
    The brief is left alone: nothing is wrong with the chat's folds, and the task counts its own
    retries. The database may still be down (this then fails, within DB_CONNECT_TIMEOUT, and
    says so): the sweep abandons the row once no lock can cover it any more."""
    duration_ms = int((time.monotonic() - started) * 1000)
    error_name = type(error).__name__
    marked: bool | None = None  # unknown: the row could not be written
    try:
        if not connection.in_atomic_block:  # (in one, closing would break the caller's)
            # A connection the error broke is replaced, not reused (it would fail again).
            connection.close_if_unusable_or_obsolete()
        marked = bool(
            Consolidation.objects.filter(pk=ledger.pk, status=ConsolidationStatus.RUNNING).update(
                status=ConsolidationStatus.FAILED,
                finished_at=timezone.now(),
                duration_ms=duration_ms,
                error=f"{error_name} (database error)",
            )
        )
    except Exception as unmarked:
        log.warning(
            "could not mark the interrupted fold failed (%s); the sweep will",
            type(unmarked).__name__,
            extra={"chat_id": ledger.chat_id, "ledger_id": ledger.pk},
        )
    if marked is False:
        # No longer running: the commit landed after all (its outcome stands), or the chat is gone.
        log.info(
            "database error after the fold's row was written",
            extra={"chat_id": ledger.chat_id, "ledger_id": ledger.pk, "error": error_name},
        )
        return
    log.warning(
        "fold interrupted by a database error",
        extra={
            **failed_fold_fields(ledger),
            "ledger_id": ledger.pk,
            "error_kind": "database",
            "duration_ms": duration_ms,
            "error": error_name,
        },
    )


def failed_fold_fields(ledger: Consolidation) -> dict[str, Any]:
    """What every failed fold's log line says of the attempt."""
    return {
        "event": "fold",
        "chat_id": ledger.chat_id,
        "trigger": ledger.trigger,
        "synchronous": ledger.synchronous,
        "from_seq": ledger.from_seq,
        "to_seq": ledger.to_seq,
        "outcome": "failed",
    }


def record_running(ledger: Consolidation) -> None:
    """The fold's "running" ledger row. On PostgreSQL its commit does not wait for a disk flush:
    if the database crashes before the fold's own (synchronous) commit, the fold is lost with
    it and there is nothing for the row to record."""
    if connection.vendor == "postgresql":
        rows.insert_without_flush_wait(ledger)
    else:
        ledger.save(force_insert=True)


def commit_fold(
    chat: Chat,
    snapshot: MemorySnapshot,
    decision: engine.Decision,
    ledger: Consolidation,
    result: SummaryResult,
    now: datetime,
    started: float,
) -> tuple[FoldOutcome, MemorySnapshot]:
    duration_ms = int((time.monotonic() - started) * 1000)
    summary_tokens = count_tokens(result.text)
    finished_at = timezone.now()
    chat_id = chat.pk
    write = FoldWrite(
        chat_id=chat_id,
        snapshot=snapshot,
        ledger_id=ledger.pk,
        summary_tokens=summary_tokens,
        brief_values={
            "summary": result.text,
            "summary_tokens": summary_tokens,
            "last_consolidated": decision.to_seq,
            "last_consolidated_at": now,
            "turns_mark": snapshot.last_seq,
            "consecutive_failures": 0,
            "degraded": False,
            "next_attempt_at": None,
            "last_error": "",
            "updated_at": timezone.now(),
        },
        ledger_values={
            "finished_at": finished_at,
            "duration_ms": duration_ms,
            "input_tokens": result.input_tokens,
            "output_tokens": result.output_tokens,
            "summarizer_calls": result.calls,
        },
    )
    commit = commit_in_one_statement if connection.vendor == "postgresql" else commit_in_transaction
    committed = commit(write)
    status = ConsolidationStatus.SUCCEEDED if committed else ConsolidationStatus.SUPERSEDED
    if committed:
        # After the commit: at once outside a transaction, else when the caller's ends.
        transaction.on_commit(
            partial(
                messages_folded.send,
                sender=Brief,
                chat_id=chat_id,
                from_seq=decision.from_seq,
                to_seq=decision.to_seq,
                version=snapshot.version + 1,
                summary=result.text,
            )
        )
    log.info(
        "fold %s",
        status,
        extra={
            "event": "fold",
            "chat_id": chat_id,
            "trigger": decision.trigger,
            "synchronous": ledger.synchronous,
            "from_seq": decision.from_seq,
            "to_seq": decision.to_seq,
            "messages_folded": decision.to_seq - decision.from_seq + 1,
            "summary_tokens_before": snapshot.summary_tokens,
            "summary_tokens_after": summary_tokens,
            "input_tokens": result.input_tokens,
            "output_tokens": result.output_tokens,
            "summarizer_calls": result.calls,
            "duration_ms": duration_ms,
            "lag_ms": lag_ms(ledger.due_at, finished_at),
            "outcome": str(status),
        },
    )
    outcome = FoldOutcome(str(status), decision, ledger.pk)
    return outcome, after_fold(snapshot, write.brief_values) if committed else snapshot


def still_due(chat: Chat, folded: MemorySnapshot, now: datetime) -> bool:
    """Whether the state a fold just committed has another fold due. Judged on the messages the
    fold read, with no fresh read: a message stored since then was checked by its own turn after
    its commit, and a fold it found due reaches this task as a rerun (the queued marker is
    cleared before the fold reads, and the lock turns that task into a pending flag)."""
    return decide_for_chat(chat, folded, "rerun", now) is not None


@dataclass(frozen=True)
class FoldWrite:
    """What committing a fold writes: the brief (``brief_values``, and its version advanced) if
    it wins the fencing step, the ledger row's outcome either way."""

    chat_id: int
    snapshot: MemorySnapshot  # what the fold read: the fencing step's version and W
    ledger_id: int
    summary_tokens: int  # the new summary's
    brief_values: dict[str, Any]
    ledger_values: dict[str, Any]


def commit_in_transaction(write: FoldWrite) -> bool:
    """The fencing step and the ledger's outcome, in one transaction. Returns whether this fold
    advanced W."""
    snapshot = write.snapshot
    with transaction.atomic():
        # The fencing step: only the fold that read this exact version may advance W.
        committed = bool(
            Brief.objects.filter(
                chat_id=write.chat_id,
                version=snapshot.version,
                last_consolidated=snapshot.last_consolidated,
            ).update(version=F("version") + 1, **write.brief_values)
        )
        status = ConsolidationStatus.SUCCEEDED if committed else ConsolidationStatus.SUPERSEDED
        Consolidation.objects.filter(pk=write.ledger_id).update(
            status=status,
            summary_tokens_after=write.summary_tokens if committed else snapshot.summary_tokens,
            **write.ledger_values,
        )
    return committed


def commit_in_one_statement(write: FoldWrite) -> bool:
    """PostgreSQL: ``commit_in_transaction`` as one statement, atomic on its own (no BEGIN and
    COMMIT round trips): the brief's conditional UPDATE in a data-modifying CTE, and the ledger
    row's UPDATE reading whether it changed a row. A CTE's UPDATE runs exactly once, however
    often the statement refers to it."""
    snapshot = write.snapshot
    brief_sets, params = assignments(Brief, write.brief_values)
    ledger_sets, ledger_params = assignments(Consolidation, write.ledger_values)
    version = column(Brief, "version")
    won = "EXISTS (SELECT 1 FROM folded)"
    sql = (
        f"WITH folded AS (UPDATE {rows.quoted_table(Brief)} "
        f"SET {brief_sets}, {version} = {version} + 1 "
        f"WHERE {column(Brief, 'chat')} = %s AND {version} = %s "
        f"AND {column(Brief, 'last_consolidated')} = %s RETURNING 1) "
        f"UPDATE {rows.quoted_table(Consolidation)} SET {ledger_sets}, "
        f"{column(Consolidation, 'status')} = CASE WHEN {won} THEN %s ELSE %s END, "
        f"{column(Consolidation, 'summary_tokens_after')} = CASE WHEN {won} THEN %s ELSE %s END "
        f"WHERE {column(Consolidation, 'id')} = %s RETURNING {won}"
    )
    params += [write.chat_id, snapshot.version, snapshot.last_consolidated, *ledger_params]
    params += [ConsolidationStatus.SUCCEEDED.value, ConsolidationStatus.SUPERSEDED.value]
    params += [write.summary_tokens, snapshot.summary_tokens, write.ledger_id]
    with connection.cursor() as cursor:
        cursor.execute(sql, params)
        found = cursor.fetchone()
    if found is not None:
        return bool(found[0])
    # The ledger row is gone (the chat was deleted while its fold ran): so is the brief.
    return False


def assignments(model: type[Model], values: dict[str, Any]) -> tuple[str, list[Any]]:
    """``"col" = %s, ...`` and its parameters, each value prepared as the ORM saves it."""
    columns, params = [], []
    for name, value in values.items():
        columns.append(f"{column(model, name)} = %s")
        params.append(model_field(model, name).get_db_prep_save(value, connection))
    return ", ".join(columns), params


def column(model: type[Model], name: str) -> str:
    return connection.ops.quote_name(str(model_field(model, name).column))


def model_field(model: type[Model], name: str) -> Field:
    field = model._meta.get_field(name)
    assert isinstance(field, Field)
    return field


def lag_ms(due_at: datetime | None, finished_at: datetime) -> int | None:
    """Consolidation lag: from the turn that found a fold due to the fold's commit."""
    if due_at is None:
        return None
    return max(int((finished_at - due_at).total_seconds() * 1000), 0)


def failure_backoff(consecutive_failures: int) -> timedelta:
    """Exponential with jitter, so a fleet of failing chats does not retry in lockstep."""
    # The exponent is clamped: 2**1024 seconds overflows a float (and a timedelta far sooner),
    # and the cap is reached long before.
    doublings = min(max(consecutive_failures - 1, 0), 64)
    base = settings.MEMORY_FAILURE_BACKOFF_SECONDS * 2**doublings
    return _jittered(min(base, settings.MEMORY_FAILURE_BACKOFF_MAX_SECONDS))


def _jittered(seconds: float) -> timedelta:
    return timedelta(seconds=seconds * random.uniform(0.8, 1.2))


# What retrying can achieve decides how a failure is retried (DESIGN §6: backoff retries only
# for transient errors). Anything not raised by the summarizer (a crash, the soft time limit,
# a database error) counts as transient: it says nothing about the request itself.
CRASH_KIND = "crash"
TRANSIENT = "transient"  # timeout, connection, 429 rate limit, 5xx: may work in a moment
INVALID_OUTPUT = "invalid_output"  # empty, truncated, refused, over cap, not a summary
REJECTED = "rejected"  # exhausted quota, other 4xx: only a human (billing, config) fixes it
INVALID_OUTPUT_KINDS = frozenset({"empty", "truncated", "refused", "over_cap", "malformed"})
REJECTED_KINDS = frozenset({"quota", "client_error"})


@dataclass(frozen=True)
class RetryPlan:
    failure_class: str
    delay: timedelta  # until the brief's next_attempt_at (turn triggers wait, the sweep retries)
    degraded: bool
    fast_retry: bool  # the worker queues a delayed retry itself instead of waiting for the sweep


def failure_class(kind: str) -> str:
    if kind in INVALID_OUTPUT_KINDS:
        return INVALID_OUTPUT
    if kind in REJECTED_KINDS:
        return REJECTED
    # TRANSIENT_KINDS and crashes; an unknown kind too: retried on the ladder, then degraded.
    return TRANSIENT


def retry_plan(kind: str, consecutive_failures: int) -> RetryPlan:
    """The retry policy for the ``consecutive_failures``-th failure in a row, of this kind.

    Transient: exponential backoff with jitter, and a fast retry queued by the worker until the
    chat is degraded (after MEMORY_DEGRADED_AFTER_FAILURES); from then on only the sweep
    retries, on the same ladder. Invalid output: the same input would likely fail the same way,
    so no fast retry, degraded at once, and the ladder starts where a degraded transient chat
    stands. Rejected: retrying cannot help before someone acts; degraded at once and one
    attempt per maximum backoff. A manual consolidation always tries at once."""
    degraded_after = settings.MEMORY_DEGRADED_AFTER_FAILURES
    klass = failure_class(kind)
    if klass == TRANSIENT:
        degraded = consecutive_failures >= degraded_after
        return RetryPlan(klass, failure_backoff(consecutive_failures), degraded, not degraded)
    if klass == INVALID_OUTPUT:
        step = consecutive_failures + max(degraded_after - 1, 0)
        return RetryPlan(klass, failure_backoff(step), degraded=True, fast_retry=False)
    return RetryPlan(
        klass,
        _jittered(settings.MEMORY_FAILURE_BACKOFF_MAX_SECONDS),
        degraded=True,
        fast_retry=False,
    )


def fast_retry_delay(outcomes: list[FoldOutcome]) -> float | None:
    """Seconds after which the worker should retry the chat itself, judged by the newest
    attempt that did something (a later ``deferred`` rerun does not cancel the retry)."""
    for outcome in reversed(outcomes):
        if outcome.status == "failed":
            return within_visibility(outcome.retry_in)
        if outcome.status in (ConsolidationStatus.SUCCEEDED, ConsolidationStatus.SUPERSEDED):
            return None
    return None


def within_visibility(delay: float | None) -> float | None:
    """A delayed task held by a worker longer than the broker's visibility timeout is handed to
    another worker too (Redis' restore ignores the ETA): the fold would run twice. Past half of
    it, no delayed task; the sweep retries the chat when its next_attempt_at is due."""
    if delay is None or delay >= settings.BROKER_VISIBILITY_TIMEOUT / 2:
        return None
    return delay


# A manual fold asked for while another run holds the chat waits for it: that run's reruns
# judge by the policy's own triggers, which need not want what was asked for by hand. Every
# MANUAL_WAIT_SECONDS, for as long as a lock can be held (its TTL).
MANUAL_WAIT_SECONDS = 5.0


def manual_wait_delay(
    chat_id: int, trigger: str, outcomes: list[FoldOutcome], waited: float
) -> float | None:
    """Seconds after which a manual request that met a held lock (no outcome) asks again, or
    None: not such a request, or it has waited as long as a lock can be held."""
    if outcomes or trigger != "manual":
        return None
    if waited >= settings.MEMORY_LOCK_TTL_SECONDS:
        log.warning("manual fold gave up waiting for the lock", extra={"chat_id": chat_id})
        return None
    return MANUAL_WAIT_SECONDS


def record_failure(
    chat_id: int,
    snapshot: MemorySnapshot,
    ledger: Consolidation,
    error: str,
    kind: str,
    now: datetime,
    started: float,
) -> RetryPlan:
    Consolidation.objects.filter(pk=ledger.pk).update(
        status=ConsolidationStatus.FAILED,
        finished_at=timezone.now(),
        duration_ms=int((time.monotonic() - started) * 1000),
        error=error[:2000],
    )
    return fail_brief(ledger, snapshot.version, error, kind, now)


def fail_brief(
    ledger: Consolidation, version: int, error: str, kind: str, now: datetime
) -> RetryPlan:
    """A failed attempt on the chat's brief: one more consecutive failure, the retry time, and
    degraded per the retry plan; and its log line. Filtered by the version the attempt read: if
    another fold committed meanwhile, this failure is old news.

    The count is incremented in the database, in the conditional UPDATE itself, and the plan is
    made from the count it wrote: two failures of the same version (a crash and the sweep's
    abandonment, two workers) count two, not one each read-then-written as N + 1. The row stays
    locked until the plan is written, so a concurrent failure waits and plans from N + 2."""
    chat_id = ledger.chat_id
    with transaction.atomic():
        current = Brief.objects.filter(chat_id=chat_id, version=version).update(
            consecutive_failures=F("consecutive_failures") + 1,
            last_error=error[:2000],
            updated_at=timezone.now(),
        )
        count = (
            Brief.objects.filter(chat_id=chat_id)
            .values_list("consecutive_failures", flat=True)
            .first()
        )
        # Not counted (another fold committed meanwhile): the plan only for the log line.
        failures = (count or 0) + (0 if current else 1)
        plan = retry_plan(kind, failures)
        if current:
            # Guarded by the count this failure wrote: a newer failure's plan is not overwritten.
            Brief.objects.filter(
                chat_id=chat_id, version=version, consecutive_failures=failures
            ).update(degraded=plan.degraded, next_attempt_at=now + plan.delay)
    if not current:
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
            "error": error[:500],
        },
    )
    return plan


def consolidate_with_lock(
    chat_id: int,
    trigger: str,
    lock: ChatLock,
    *,
    max_runs: int | None = None,
    due_at: datetime | None = None,
    started: float | None = None,
) -> list[FoldOutcome]:
    """Seed 001's is_consolidating / pending_consolidation, made atomic: acquire or mark pending;
    after each run release, or (pending was set) clear it and re-judge once more. Bounded by
    ``max_runs``; past it the lock is released and a fresh task takes over.

    ``due_at`` stays with every fold of this task, reruns included: a rerun's fold was due at
    the latest since then, so its lag is an upper bound. A request that only marked pending
    (the lock was busy) is served by the holder's reruns, timed from the holder's ``due_at``."""
    max_runs = max_runs or settings.MEMORY_MAX_RERUNS_PER_TASK
    token = uuid.uuid4().hex
    if not lock.acquire_or_mark_pending(chat_id, token):
        log.info("lock busy, rerun marked", extra={"event": "lock_contended", "chat_id": chat_id})
        return []
    # Reruns and a fold's later chunks stop in time to end the task before its soft time limit:
    # what they leave is marked pending and handed to a fresh task. ``started``: the task's.
    deadline = task_deadline(time.monotonic() if started is None else started)
    outcomes: list[FoldOutcome] = []
    next_trigger = "rerun"
    try:
        while True:
            outcome = consolidate_once(chat_id, trigger, due_at=due_at, deadline=deadline)
            outcomes.append(outcome)
            if outcome.more_due:
                # One fold per cycle; the backlog left another due: run again, on a fresh read.
                lock.mark_pending(chat_id)
            # What a manual fold cut short by the deadline left was asked for by hand: a rerun
            # judged by the policy's own triggers might leave it.
            next_trigger = "manual" if trigger == "manual" and outcome.cut_short else "rerun"
            if len(outcomes) >= max_runs or not time_for_a_chunk(deadline):
                break
            release = lock.release_or_rerun(chat_id, token)
            if release is Release.LOST:
                log.warning("lock expired during a run", extra={"chat_id": chat_id})
            if release is not Release.RERUN:
                return outcomes
            trigger = next_trigger
    except BaseException:
        lock.release(chat_id, token)
        raise
    lock.release(chat_id, token)
    if lock.is_pending(chat_id):
        from memory_worker.dispatch import request_consolidation

        request_consolidation(chat_id, next_trigger, due_at)
    return outcomes


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
    together: had the count failed alone, the row (no longer running) would never be counted
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
        return decide_for_chat(chat, snapshot, "cooldown", now) is not None
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
