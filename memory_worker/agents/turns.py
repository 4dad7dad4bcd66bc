"""What one turn applies to the agent state (docs/agent-state.md), computed in memory with no
transaction open: entities, pending clarification, compressed steps, the session theme and the
response summary, asking the model where the doc says so (with deterministic stand-ins)."""

import logging
from collections.abc import Mapping
from dataclasses import dataclass, field
from typing import Any, Protocol

from conversations import agent_rules as rules
from conversations.models import AgentState, Message, ResponseSummary, Role
from memory_worker.coordination.deadlines import time_for_a_chunk

log = logging.getLogger("chatmem.agent_state")


class AgentModel(Protocol):
    """The model the summaries ask: the chat model, which the web side provides at start-up
    (``use_model``); the worker's modules may not import it."""

    def enabled(self) -> bool: ...

    def ask(self, instructions: str, content: str) -> str:
        """One sentence, or "" (logged) when the call failed."""
        ...


class OfflineModel:
    """No model: every summary is the deterministic or offline one."""

    def enabled(self) -> bool:
        return False

    def ask(self, instructions: str, content: str) -> str:
        return ""


_model: AgentModel = OfflineModel()


def use_model(model: AgentModel) -> None:
    global _model
    _model = model


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
    if _model.enabled():
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
    if _model.enabled():
        reply = turn.reply.content if turn.reply is not None else ""
        request = rules.theme_request(current, user_text, reply)
        text = ask_model(rules.THEME_INSTRUCTIONS, request, deadline)
        if text:
            return text
    return rules.offline_theme(current, agent, user_text)


def ask_model(instructions: str, content: str, deadline: float | None = None) -> str:
    """One sentence from the model, or "" so the caller falls back to the deterministic
    summarizer: agent state must not stall on a model outage. Raises NoTimeLeft before a call
    that may not finish by ``deadline``: the soft time limit would interrupt it and lose the
    step's work."""
    if not time_for_a_chunk(deadline):
        raise NoTimeLeft
    return _model.ask(instructions, content)
