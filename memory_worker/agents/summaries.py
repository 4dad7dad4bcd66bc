"""The agent state's Summarize step off the request path (docs/agent-state.md): after every reply,
apply the turn to the chat's agent state, handed on through the same mechanism as consolidation
(MEMORY_DISPATCH: celery / inline / off).

How a run stays correct without a lock (the same fencing as the fold, docs/design.md): read the
state and its watermark ``processed_seq``, compute every new turn with no transaction open (this is
where LLM calls happen), then commit with ONE conditional UPDATE ``WHERE processed_seq = read``.
Zero rows means another run applied these turns first: nothing is written, and the loop looks again.
So a task delivered twice, late, or in parallel applies each turn exactly once."""

import logging
import time
from typing import Any

from django.conf import settings
from django.db import IntegrityError, transaction

from conversations import agent_rules as rules
from conversations.chat_model.tokens import count_tokens
from conversations.models import AgentState, Chat, Message, ResponseSummary, Role, hold_chat
from memory_worker.agents.turns import (
    Draft,
    NoTimeLeft,
    Turn,
    compute,
    ends_with_final_reply,
    turn_of,
)
from memory_worker.coordination.deadlines import task_deadline
from memory_worker.coordination.dispatch import TaskByName, hand_off
from memory_worker.engine.turn_groups import turns_of

log = logging.getLogger("chatmem.agent_state")

TURN_DIGEST = "turn-digest"


MAX_RUNS = 5  # batches read per task (each turn its own commit) before handing the rest on


BATCH_MESSAGES = 60  # messages read per batch (the complete turns in it are applied)


def limits() -> rules.Limits:
    return rules.Limits(
        summarize_threshold=settings.SUMMARIZE_THRESHOLD,
        full_detail_steps=settings.FULL_DETAIL_STEPS,
        pending_ttl_turns=settings.PENDING_TTL_TURNS,
        max_active_entities=settings.AGENT_MAX_ACTIVE_ENTITIES,
        max_step_summaries=settings.AGENT_MAX_STEP_SUMMARIES,
        max_registry_entities=settings.AGENT_MAX_REGISTRY_ENTITIES,
        max_context_tokens=settings.AGENT_CONTEXT_MAX_TOKENS,
    )


SUMMARIZE_AGENT_TURNS = TaskByName("chatmem.summarize_agent_turns")


def request_agent_summary(chat_id: int, from_seq: int | None = None) -> bool:
    """Returns whether the work was handed on. Never raises: the turn is already stored, and
    the next turn's task applies whatever this one missed (everything after the watermark)."""
    return hand_off(
        "the agent-state update",
        {"chat_id": chat_id},
        # retry=False: a dead broker must fail fast instead of holding the request.
        lambda: SUMMARIZE_AGENT_TURNS.apply_async(args=(chat_id, from_seq), retry=False),
        _run_inline,
        chat_id,
        from_seq,
    )


def _run_inline(chat_id: int, from_seq: int | None) -> None:
    summarize_turns(chat_id, from_seq)


def summarize_turns(chat_id: int, from_seq: int | None = None, started: float | None = None) -> int:
    """Apply every turn after the watermark; returns how many were applied (continuations are
    not turns). ``from_seq`` (the user message of the turn that triggered this) is where a new
    state starts: turns before the chat's first agent turn are not back-filled. ``started``
    (``time.monotonic()``): when the task started, for its deadline.

    Each turn is committed on its own, so a backlog that takes longer than the task's soft time
    limit keeps the turns already applied and no later task redoes them. No model call starts
    unless it can finish before the deadline; what is left is handed on."""
    deadline = agent_task_deadline(started)
    applied = 0
    first = True  # the task's first turn always runs, so every task makes progress
    for _run in range(MAX_RUNS):
        state = _state_for(chat_id, from_seq)
        if state is None:  # the chat was deleted while queued
            return applied
        turns = pending_turns(chat_id, state.processed_seq)
        if not turns:
            return applied
        for turn in turns:
            try:
                draft = compute(state, [turn], limits(), None if first else deadline)
            except NoTimeLeft:
                hand_on(chat_id, "deadline")
                return applied
            first = False
            if not commit(state, [turn], draft):
                break  # superseded: another run moved the watermark; read again
            applied += 0 if turn.is_continuation else 1
            advance(state, turn, draft)
    # MAX_RUNS batches and still reading turns (a long backlog): a fresh task carries on (it
    # finds nothing to do if these were the last).
    hand_on(chat_id, "backlog")
    return applied


def agent_task_deadline(started: float | None) -> float:
    """The fold's deadline (deadlines.task_deadline), made strict enough that
    ``time_for_a_chunk`` (which allows one MEMORY_LLM_TIMEOUT_SECONDS) also fits one agent
    summary call, which is bounded by the chat model's LLM_TIMEOUT_SECONDS."""
    longer_call = max(settings.LLM_TIMEOUT_SECONDS - settings.MEMORY_LLM_TIMEOUT_SECONDS, 0)
    return task_deadline(time.monotonic() if started is None else started) - longer_call


def hand_on(chat_id: int, reason: str) -> None:
    """Queue a fresh task for the turns this one leaves (never raises: a lost hand-off is
    picked up by the chat's next turn, whose task applies everything after the watermark)."""
    log.info(
        "agent state: handing the rest on",
        extra={"event": "agent_state_handed_on", "chat_id": chat_id, "reason": reason},
    )
    request_agent_summary(chat_id)


def advance(state: AgentState, turn: Turn, draft: Draft) -> None:
    """The state as this run just committed it, so the next turn chains on it in memory (its
    commit is fenced on this watermark) instead of reading the batch again."""
    state.processed_seq = turn.last_seq
    for name, value in draft_fields(draft).items():
        setattr(state, name, value)


def draft_fields(draft: Draft) -> dict[str, Any]:
    """The state fields a draft sets, as ``commit`` stores them and ``advance`` keeps them."""
    return {
        "turns": draft.turns,
        "engagement_summary": draft.theme,
        "entity_registry": draft.registry,
        "pending_clarification": draft.pending,
        "recent_steps": draft.recent_steps,
        "step_summaries": draft.step_summaries,
    }


def _state_for(chat_id: int, from_seq: int | None) -> AgentState | None:
    state = AgentState.objects.filter(chat_id=chat_id).first()
    if state is not None:
        return state
    chat = Chat.objects.filter(pk=chat_id).only("policy").first()
    if chat is None:
        return None
    try:
        with transaction.atomic():
            return AgentState.objects.create(
                chat_id=chat_id, processed_seq=start_seq(chat, from_seq) - 1
            )
    except IntegrityError:  # a parallel run created it first
        return AgentState.objects.filter(chat_id=chat_id).first()


def start_seq(chat: Chat, from_seq: int | None) -> int:
    """Where a new state starts: the chat's first turn that asked for one (its first agent turn;
    a turn-digest chat's first turn), not the turn whose task happens to run first. Two workers,
    or a lost enqueue, can run a later turn's task before the first one's; starting there would
    skip the turns before it for good."""
    if chat.policy == TURN_DIGEST:
        return 1
    first_agent = (
        Message.objects.filter(chat_id=chat.pk, role=Role.USER, metadata__has_key="agent")
        .order_by("seq")
        .values_list("seq", flat=True)
        .first()
    )
    candidates = [seq for seq in (first_agent, from_seq) if seq is not None]
    return min(candidates, default=1)


def pending_turns(chat_id: int, after_seq: int) -> list[Turn]:
    """The complete turns after ``after_seq``, in order, from one batch of messages.

    A turn is complete when a later user message exists, or when its last message is an
    assistant reply without tool calls. A reply that calls tools is not the end: with /v1 the
    tool result and the final reply come in later requests, and closing the turn at the tool
    call would lose the final reply (and make the state depend on when the worker runs). Messages
    before the batch's first user message carry on the turn already applied (a continuation).
    A batch that is one incomplete run (a turn, or a continuation, longer than a batch: a long
    tool loop) is applied as far as it goes, so the watermark always moves."""
    messages = list(
        Message.objects.filter(chat_id=chat_id, seq__gt=after_seq)
        .order_by("seq")
        .only("chat_id", "seq", "role", "content", "metadata")[:BATCH_MESSAGES]
    )
    runs = turns_of(messages)
    turns: list[Turn] = []
    for index, run in enumerate(runs):
        followed = index + 1 < len(runs)
        if followed or ends_with_final_reply(run):
            turns.append(turn_of(run, complete=True))
        elif len(messages) == BATCH_MESSAGES and not turns:
            turns.append(turn_of(run, complete=False))  # cut off by the batch
    return turns


def commit(state: AgentState, turns: list[Turn], draft: Draft) -> bool:
    active = rules.active_entities(draft.registry, settings.AGENT_MAX_ACTIVE_ENTITIES)
    block = rules.render_context(
        draft.theme, active, draft.pending, settings.AGENT_CONTEXT_MAX_TOKENS, count_tokens
    )
    watermark = max(turn.last_seq for turn in turns)
    with transaction.atomic():
        if not hold_chat(state.chat_id):
            return False  # deleted meanwhile: nothing to keep
        # The fencing step: only the run that read this watermark may move it.
        committed = AgentState.objects.filter(
            chat_id=state.chat_id, processed_seq=state.processed_seq
        ).update(
            processed_seq=watermark,
            active_entities=active,
            context_block=block,
            context_tokens=count_tokens(block) if block else 0,
            **draft_fields(draft),
        )
        if committed:
            ResponseSummary.objects.bulk_create(draft.summaries, ignore_conflicts=True)
    log.info(
        "agent state %s",
        "updated" if committed else "superseded",
        extra={
            "event": "agent_state",
            "chat_id": state.chat_id,
            "from_seq": state.processed_seq + 1,
            "to_seq": watermark,
            "response_summaries": len(draft.summaries),
            "outcome": "updated" if committed else "superseded",
        },
    )
    return bool(committed)
