"""Executing a fold (docs/design.md, the fold): read a snapshot (brief and unfolded messages), let
the pure engine decide, call the summarizer with no transaction open, then commit chunk by chunk
(memory_worker.folding.commit). Called by the run loop (memory_worker.scheduling.runs) and the
turn's synchronous fold (memory_worker.scheduling.before_turn)."""

import logging
import time
from dataclasses import replace
from datetime import datetime

from django.conf import settings
from django.db import IntegrityError

from conversations.models import Chat, Consolidation, Message
from conversations.rows import DATABASE_ERRORS, database_now
from memory_worker.coordination.deadlines import time_for_a_chunk
from memory_worker.coordination.dispatch import RequestReason
from memory_worker.coordination.lease import Lease, Renewable
from memory_worker.engine import isolation as isolation_policy
from memory_worker.engine import policy as engine
from memory_worker.engine.state import Msg
from memory_worker.engine.turn_groups import split_for_summarizer, turns_of
from memory_worker.folding.commit import commit_fold
from memory_worker.folding.effective_policy import policy_for_chat, variant_context_tokens
from memory_worker.folding.ledger import (
    WORKER_NAME,
    Heartbeat,
    beating,
    record_interrupted,
    record_running,
)
from memory_worker.folding.outcomes import FoldOutcome, FoldStatus
from memory_worker.folding.refusals import (
    commit_withheld,
    fold_after_error,
    guard_context,
    record_crash,
)
from memory_worker.folding.retries import (
    INVALID_OUTPUT_KINDS,
    REFUSAL_KINDS,
    TOO_LARGE,
    clear_failure_state,
    in_backoff,
)
from memory_worker.folding.snapshot import MemorySnapshot, engine_state, read_chat_and_snapshot
from memory_worker.summaries.backends import get_summarizer, offline_summarizer, stricter_summarizer
from memory_worker.summaries.contract import FoldMessage, Summarizer, SummarizerError, told_of_pins
from memory_worker.summaries.guarded import guard

log = logging.getLogger("chatmem.fold")


def decide_for_chat(
    chat: Chat, snapshot: MemorySnapshot, now: datetime, *, manual: bool = False
) -> engine.Decision | None:
    state = engine_state(chat, snapshot, variant_context_tokens(chat))
    policy = policy_for_chat(chat)
    if manual:
        return engine.decide_manual(state, policy)
    return engine.decide(state, policy, now)


def fold_once(
    chat_id: int,
    trigger: RequestReason,
    now: datetime | None = None,
    due_at: datetime | None = None,
    deadline: float | None = None,
    lease: Lease | None = None,
) -> FoldOutcome:
    """One policy evaluation and at most one fold (one summarization per cycle: the highest-priority
    trigger names it). ``due_at``: when the turn that asked for this run found a fold due (for the
    lag figure); ``deadline`` and ``lease``: see ``execute_fold``."""
    now = now or database_now()
    found = read_chat_and_snapshot(chat_id)
    if found is None:  # deleted while queued
        return FoldOutcome(FoldStatus.NOTHING)
    chat, snapshot = found
    manual = trigger == RequestReason.MANUAL
    if chat.folds_paused and not manual:
        # Paused by its owner: only a fold asked for by hand runs (a turn over its hard bound
        # folds on its own path, memory_worker.scheduling.before_turn).
        return FoldOutcome(FoldStatus.NOTHING)
    if not manual and in_backoff(snapshot, now):
        return FoldOutcome(FoldStatus.DEFERRED)
    decision = decide_for_chat(chat, snapshot, now, manual=manual)
    if decision is None:
        if snapshot.next_attempt_at is not None:
            clear_failure_state(chat_id, snapshot.next_attempt_at)
        return FoldOutcome(FoldStatus.NOTHING)
    return execute_fold(
        chat, snapshot, decision, now=now, due_at=due_at, deadline=deadline, lease=lease
    )


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
    fallback_reason: str = "",
    withhold: bool = False,
    lease: Renewable | None = None,
) -> FoldOutcome:
    """The decided range, summarized and committed chunk by chunk. A range larger than the
    summarizer's input budget is split at turn boundaries (chunks, never trimming: docs/design.md,
    the summarizer), and each chunk is a fold of its own: one summarizer call, its own fencing step,
    summary version and ledger row. A later chunk's failure, the task's time limit or the worker's
    death keeps the chunks already committed, so the next attempt starts where they left off, and a
    backlog longer than one task's time limit still gets folded.

    ``deadline`` (``time.monotonic()``): no chunk after the first starts unless it can finish
    by then (``time_for_a_chunk``); the outcome then says more is due and the caller hands on.
    The outcome is the last chunk's; ``decision`` stays the whole range's. ``summarizer``: the
    configured one (for the chat's cap) unless given; ``fallback_reason``: it is the offline
    fallback of a model fold that failed, for that reason (folding.commit.commit_fold);
    ``withhold``: that failure was a refusal, so the range is withheld, not summarized
    (``commit_withheld``). ``lease``: what the fold keeps while it works (the chat's lock; a
    turn's slot), renewed before each chunk; once lost, no call starts and the outcome says
    more is due."""
    to_fold = [m for m in snapshot.unfolded if decision.from_seq <= m.seq <= decision.to_seq]
    chunks = split_for_summarizer(
        [Msg(m.seq, m.role, m.token_count) for m in to_fold],
        settings.MEMORY_SUMMARIZER_INPUT_BUDGET,
    )
    # The chat's own summary cap: its policy's bound and the synchronous fold's plan count on it.
    cap_tokens = policy_for_chat(chat).summary_token_cap
    summarizer = summarizer or summarizer_for(chat, snapshot)
    outcome = FoldOutcome(FoldStatus.NOTHING, decision)
    for index, (first, last) in enumerate(chunks):
        if index and not time_for_a_chunk(deadline):
            return replace(outcome, decision=decision, more_due=True, cut_short=True)
        if lease is not None and not lease.renew():
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
            deadline=deadline,
            fallback_reason=fallback_reason,
            withhold=withhold,
            cap_tokens=cap_tokens,
        )
        if outcome.status == FoldStatus.SUPERSEDED:
            # An edit of the summary (or another fold) committed since this fold read it: run
            # again from what it wrote.
            return replace(outcome, decision=decision, more_due=True)
        if outcome.status != FoldStatus.SUCCEEDED:
            return replace(outcome, decision=decision)
        if outcome.cut_short:  # an isolation stopped inside the chunk: the rest is a later fold
            return replace(outcome, decision=decision, more_due=True)
    more_due = still_due(chat, snapshot, now)
    return replace(outcome, decision=decision, more_due=more_due)


def summarizer_for(chat: Chat, snapshot: MemorySnapshot) -> Summarizer:
    """The configured summarizer, held to the chat's own summary cap (its policy's bound and
    the synchronous fold's plan count on it); with the stricter prompt after an invalid summary,
    until a model fold commits."""
    cap = policy_for_chat(chat).summary_token_cap
    if snapshot.failure_kind in INVALID_OUTPUT_KINDS:
        return stricter_summarizer(cap)
    return get_summarizer(cap)


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
    deadline: float | None = None,
    fallback_reason: str = "",
    withhold: bool = False,
    cap_tokens: int,
) -> tuple[FoldOutcome, MemorySnapshot]:
    """One summarizer call over ``batch`` (the chunk's messages) and its commit. Returns the
    outcome and the snapshot as it stands after it (``snapshot`` unless it committed).
    ``deadline``: when an isolation (fold_isolation) starts no more calls."""
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
        return FoldOutcome(FoldStatus.NOTHING, chunk), snapshot
    try:
        with Heartbeat(ledger) as heartbeat:
            outcome, after = summarize_and_commit(
                chat,
                snapshot,
                chunk,
                batch,
                summarizer,
                heartbeat,
                now=now,
                started=started,
                deadline=deadline,
                fallback_reason=fallback_reason,
                withhold=withhold,
                cap_tokens=cap_tokens,
            )
    except DATABASE_ERRORS as error:
        # The database failed under the fold (PostgreSQL restarting, the connection killed
        # while the summarizer answered): the attempt says nothing about the chat. Its row is
        # not left "running" for the sweep to abandon a lock TTL later if it can be marked
        # now; the caller retries (tasks.fold_chat).
        record_interrupted(ledger, error, started)
        raise
    if outcome.kind == TOO_LARGE and not synchronous and summarizer.name != "offline":
        return fold_in_smaller_chunks(
            chat,
            snapshot,
            chunk,
            batch,
            summarizer,
            outcome,
            now=now,
            due_at=due_at,
            deadline=deadline,
            cap_tokens=cap_tokens,
        )
    if outcome.fall_back and not synchronous and summarizer.name != "offline":
        refused = outcome.kind in REFUSAL_KINDS
        return fall_back(
            chat, snapshot, chunk, batch, outcome.error, refused, now=now, due_at=due_at
        )
    return outcome, after


def fold_in_smaller_chunks(
    chat: Chat,
    snapshot: MemorySnapshot,
    chunk: engine.Decision,
    batch: list[Message],
    summarizer: Summarizer,
    failed: FoldOutcome,
    *,
    now: datetime,
    due_at: datetime | None,
    deadline: float | None,
    cap_tokens: int,
) -> tuple[FoldOutcome, MemorySnapshot]:
    """The chunk was over the summarizer's window (``failed``, a context-length error): no
    refusal, so nothing in it is withheld. It is folded again as smaller chunks of whole turns,
    each a fold of its own (split again if still too large); a single turn too large on its own
    is folded by the offline summarizer (a fallback row), as no smaller model call can take it.
    W still moves only to turn boundaries."""
    pieces = smaller_chunks(batch)
    if len(pieces) == 1:
        return fall_back(chat, snapshot, chunk, batch, failed.error, False, now=now, due_at=due_at)
    outcome, after = failed, snapshot
    for index, piece in enumerate(pieces):
        if not time_for_a_chunk(deadline):
            # Nothing folded yet: the failure stands, with its soon retry (retries.TOO_LARGE).
            return (replace(outcome, more_due=True, cut_short=True) if index else failed), after
        part = engine.Decision(chunk.trigger, piece[0].seq, piece[-1].seq)
        outcome, after = fold_chunk(
            chat,
            after,
            part,
            piece,
            summarizer,
            now=now,
            synchronous=False,
            due_at=due_at,
            deadline=deadline,
            cap_tokens=cap_tokens,
        )
        if outcome.status != FoldStatus.SUCCEEDED or outcome.cut_short:
            return outcome, after
    return outcome, after


def smaller_chunks(batch: list[Message]) -> list[list[Message]]:
    """``batch`` as chunks of whole turns of about half its tokens (split_for_summarizer's
    rule, at half the size); a single turn as it is."""
    sized = [Msg(m.seq, m.role, m.token_count) for m in batch]
    if len(turns_of(sized)) < 2:
        return [batch]
    bounds = split_for_summarizer(sized, sum(m.tokens for m in sized) // 2)
    if len(bounds) < 2:  # no token counts to go by: the turn boundary nearest the middle
        at = isolation_policy.split_index([m.role for m in batch])
        return [batch[:at], batch[at:]]
    return [[m for m in batch if first <= m.seq <= last] for first, last in bounds]


def fall_back(
    chat: Chat,
    snapshot: MemorySnapshot,
    chunk: engine.Decision,
    batch: list[Message],
    reason: str,
    refused: bool,
    *,
    now: datetime,
    due_at: datetime | None,
) -> tuple[FoldOutcome, MemorySnapshot]:
    """MEMORY_SUMMARIZER_FALLBACK=offline: the chunk the model summarizer failed, folded by the
    offline summarizer (a ledger row of its own, trigger ``summarizer_fallback``), from the
    same snapshot: a failure leaves the brief's version as it was, so the fence still holds;
    withheld instead when the model ``refused`` it. A turn's fold has its own fallback
    (scheduling.before_turn), whatever the setting."""
    log.warning(
        "the summarizer failed a background fold; folding with the offline summarizer",
        extra={"event": "fold_fallback", "chat_id": chat.pk, "error": reason},
    )
    fallback = engine.Decision(engine.Trigger.SUMMARIZER_FALLBACK, chunk.from_seq, chunk.to_seq)
    cap = policy_for_chat(chat).summary_token_cap
    return fold_chunk(
        chat,
        snapshot,
        fallback,
        batch,
        offline_summarizer(cap),
        now=now,
        synchronous=False,
        due_at=due_at,
        fallback_reason=reason,
        withhold=refused,
        cap_tokens=cap,
    )


def summarize_and_commit(
    chat: Chat,
    snapshot: MemorySnapshot,
    chunk: engine.Decision,
    batch: list[Message],
    summarizer: Summarizer,
    heartbeat: Heartbeat,
    *,
    now: datetime,
    started: float,
    deadline: float | None = None,
    fallback_reason: str = "",
    withhold: bool = False,
    cap_tokens: int,
) -> tuple[FoldOutcome, MemorySnapshot]:
    """The summarizer call (and the fold guard's repair, memory_worker.summaries.guarded), with no
    transaction open, then the commit (or the failure's record) of the chunk whose ledger row
    ``record_running`` wrote (``heartbeat``'s). A background fold whose range the summarizer has
    refused often enough (engine.isolation.isolation_due) is bisected in the same attempt
    (memory_worker.folding.isolation); a turn's fold is not: it falls back to the offline summarizer
    (memory_worker.scheduling.before_turn) and must not spend the turn's time on probes."""
    ledger = heartbeat.ledger
    messages = [FoldMessage(m.seq, m.role, m.content) for m in batch]
    if withhold:
        return commit_withheld(
            chat, snapshot, chunk, messages, ledger, fallback_reason, now, started, cap_tokens
        )
    context = guard_context(chat, snapshot, messages, cap_tokens)
    # Each call after the first renews the row's heartbeat and its thread's lifetime.
    summarizer = beating(told_of_pins(summarizer, context.pinned), heartbeat)
    try:
        guarded = guard(summarizer.summarize(snapshot.summary, messages), context, summarizer)
    except SummarizerError as error:
        return fold_after_error(
            chat,
            snapshot,
            chunk,
            messages,
            summarizer,
            ledger,
            error,
            now=now,
            started=started,
            deadline=deadline,
            cap_tokens=cap_tokens,
        )
    except Exception as error:
        record_crash(chat, snapshot, ledger, error, now=now, started=started)
        raise
    return commit_fold(
        chat,
        snapshot,
        chunk,
        ledger,
        guarded.result,
        now=now,
        started=started,
        fallback_reason=fallback_reason,
        dropped_details=guarded.dropped_details,
    )
