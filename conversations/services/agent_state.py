"""The agent state, the web side (docs/agent-state.md): a turn's agent context stored with it, the
work handed to the worker after the turn commits (memory_worker.agents.summaries), the chat model
the worker's summaries ask, and the state endpoint's reader."""

import logging
from collections.abc import Mapping
from typing import Any

from django.conf import settings

from conversations import agent_rules as rules
from conversations.chat_model.contract import ModelError
from conversations.models import AgentState, Chat, Message, Role
from conversations.services.chat_backend import chat_backend_name, get_chat_model
from conversations.services.turn_model import REPLY_LIMIT_KEY
from memory_worker.memory import TURN_DIGEST, agent_state_limits, request_agent_summary

log = logging.getLogger("chatmem.agent_state")

RECENT_SUMMARIES = 10  # response summaries shown by the state endpoint


def turn_metadata(agent: Mapping[str, Any] | None) -> dict[str, Any] | None:
    """The user message's metadata for a turn that carries agent context: stored with the turn,
    in its transaction (a turn that fails stores neither)."""
    return {"agent": dict(agent)} if agent else None


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
        request_agent_summary(chat.pk, user_message.seq)
    except Exception:
        log.exception("could not queue the agent-state update", extra={"chat_id": chat.pk})


def llm_enabled() -> bool:
    """AGENT_SUMMARY_BACKEND: "llm", "offline", or empty = the chat backend's choice (the
    configured model when an API key is set, else offline)."""
    backend = settings.AGENT_SUMMARY_BACKEND or (
        "llm" if chat_backend_name() == "openai" else "offline"
    )
    return backend == "llm"


# The one-sentence summary's output limit (sent in the field the endpoint honours): a small
# local model that loops stops here instead of at the deadline.
ONE_SENTENCE_TOKENS = 120


class ChatAgentModel:
    """The model memory_worker.agents.turns asks: the configured chat model, when
    AGENT_SUMMARY_BACKEND (empty: the chat backend's choice) says "llm"."""

    def enabled(self) -> bool:
        return llm_enabled()

    def ask(self, instructions: str, content: str) -> str:
        """One sentence, or "" (logged): the caller falls back to the offline summarizer."""
        messages = [
            {"role": Role.SYSTEM.value, "content": instructions},
            {"role": Role.USER.value, "content": content},
        ]
        model = settings.AGENT_SUMMARY_MODEL or settings.CHAT_MODEL
        try:
            limit = {REPLY_LIMIT_KEY: ONE_SENTENCE_TOKENS}
            completion = get_chat_model().complete(messages, model, limit)
        except ModelError as error:
            log.warning(
                "agent summary call failed; using the offline summarizer",
                extra={"event": "agent_summary_failed", "error": str(error)},
            )
            return ""
        return rules.one_sentence(completion.content)


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
        "limits": agent_state_limits().__dict__,
    }
