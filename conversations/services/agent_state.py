"""Seed 004's Summarize node as a service (docs/agent-state.md): after every reply, off the
request path, apply the turn to the chat's agent state: response summary, session theme, entity
registry and active entities, pending clarification, compressed step results.

How a run stays correct without a lock (the same pattern as the fold, DESIGN §6): read the state
and its watermark ``processed_seq``, compute every new turn with no transaction open (this is
where LLM calls happen), then commit with ONE conditional UPDATE ``WHERE processed_seq = read``.
Zero rows means another run applied these turns first: nothing is written, and the loop looks
again. So a task delivered twice, late, or in parallel applies each turn exactly once."""

import logging
from collections.abc import Mapping
from dataclasses import dataclass, field
from typing import Any

from django.conf import settings
from django.db import IntegrityError, transaction

from conversations import agent_state as rules
from conversations.llm import ModelError
from conversations.models import AgentState, Chat, Message, ResponseSummary, Role
from conversations.services.backends import chat_backend_name, get_chat_model
from memory_worker.tokens import count_tokens

log = logging.getLogger("chatmem.agent_state")

TURN_DIGEST = "turn-digest"
MAX_RUNS = 5  # conditional-commit attempts per task before leaving the rest to the next one
BATCH_MESSAGES = 60  # messages read per attempt (each attempt applies the complete turns)
RECENT_SUMMARIES = 10  # response summaries shown by the state endpoint


def limits() -> rules.Limits:
    return rules.Limits(
        summarize_threshold=settings.SUMMARIZE_THRESHOLD,
        full_detail_steps=settings.FULL_DETAIL_STEPS,
        pending_ttl_turns=settings.PENDING_TTL_TURNS,
        max_active_entities=settings.AGENT_MAX_ACTIVE_ENTITIES,
        max_step_summaries=settings.AGENT_MAX_STEP_SUMMARIES,
        max_registry_entities=settings.AGENT_MAX_REGISTRY_ENTITIES,
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
    user: Message
    reply: Message

    @property
    def agent(self) -> dict[str, Any]:
        return dict(self.user.metadata.get("agent") or {})


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


def summarize_turns(chat_id: int, from_seq: int | None = None) -> int:
    """Apply every turn after the watermark; returns how many were applied. ``from_seq`` (the
    user message of the turn that triggered this) is where a new state starts: turns before the
    chat's first agent turn are not back-filled."""
    applied = 0
    for _run in range(MAX_RUNS):
        state = _state_for(chat_id, from_seq)
        if state is None:  # the chat was deleted while queued
            return applied
        turns = pending_turns(chat_id, state.processed_seq)
        if not turns:
            return applied
        draft = compute(state, turns, limits())
        if commit(state, turns, draft):
            applied += len(turns)
        # committed or superseded: look again for turns after the (new) watermark
    return applied


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
    """Complete turns (a user message and the reply that ends it) after ``after_seq``. Tool
    traffic and intermediate assistant messages belong to the turn; its last reply counts."""
    messages = list(
        Message.objects.filter(chat_id=chat_id, seq__gt=after_seq)
        .order_by("seq")
        .only("chat_id", "seq", "role", "content", "metadata")[:BATCH_MESSAGES]
    )
    turns: list[Turn] = []
    user: Message | None = None
    reply: Message | None = None
    for message in messages:
        if message.role == Role.USER:
            if user is not None and reply is not None:
                turns.append(Turn(user, reply))
            user, reply = message, None
        elif message.role == Role.ASSISTANT and user is not None:
            reply = message
    # The last turn is complete only if nothing after it was cut off by the batch (unless it is
    # the only one: a turn longer than a batch must still move the watermark).
    if user is not None and reply is not None and (len(messages) < BATCH_MESSAGES or not turns):
        turns.append(Turn(user, reply))
    return turns


def compute(state: AgentState, turns: list[Turn], limits: rules.Limits) -> Draft:
    draft = Draft(
        theme=state.engagement_summary,
        registry=dict(state.entity_registry),
        pending=state.pending_clarification,
        recent_steps=list(state.recent_steps),
        step_summaries=list(state.step_summaries),
        turns=state.turns,
    )
    for turn in turns:
        apply_turn(draft, turn, limits)
    return draft


def apply_turn(draft: Draft, turn: Turn, limits: rules.Limits) -> None:
    agent = turn.agent
    seq = turn.reply.seq
    draft.turns += 1
    entities = agent.get("entities") or []
    draft.registry = rules.merge_entities(draft.registry, entities, draft.turns, seq)
    draft.registry = rules.collect_garbage(draft.registry, draft.turns, limits.pending_ttl_turns)
    draft.registry = rules.bounded_registry(draft.registry, limits.max_registry_entities)
    labels = [entity["label"] for entity in entities] + [
        record["label"] for record in draft.registry.values()
    ]
    summary = response_summary(agent, turn.reply.content, labels, limits)
    if summary is not None:
        text, source = summary
        draft.summaries.append(
            ResponseSummary(
                chat_id=turn.reply.chat_id,
                seq=seq,
                decision=agent.get("decision", ""),
                summary=text,
                source=source,
            )
        )
    if agent and rules.needs_theme_update(agent):
        draft.theme = session_theme(draft.theme, agent, turn)
    if agent:
        draft.pending = rules.pending_after(draft.pending, agent, seq)
        draft.recent_steps, draft.step_summaries = rules.compress_steps(
            draft.recent_steps, draft.step_summaries, agent.get("step_results") or [], seq, limits
        )


def commit(state: AgentState, turns: list[Turn], draft: Draft) -> bool:
    active = rules.active_entities(draft.registry, settings.AGENT_MAX_ACTIVE_ENTITIES)
    block = rules.render_context(draft.theme, active, draft.pending)
    with transaction.atomic():
        # The fencing step: only the run that read this watermark may move it.
        committed = AgentState.objects.filter(
            chat_id=state.chat_id, processed_seq=state.processed_seq
        ).update(
            processed_seq=max(turn.reply.seq for turn in turns),
            turns=draft.turns,
            engagement_summary=draft.theme,
            active_entities=active,
            entity_registry=draft.registry,
            pending_clarification=draft.pending,
            recent_steps=draft.recent_steps,
            step_summaries=draft.step_summaries,
            context_block=block,
            context_tokens=count_tokens(block) if block else 0,
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
            "to_seq": max(turn.reply.seq for turn in turns),
            "response_summaries": len(draft.summaries),
            "outcome": "updated" if committed else "superseded",
        },
    )
    return bool(committed)


# ---------------------------------------------------------------------------------------------
# The seed's LLM calls (with deterministic stand-ins)


def llm_enabled() -> bool:
    """AGENT_SUMMARY_BACKEND: "llm", "offline", or empty = the chat backend's choice (the
    configured model when an API key is set, else offline)."""
    backend = settings.AGENT_SUMMARY_BACKEND or (
        "llm" if chat_backend_name() == "openai" else "offline"
    )
    return backend == "llm"


def response_summary(
    agent: Mapping[str, Any], reply: str, labels: list[str], limits: rules.Limits
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
        )
        if text:
            return text, "llm"
    return rules.offline_response_summary(reply, labels), "offline"


def session_theme(current: str, agent: Mapping[str, Any], turn: Turn) -> str:
    if llm_enabled():
        request = rules.theme_request(current, turn.user.content, turn.reply.content)
        text = ask_model(rules.THEME_INSTRUCTIONS, request)
        if text:
            return text
    return rules.offline_theme(current, agent, turn.user.content)


def ask_model(instructions: str, content: str) -> str:
    """One sentence from the configured chat model, or "" (logged) so the caller falls back to
    the deterministic summarizer: agent state must not stall on a model outage."""
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


def digest_fold_messages(chat: Chat, messages: list[Message]) -> list[Message]:
    """For a turn-digest chat, the messages a fold sends to the summarizer, with each assistant
    reply that has a response summary replaced by that summary (seed 004: older turns are
    compressed from the summaries, not the full text). Unsaved copies: history is append-only."""
    if chat.policy != TURN_DIGEST or not messages:
        return messages
    replies = [m.seq for m in messages if m.role == Role.ASSISTANT]
    summaries = dict(
        ResponseSummary.objects.filter(chat_id=chat.pk, seq__in=replies).values_list(
            "seq", "summary"
        )
    )
    if not summaries:
        return messages
    return [_with_content(m, summaries[m.seq]) if m.seq in summaries else m for m in messages]


def _with_content(message: Message, content: str) -> Message:
    return Message(
        id=message.id,
        chat_id=message.chat_id,
        seq=message.seq,
        role=message.role,
        content=content,
        token_count=count_tokens(content),
        metadata=message.metadata,
    )
