"""The agent state on the Chat admin page (docs/agent-state.md): read-only, since it is written only
by the Summarize step after replies."""

import json
from typing import Any

from django.contrib import admin
from django.http import HttpRequest
from django.utils.html import format_html

from conversations.models import AgentState, Chat

RECENT_SUMMARIES = 10


def _pretty(value: object) -> str:
    return format_html("<pre>{}</pre>", json.dumps(value, indent=2, ensure_ascii=False))


def agent_state_shown(chat: Chat) -> bool:
    """Whether the chat has agent state worth a section: most chats have none, or only empty
    lists."""
    state = AgentState.objects.filter(chat=chat).first()
    if state is None:
        return False
    tracked = (
        state.engagement_summary,
        state.active_entities,
        state.entity_registry,
        state.pending_clarification,
        state.recent_steps,
        state.step_summaries,
        state.context_block,
    )
    return any(tracked) or chat.response_summaries.exists()


# The inline's fields left out when their model field is empty.
HIDDEN_WHEN_EMPTY = {
    "engagement_summary": "engagement_summary",
    "active": "active_entities",
    "pending": "pending_clarification",
    "registry": "entity_registry",
    "steps": "recent_steps",
    "older_steps": "step_summaries",
    "context_block": "context_block",
}


class AgentStateInline(admin.StackedInline):
    model = AgentState
    can_delete = False
    verbose_name = verbose_name_plural = "what the assistant is tracking (agent state)"
    readonly_fields = (
        "engagement_summary",
        "active",
        "pending",
        "registry",
        "response_summaries",
        "steps",
        "older_steps",
        "context_block",
        "context_tokens",
        "processed_seq",
        "turns",
        "updated_at",
    )
    fields = readonly_fields

    def get_fields(self, request: HttpRequest, obj: Any = None) -> Any:
        """Only what the state holds: an empty list or text is left out, not shown as []."""
        state = getattr(obj, "agent_state", None)
        if state is None:
            return self.fields
        return [
            name
            for name in self.fields
            if name not in HIDDEN_WHEN_EMPTY or getattr(state, HIDDEN_WHEN_EMPTY[name])
        ]

    def has_add_permission(self, request: HttpRequest, obj: object = None) -> bool:
        return False

    def has_change_permission(self, request: HttpRequest, obj: object = None) -> bool:
        return False

    @admin.display(description="active entities")
    def active(self, state: AgentState) -> str:
        return _pretty(state.active_entities)

    @admin.display(description="pending clarification")
    def pending(self, state: AgentState) -> str:
        return _pretty(state.pending_clarification)

    @admin.display(description="entity registry")
    def registry(self, state: AgentState) -> str:
        return _pretty(list(state.entity_registry.values()))

    @admin.display(description="recent response summaries")
    def response_summaries(self, state: AgentState) -> str:
        recent = state.chat.response_summaries.order_by("-seq")[:RECENT_SUMMARIES]
        return _pretty([f"#{r.seq} [{r.source}] {r.summary}" for r in reversed(recent)])

    @admin.display(description="recent step results (full)")
    def steps(self, state: AgentState) -> str:
        return _pretty(state.recent_steps)

    @admin.display(description="older step results (one line each)")
    def older_steps(self, state: AgentState) -> str:
        return _pretty(state.step_summaries)
