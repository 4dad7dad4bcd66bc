"""Executing a fold (DESIGN §6): read a snapshot (brief and unfolded messages), let the pure
engine decide, call the summarizer with no transaction open, then commit chunk by chunk
(memory_worker.fold_commit). Called by the run loop (memory_worker.runs) and the turn's
synchronous fold (memory_worker.turn_fold)."""

import logging
import time
from dataclasses import replace
from datetime import datetime

from django.conf import settings
from django.db import IntegrityError
from django.utils import timezone

from conversations.models import Chat, Consolidation, Message
from conversations.rows import DATABASE_ERRORS
from memory_worker import policy as engine
from memory_worker.backends import get_summarizer
from memory_worker.chat_policy import policy_for_chat, variant_context_tokens
from memory_worker.deadlines import time_for_a_chunk
from memory_worker.dispatch import RequestTrigger
from memory_worker.engine_state import Msg
from memory_worker.fold_commit import commit_fold
from memory_worker.fold_ledger import WORKER_NAME, record_interrupted, record_running
from memory_worker.guarded_summary import summarize_guarded
from memory_worker.outcomes import FoldOutcome, FoldResult
from memory_worker.retries import CRASH_KIND, clear_failure_state, in_backoff, record_failure
from memory_worker.state import MemorySnapshot, engine_state, read_chat_and_snapshot
from memory_worker.summarizers import FoldMessage, Summarizer, SummarizerError
from memory_worker.turn_groups import split_for_summarizer

log = logging.getLogger("chatmem.fold")


def decide_for_chat(
    chat: Chat, snapshot: MemorySnapshot, now: datetime, *, manual: bool = False
) -> engine.Decision | None:
    state = engine_state(chat, snapshot, variant_context_tokens(chat))
    policy = policy_for_chat(chat)
    if manual:
        return engine.decide_manual(state, policy)
    return engine.decide(state, policy, now)


def consolidate_once(
    chat_id: int,
    trigger: RequestTrigger,
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
        return FoldOutcome(FoldResult.NOTHING)
    chat, snapshot = found
    manual = trigger == RequestTrigger.MANUAL
    if not manual and in_backoff(snapshot, now):
        return FoldOutcome(FoldResult.DEFERRED)
    decision = decide_for_chat(chat, snapshot, now, manual=manual)
    if decision is None:
        if snapshot.next_attempt_at is not None:
            clear_failure_state(chat_id, snapshot.next_attempt_at)
        return FoldOutcome(FoldResult.NOTHING)
    return execute_fold(chat, snapshot, decision, now=now, due_at=due_at, deadline=deadline)


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
    keeps the chunks already committed, so the next attempt starts where they left off, and a
    backlog longer than one task's time limit still gets folded.

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
    cap_tokens = policy_for_chat(chat).summary_token_cap
    summarizer = summarizer or get_summarizer(cap_tokens)
    outcome = FoldOutcome(FoldResult.NOTHING, decision)
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
            cap_tokens=cap_tokens,
        )
        if outcome.status != FoldResult.SUCCEEDED:
            return replace(outcome, decision=decision)
    more_due = still_due(chat, snapshot, now)
    return replace(outcome, decision=decision, more_due=more_due)


def still_due(chat: Chat, folded: MemorySnapshot, now: datetime) -> bool:
    """Whether the state a fold just committed has another fold due. Judged on the messages the
    fold read, with no fresh read: a message stored since then was checked by its own turn after
    its commit, and a fold it found due reaches this task as a rerun (the queued marker is
    cleared before the fold reads, and the lock turns that task into a pending flag)."""
    return decide_for_chat(chat, folded, now) is not None


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
    cap_tokens: int,
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
        return FoldOutcome(FoldResult.NOTHING, chunk), snapshot
    try:
        return summarize_and_commit(
            chat,
            snapshot,
            chunk,
            batch,
            summarizer,
            ledger,
            now=now,
            started=started,
            cap_tokens=cap_tokens,
        )
    except DATABASE_ERRORS as error:
        # The database failed under the fold (PostgreSQL restarting, the connection killed
        # while the summarizer answered): the attempt says nothing about the chat. Its row is
        # not left "running" for the sweep to abandon a lock TTL later if it can be marked
        # now; the caller retries (tasks.consolidate_chat).
        record_interrupted(ledger, error, started)
        raise


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
    cap_tokens: int,
) -> tuple[FoldOutcome, MemorySnapshot]:
    """The summarizer call (and the fold guard's repair, memory_worker.guarded_summary), with no
    transaction open, then the commit (or the failure's record) of the chunk whose ledger row
    ``record_running`` wrote."""
    try:
        guarded = summarize_guarded(
            summarizer,
            snapshot.summary,
            [FoldMessage(m.seq, m.role, m.content) for m in batch],
            cap_tokens,
        )
    except SummarizerError as error:
        plan = record_failure(
            chat.pk, snapshot, ledger, error=str(error), kind=error.kind, now=now, started=started
        )
        failed = FoldOutcome(
            FoldResult.FAILED,
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
        record_failure(
            chat.pk, snapshot, ledger, error=failure, kind=CRASH_KIND, now=now, started=started
        )
        raise
    return commit_fold(
        chat,
        snapshot,
        chunk,
        ledger,
        guarded.result,
        now=now,
        started=started,
        dropped_details=guarded.dropped_details,
    )
