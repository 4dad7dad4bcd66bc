"""Seed 004's Summarize node as a service (docs/agent-state.md): after every reply, off the
request path, apply the turn to the chat's agent state: response summary, session theme, entity
registry and active entities, pending clarification, compressed step results.

How a run stays correct without a lock (the same pattern as the fold, DESIGN §6): read the state
and its watermark ``processed_seq``, compute every new turn with no transaction open (this is
where LLM calls happen), then commit with ONE conditional UPDATE ``WHERE processed_seq = read``.
Zero rows means another run applied these turns first: nothing is written, and the loop looks
again. So a task delivered twice, late, or in parallel applies each turn exactly once."""

import logging
import time
from collections.abc import Mapping
from dataclasses import dataclass, field
from typing import Any

from django.conf import settings
from django.db import IntegrityError, connection, transaction

from conversations import agent_state as rules
from conversations import rows
from conversations.llm import ModelError
from conversations.models import AgentState, Chat, Message, ResponseSummary, Role
from conversations.services.backends import chat_backend_name, get_chat_model
from memory_worker.tokens import count_tokens
from memory_worker.turn_groups import turns_of

log = logging.getLogger("chatmem.agent_state")

TURN_DIGEST = "turn-digest"
MAX_RUNS = 5  # batches read per task (each turn its own commit) before handing the rest on
BATCH_MESSAGES = 60  # messages read per batch (the complete turns in it are applied)
RECENT_SUMMARIES = 10  # response summaries shown by the state endpoint


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


def turn_metadata(agent: Mapping[str, Any] | None) -> dict[str, Any] | None:
    """The user message's metadata for a turn that carries agent context: stored with the turn,
    in its transaction (a turn that fails stores neither)."""
    return {"agent": dict(agent)} if agent else None


# ---------------------------------------------------------------------------------------------
# After commit (request thread): hand the work on


def queue_agent_summary(
    chat: Chat, user_message: Message, has_agent_state: bool | None = None
) -> None:
    """Runs after the turn commits. Chats that never used agent context and are not turn-digest
    chats have nothing to maintain: no task, no LLM cost. Never raises (promise 5).
    ``has_agent_state``: what the turn's snapshot already read (None: look it up)."""
    try:
        if has_agent_state is None:
            has_agent_state = AgentState.objects.filter(chat_id=chat.pk).exists()
        if not ("agent" in user_message.metadata or chat.policy == TURN_DIGEST or has_agent_state):
            return
        from memory_worker.agent_summaries import request_agent_summary

        request_agent_summary(chat.pk, user_message.seq)
    except Exception:
        log.exception("could not queue the agent-state update", extra={"chat_id": chat.pk})


# ---------------------------------------------------------------------------------------------
# Off the request path


@dataclass(frozen=True)
class Turn:
    """What one step applies: a user message and every message after it up to the next user
    message (tool calls, tool results, intermediate and final replies). ``user`` is None for a
    continuation: messages after the watermark that carry on the turn already applied (the tool
    result and final reply of a /v1 tool round arrive in later requests, with no user message).

    ``reply`` is the reply the turn is summarised by: its final assistant reply, None when the
    turn has none yet (it was cut off by the batch) or ended on a tool call. ``last_seq`` is the
    turn's last message: where the watermark moves once it is applied."""

    user: Message | None
    reply: Message | None
    last_seq: int

    @property
    def agent(self) -> dict[str, Any]:
        if self.user is None:
            return {}
        return dict(self.user.metadata.get("agent") or {})

    @property
    def is_continuation(self) -> bool:
        return self.user is None

    @property
    def seq(self) -> int:
        """The seq the state records for this turn (entities, pending, steps)."""
        return self.reply.seq if self.reply is not None else self.last_seq


@dataclass
class Draft:
    """The state being computed, in memory, from the state that was read."""

    theme: str
    registry: dict[str, dict[str, Any]]
    pending: dict[str, Any] | None
    recent_steps: list[dict[str, Any]]
    step_summaries: list[dict[str, Any]]
    turns: int
    summaries: list[ResponseSummary] = field(default_factory=list)


class NoTimeLeft(Exception):
    """A model call would not finish before the task's deadline: stop before it."""


def summarize_turns(chat_id: int, from_seq: int | None = None, started: float | None = None) -> int:
    """Apply every turn after the watermark; returns how many were applied (continuations are
    not turns). ``from_seq`` (the user message of the turn that triggered this) is where a new
    state starts: turns before the chat's first agent turn are not back-filled. ``started``
    (``time.monotonic()``): when the task started, for its deadline.

    Each turn is committed on its own: a backlog that takes longer than the task's soft time
    limit keeps the turns already applied (it used to commit only after the whole batch, so a
    slow model lost everything to the limit, and every later task redid the same batch). No
    model call starts unless it can finish before the deadline; what is left is handed on."""
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
    """The fold's deadline (consolidation.task_deadline), made strict enough that
    ``time_for_a_chunk`` (which allows one MEMORY_LLM_TIMEOUT_SECONDS) also fits one agent
    summary call, which is bounded by the chat model's LLM_TIMEOUT_SECONDS."""
    # Imported here: memory_worker.consolidation imports this module (the turn-digest fold).
    from memory_worker.consolidation import task_deadline

    longer_call = max(settings.LLM_TIMEOUT_SECONDS - settings.MEMORY_LLM_TIMEOUT_SECONDS, 0)
    return task_deadline(time.monotonic() if started is None else started) - longer_call


def hand_on(chat_id: int, reason: str) -> None:
    """Queue a fresh task for the turns this one leaves (never raises: a lost hand-off is
    picked up by the chat's next turn, whose task applies everything after the watermark)."""
    from memory_worker.agent_summaries import request_agent_summary

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
    call lost the final reply (and made the state depend on when the worker ran). Messages
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


def calls_tools(message: Message) -> bool:
    return bool((message.metadata or {}).get("tool_calls"))


def ends_with_final_reply(run: list[Message]) -> bool:
    last = run[-1]
    return last.role == Role.ASSISTANT and not calls_tools(last)


def turn_of(run: list[Message], complete: bool) -> Turn:
    user = run[0] if run[0].role == Role.USER else None
    replies = [m for m in run if m.role == Role.ASSISTANT]
    # Only a finished turn's final reply is summarised: a cut-off run's last reply is an
    # intermediate one, and a continuation brings the final one later.
    final = replies[-1] if complete and replies and not calls_tools(replies[-1]) else None
    return Turn(user, final, run[-1].seq)


def compute(
    state: AgentState, turns: list[Turn], limits: rules.Limits, deadline: float | None = None
) -> Draft:
    """The state after ``turns``. ``deadline``: raise NoTimeLeft rather than start a model call
    that may not finish by then (None: no deadline)."""
    draft = Draft(
        theme=state.engagement_summary,
        registry=dict(state.entity_registry),
        pending=state.pending_clarification,
        recent_steps=list(state.recent_steps),
        step_summaries=list(state.step_summaries),
        turns=state.turns,
    )
    for turn in turns:
        if turn.is_continuation:
            apply_continuation(draft, turn, limits, deadline)
        else:
            apply_turn(draft, turn, limits, deadline)
    return draft


def apply_turn(
    draft: Draft, turn: Turn, limits: rules.Limits, deadline: float | None = None
) -> None:
    agent = turn.agent
    seq = turn.seq
    draft.turns += 1
    entities = agent.get("entities") or []
    draft.registry = rules.merge_entities(draft.registry, entities, draft.turns, seq)
    draft.registry = rules.collect_garbage(draft.registry, draft.turns, limits.pending_ttl_turns)
    draft.registry = rules.bounded_registry(draft.registry, limits.max_registry_entities)
    labels = [entity["label"] for entity in entities] + [
        record["label"] for record in draft.registry.values()
    ]
    add_response_summary(draft, agent, turn, labels, limits, deadline)
    if agent and rules.needs_theme_update(agent) and turn.user is not None:
        draft.theme = session_theme(draft.theme, agent, turn.user.content, turn, deadline)
    if agent:
        draft.pending = rules.pending_after(draft.pending, agent, seq)
        draft.recent_steps, draft.step_summaries = rules.compress_steps(
            draft.recent_steps, draft.step_summaries, agent.get("step_results") or [], seq, limits
        )


def apply_continuation(
    draft: Draft, turn: Turn, limits: rules.Limits, deadline: float | None = None
) -> None:
    """The rest of a turn already applied: only its final reply's response summary. The turn
    was counted, and its entities, pending decision and steps applied, when its user message
    was; doing that again would apply them twice."""
    labels = [record["label"] for record in draft.registry.values()]
    add_response_summary(draft, {}, turn, labels, limits, deadline)


def add_response_summary(
    draft: Draft,
    agent: Mapping[str, Any],
    turn: Turn,
    labels: list[str],
    limits: rules.Limits,
    deadline: float | None,
) -> None:
    if turn.reply is None:
        return
    summary = response_summary(agent, turn.reply.content, labels, limits, deadline)
    if summary is None:
        return
    text, source = summary
    draft.summaries.append(
        ResponseSummary(
            chat_id=turn.reply.chat_id,
            seq=turn.reply.seq,
            decision=agent.get("decision", ""),
            summary=text,
            source=source,
        )
    )


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


# ---------------------------------------------------------------------------------------------
# The seed's LLM calls (with deterministic stand-ins)


def hold_chat(chat_id: int) -> bool:
    """Whether the chat still exists, holding it against deletion until the transaction ends.
    A deletion locks the chat row first, then deletes its rows table by table
    (conversations.models.lock_chat_being_deleted); this commit updates the agent state row, then
    inserts response summaries, whose foreign key on the chat is checked at commit. Without the
    chat locked first, each waited for the other: a deadlock that failed the deletion. FOR KEY
    SHARE blocks only a deletion (or a key change), not a turn's updates of the chat row."""
    if connection.vendor != "postgresql":
        return Chat.objects.filter(pk=chat_id).exists()
    with connection.cursor() as cursor:
        cursor.execute(
            f"SELECT 1 FROM {rows.quoted_table(Chat)} WHERE id = %s FOR KEY SHARE", [chat_id]
        )
        return cursor.fetchone() is not None


def llm_enabled() -> bool:
    """AGENT_SUMMARY_BACKEND: "llm", "offline", or empty = the chat backend's choice (the
    configured model when an API key is set, else offline)."""
    backend = settings.AGENT_SUMMARY_BACKEND or (
        "llm" if chat_backend_name() == "openai" else "offline"
    )
    return backend == "llm"


def response_summary(
    agent: Mapping[str, Any],
    reply: str,
    labels: list[str],
    limits: rules.Limits,
    deadline: float | None = None,
) -> tuple[str, str] | None:
    """(summary, source) or None when the reply needs none."""
    mode = rules.uses_llm_summary(agent, reply, limits)
    if mode is None:
        return None
    if mode is False:
        return rules.deterministic_summary(agent), "deterministic"
    if llm_enabled():
        text = ask_model(
            rules.RESPONSE_SUMMARY_INSTRUCTIONS,
            rules.response_summary_request(reply, list(dict.fromkeys(labels))),
            deadline,
        )
        if text:
            return text, "llm"
    return rules.offline_response_summary(reply, labels), "offline"


def session_theme(
    current: str, agent: Mapping[str, Any], user_text: str, turn: Turn, deadline: float | None
) -> str:
    if llm_enabled():
        reply = turn.reply.content if turn.reply is not None else ""
        request = rules.theme_request(current, user_text, reply)
        text = ask_model(rules.THEME_INSTRUCTIONS, request, deadline)
        if text:
            return text
    return rules.offline_theme(current, agent, user_text)


def ask_model(instructions: str, content: str, deadline: float | None = None) -> str:
    """One sentence from the configured chat model, or "" (logged) so the caller falls back to
    the deterministic summarizer: agent state must not stall on a model outage. Raises
    NoTimeLeft before a call that may not finish by ``deadline``: the soft time limit would
    interrupt it (SoftTimeLimitExceeded is no ModelError) and lose the step's work."""
    from memory_worker.consolidation import time_for_a_chunk

    if not time_for_a_chunk(deadline):
        raise NoTimeLeft
    messages = [
        {"role": Role.SYSTEM.value, "content": instructions},
        {"role": Role.USER.value, "content": content},
    ]
    model = settings.AGENT_SUMMARY_MODEL or settings.CHAT_MODEL
    try:
        completion = get_chat_model().complete(messages, model)
    except ModelError as error:
        log.warning(
            "agent summary call failed; using the offline summarizer",
            extra={"event": "agent_summary_failed", "error": str(error)},
        )
        return ""
    return rules.one_sentence(completion.content)


# ---------------------------------------------------------------------------------------------
# Readers: the state endpoint, the admin, the turn-digest fold


def chat_state(chat: Chat) -> dict[str, Any]:
    state = AgentState.objects.filter(chat_id=chat.pk).first() or AgentState(chat_id=chat.pk)
    summaries = list(chat.response_summaries.order_by("-seq")[:RECENT_SUMMARIES])
    return {
        "engagement_summary": state.engagement_summary,
        "active_entities": state.active_entities,
        "entity_registry": sorted(
            state.entity_registry.values(), key=lambda r: (r["first_seq"], r["id"])
        ),
        "pending_clarification": state.pending_clarification,
        "response_summaries": list(reversed(summaries)),
        "recent_steps": state.recent_steps,
        "step_summaries": state.step_summaries,
        "processed_seq": state.processed_seq,
        "turns": state.turns,
        "context_block": state.context_block,
        "context_tokens": state.context_tokens,
        "limits": limits().__dict__,
    }
