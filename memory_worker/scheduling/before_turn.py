"""The fold a turn needs before its model call (docs/design.md, the turn, step 4), taken like every
other fold: under the chat's lock (docs/design.md, the fold). While a background fold of the chat is
in flight (its lock held, or its task queued and about to start) the turn waits for it instead of
summarizing the same range, then re-reads; only with none in flight does it fold itself. The fence
still keeps the data right whatever the lock does: a turn that gives up waiting folds fenced,
without the lock."""

import logging
import time
import uuid
from enum import Enum

import redis
from django.conf import settings

from conversations.models import Brief, Chat
from conversations.rows import database_now
from memory_worker.coordination.dispatch import RequestReason, fold_queued
from memory_worker.coordination.lease import Lease, Renewable
from memory_worker.coordination.locks import ChatLock
from memory_worker.coordination.request_redis import breaker_open, trip_if_timeout
from memory_worker.coordination.runtime import request_chat_lock
from memory_worker.engine import policy as engine
from memory_worker.folding.effective_policy import policy_for_chat
from memory_worker.folding.execute import execute_fold
from memory_worker.folding.outcomes import FoldOutcome, FoldStatus
from memory_worker.folding.retries import REFUSAL_KINDS
from memory_worker.folding.snapshot import MemorySnapshot, load_snapshot
from memory_worker.scheduling.runs import hand_on_pending
from memory_worker.summaries.backends import offline_summarizer, summarizer_backend_name

log = logging.getLogger("chatmem.fold")

# How often a waiting turn looks again: a fold on a fast summarizer commits soon, and each look
# is a primary-key read and a Redis call or two, so the pause doubles up to a quarter second
# for a slow one.
POLL_SECONDS = 0.02
MAX_POLL_SECONDS = 0.25


class Wait(Enum):
    ACQUIRED = "acquired"  # the turn holds the lock
    MOVED = "moved"  # a fold committed, or the one in flight ended: judge again
    EXPIRED = "expired"  # a fold still in flight after the wait: fold fenced, unlocked


def fold_before_turn(
    chat: Chat,
    snapshot: MemorySnapshot,
    decision: engine.Decision,
    prompt_tokens: int,
    *,
    wait_deadline: float,
    deadline: float | None,
    slot: Renewable,
    lock: ChatLock | None = None,
) -> FoldOutcome:
    """This turn's fold of ``decision`` under the chat's lock, or a WAITED outcome when another
    fold committed since ``snapshot`` or ended while the turn waited: the caller then
    re-reads and judges again. A fold in flight is waited for until ``wait_deadline``
    (``time.monotonic()``). The fold starts no chunk after its first that could not end by
    ``deadline`` (deadlines.turn_fold_deadline), and renews the turn's ``slot`` before every
    chunk: a wait and a backlog of chunks together can outlast the slot, which a retry of the
    turn would then take over. A slot lost all the same (``slot.renew()`` false) starts no
    further chunk; the caller then finds it taken. ``prompt_tokens``: the prompt over the
    bound, for the log."""
    lock = lock or request_chat_lock()
    started = time.monotonic()
    token = uuid.uuid4().hex
    waited = wait_for_lock(chat.pk, snapshot.version, lock, token, started, wait_deadline)
    if waited is Wait.MOVED:
        return _waited(chat.pk, started)
    if waited is Wait.EXPIRED:
        return _fold_or_fall_back(chat, snapshot, decision, prompt_tokens, deadline, slot)
    # Renewed while the turn folds (one summarizer call can outlast the TTL), for no longer
    # than a task could hold it: a web process that dies frees the chat within one TTL.
    lease = Lease(lock, chat.pk, token, until=time.monotonic() + settings.MEMORY_TASK_TIME_LIMIT)
    try:
        with lease:
            if brief_version(chat.pk) != snapshot.version:
                return _waited(chat.pk, started)  # a fold committed since the last look
            return _fold_or_fall_back(chat, snapshot, decision, prompt_tokens, deadline, slot)
    finally:
        release(chat.pk, token, lock)


def wait_for_lock(
    chat_id: int, version: int, lock: ChatLock, token: str, started: float, deadline: float
) -> Wait:
    """acquire_or_wait, or EXPIRED (fold fenced, unlocked) when Redis fails or the request
    path's breaker is open after a timeout: the lock only saves work, and a turn never fails
    or waits for want of it (the fold's conditional UPDATE decides)."""
    try:
        if not breaker_open():
            return acquire_or_wait(chat_id, version, lock, token, started, deadline)
    except redis.RedisError as error:
        trip_if_timeout(error)
        release(chat_id, token, lock)  # an acquire whose reply was lost may have taken it
    log.warning(
        "the lock store is unreachable; folding without the lock (fenced)",
        extra={"event": "sync_fold_unlocked", "chat_id": chat_id},
    )
    return Wait.EXPIRED


def release(chat_id: int, token: str, lock: ChatLock) -> None:
    """Free the lock; a trigger that found it held by this turn marked the chat pending, and
    the holder owes it a run: a task, as a turn does no more memory work than it must. Redis
    gone or stalled meanwhile: the lock expires by its TTL, and the sweep finds the chat."""
    if breaker_open():
        return
    try:
        lock.release(chat_id, token)
    except redis.RedisError as error:
        trip_if_timeout(error)
        log.warning("could not release the chat's lock", extra={"chat_id": chat_id})
        return
    hand_on_pending(chat_id, lock, RequestReason.RERUN, None)


def acquire_or_wait(
    chat_id: int, version: int, lock: ChatLock, token: str, started: float, deadline: float
) -> Wait:
    """Take the lock when no fold is in flight; else wait until a fold commits (the brief's
    version moves) or the one in flight ends. A fold still in flight at ``deadline`` (its holder
    stuck, or dead less than one lock TTL ago) is not waited for longer. The turn's acquire leaves
    the pending set alone: it decided its range before taking the lock, so it cannot serve a
    rerun that was asked for, and a trigger it met is the holder's to serve already."""
    queued_until = started + settings.MEMORY_QUEUED_FOLD_WAIT_SECONDS
    saw_fold = False
    pause = POLL_SECONDS
    while True:
        if brief_version(chat_id) != version:
            return Wait.MOVED
        held = lock.is_held(chat_id)
        now = time.monotonic()
        # A queued task starts within moments when a worker is free; with none free the turn
        # does not wait for the backlog.
        queued = not held and now < queued_until and fold_queued(chat_id)
        if not held and not queued:
            if saw_fold:
                return Wait.MOVED  # the fold in flight ended without committing
            if lock.try_acquire(chat_id, token):
                return Wait.ACQUIRED
            held = True  # a task took it between the look and the acquire
        saw_fold = saw_fold or held
        if now >= deadline:
            log.warning(
                "a fold in flight outlasted the wait; folding without the lock (fenced)",
                extra={"event": "sync_fold_wait_expired", "chat_id": chat_id},
            )
            return Wait.EXPIRED
        time.sleep(pause)
        pause = min(pause * 2, MAX_POLL_SECONDS)


def brief_version(chat_id: int) -> int | None:
    return Brief.objects.filter(chat_id=chat_id).values_list("version", flat=True).first()


def _fold_or_fall_back(
    chat: Chat,
    snapshot: MemorySnapshot,
    decision: engine.Decision,
    prompt_tokens: int,
    deadline: float | None,
    slot: Renewable,
) -> FoldOutcome:
    """A failing summarizer never fails a turn. When the configured one fails the turn's fold,
    what is left of its range is folded with the offline summarizer (its ledger trigger says
    so; no model call, so no deadline, and the slot still renewed per chunk); the next model
    fold rewrites that summary with the model."""
    outcome = _fold(chat, snapshot, decision, prompt_tokens, deadline, slot)
    if outcome.status != FoldStatus.FAILED or summarizer_backend_name() == "offline":
        return outcome
    log.warning(
        "the summarizer failed a turn's fold; folding with the offline summarizer",
        extra={"event": "sync_fold_fallback", "chat_id": chat.pk, "error": outcome.error},
    )
    # Chunks before the failed one committed: fold from where they left off.
    current = load_snapshot(chat.pk)
    if current.last_consolidated >= decision.to_seq:
        return FoldOutcome(FoldStatus.WAITED)
    rest = engine.Decision(
        engine.Trigger.HARD_BOUND_FALLBACK, current.last_consolidated + 1, decision.to_seq
    )
    cap = policy_for_chat(chat).summary_token_cap
    return execute_fold(
        chat,
        current,
        rest,
        now=database_now(),
        synchronous=True,
        summarizer=offline_summarizer(cap),
        fallback_reason=outcome.error,
        # A summary must not carry what the model refused: the next model fold would be too.
        withhold=outcome.kind in REFUSAL_KINDS,
        lease=slot,
    )


def _fold(
    chat: Chat,
    snapshot: MemorySnapshot,
    decision: engine.Decision,
    prompt_tokens: int,
    deadline: float | None,
    slot: Renewable,
) -> FoldOutcome:
    log.info(
        "synchronous fold before the model call",
        extra={
            "event": "sync_fold",
            "chat_id": chat.pk,
            "from_seq": decision.from_seq,
            "to_seq": decision.to_seq,
            "prompt_tokens": prompt_tokens,
        },
    )
    return execute_fold(
        chat,
        snapshot,
        decision,
        now=database_now(),
        synchronous=True,
        deadline=deadline,
        lease=slot,
    )


def _waited(chat_id: int, started: float) -> FoldOutcome:
    log.info(
        "the turn waited for the fold in flight",
        extra={
            "event": "sync_fold_wait",
            "chat_id": chat_id,
            "waited_ms": round((time.monotonic() - started) * 1000),
        },
    )
    return FoldOutcome(FoldStatus.WAITED)
