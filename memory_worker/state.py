"""Reads a chat's memory state from the database and turns it into the pure engine's input.

The brief and every message after its watermark must come from one snapshot, or from the brief
first and then the messages: a fold that commits in between only makes the snapshot include
messages that are already folded (an older summary plus extra verbatim messages), never a gap.
PostgreSQL reads both in one statement (one snapshot, one round trip); other databases read the
brief first, then the tail.
"""

from dataclasses import dataclass
from datetime import datetime
from typing import Any

from django.db import connection

from conversations import rows
from conversations.models import AgentState, Brief, Chat, Message
from memory_worker import policy as engine


@dataclass(frozen=True)
class MemorySnapshot:
    chat_id: int
    summary: str
    summary_tokens: int
    last_consolidated: int
    version: int
    turns_mark: int
    last_consolidated_at: object  # datetime | None, kept opaque for the engine
    # Failed folds back off until then (None: not backing off); turn triggers wait for it.
    next_attempt_at: datetime | None
    unfolded: tuple[Message, ...]
    # Seed 004's agent state as the model receives it (a system message after the prompt) and
    # its stored token count: part of the prompt, so part of the bound.
    agent_context: str = ""
    agent_context_tokens: int = 0
    has_agent_state: bool = False

    @property
    def last_seq(self) -> int:
        return self.unfolded[-1].seq if self.unfolded else self.last_consolidated


UNFOLDED_FIELDS = ("id", "chat_id", "seq", "role", "content", "token_count", "metadata")


def load_snapshot(chat_id: int) -> MemorySnapshot:
    if connection.vendor == "postgresql":
        brief, (agent_block, agent_tokens, agent_exists), unfolded = read_brief_and_tail(chat_id)
    else:
        brief, (agent_block, agent_tokens, agent_exists) = read_brief(chat_id)
        unfolded = read_unfolded(chat_id, brief.last_consolidated)
    return MemorySnapshot(
        chat_id=chat_id,
        summary=brief.summary,
        summary_tokens=brief.summary_tokens,
        last_consolidated=brief.last_consolidated,
        version=brief.version,
        turns_mark=brief.turns_mark,
        last_consolidated_at=brief.last_consolidated_at,
        next_attempt_at=brief.next_attempt_at,
        unfolded=unfolded,
        agent_context=agent_block or "",
        agent_context_tokens=agent_tokens or 0,
        has_agent_state=bool(agent_exists),
    )


# Plain SQL (conversations.rows) for both reads: they run on every turn and every fold, and the
# ORM's query building costs more than the queries.


def read_unfolded(chat_id: int, watermark: int) -> tuple[Message, ...]:
    """Every message after ``watermark``, in seq order (deferred fields: as with only())."""
    fields = rows.selected_fields(Message, UNFOLDED_FIELDS)
    sql = (
        f"SELECT {rows.column_list(fields)} FROM {rows.quoted_table(Message)} "
        "WHERE chat_id = %s AND seq > %s ORDER BY seq"
    )
    return tuple(
        message for message, _ in rows.fetch_instances(Message, fields, sql, [chat_id, watermark])
    )


def read_chat(chat_id: int) -> Chat | None:
    fields = rows.selected_fields(Chat)
    sql = f"SELECT {rows.column_list(fields)} FROM {rows.quoted_table(Chat)} WHERE id = %s"
    found = rows.fetch_instances(Chat, fields, sql, [chat_id])
    return found[0][0] if found else None


def read_brief(chat_id: int) -> tuple[Brief, tuple[Any, ...]]:
    """The brief, and the chat's agent state (seed 004) alongside as (context block, its
    tokens, whether the chat has one): one query on the turn's hot path."""
    brief, agent, _tail = _brief_row(chat_id, "")
    return brief, agent


def read_brief_and_tail(chat_id: int) -> tuple[Brief, tuple[Any, ...], tuple[Message, ...]]:
    """PostgreSQL: ``read_brief`` and ``read_unfolded`` in one statement, the tail as a JSON
    array of rows (see rows.instances_from_json). One round trip fewer on every turn and fold,
    and decoding one JSON document costs less than converting each row's columns (benchmarks.md).
    """
    fields = rows.selected_fields(Message, UNFOLDED_FIELDS)
    tail = (
        f", (SELECT json_agg(json_build_array({rows.column_list(fields, 'm')}) ORDER BY m.seq) "
        f"FROM {rows.quoted_table(Message)} m "
        "WHERE m.chat_id = brief.chat_id AND m.seq > brief.last_consolidated)"
    )
    brief, agent, extra = _brief_row(chat_id, tail)
    return brief, agent, tuple(rows.instances_from_json(Message, fields, extra[0] or ()))


def _brief_row(chat_id: int, more_columns: str) -> tuple[Brief, tuple[Any, ...], tuple[Any, ...]]:
    fields = rows.selected_fields(Brief)
    found = rows.fetch_instances(
        Brief,
        fields,
        f"SELECT {rows.column_list(fields, 'brief')}, agent.context_block, "
        f"agent.context_tokens, agent.chat_id IS NOT NULL{more_columns} "
        f"FROM {rows.quoted_table(Brief)} brief LEFT JOIN {rows.quoted_table(AgentState)} agent "
        "ON agent.chat_id = brief.chat_id WHERE brief.chat_id = %s",
        [chat_id],
    )
    if not found:
        raise Brief.DoesNotExist(f"chat {chat_id} has no brief")
    brief, extra = found[0]
    return brief, extra[:3], extra[3:]


def with_appended(snapshot: MemorySnapshot, messages: list[Message]) -> MemorySnapshot:
    """The snapshot after a turn stored ``messages`` (no re-read needed)."""
    return MemorySnapshot(**{**snapshot.__dict__, "unfolded": snapshot.unfolded + tuple(messages)})


def engine_state(chat: Chat, snapshot: MemorySnapshot, context_tokens: int) -> engine.ChatState:
    return engine.ChatState(
        last_consolidated=snapshot.last_consolidated,
        last_seq=snapshot.last_seq,
        unfolded=tuple(engine.Msg(m.seq, m.role, m.token_count) for m in snapshot.unfolded),
        summary_tokens=snapshot.summary_tokens,
        system_tokens=chat.system_prompt_tokens + agent_context_tokens(chat, snapshot),
        turns_mark=snapshot.turns_mark,
        # Seed 001's cooldown counts from the last fold; before the first one, from the chat's
        # creation (otherwise any new chat past its tail would fold at once).
        last_consolidated_at=snapshot.last_consolidated_at or chat.created_at,  # type: ignore[arg-type]
        model_context_tokens=context_tokens,
    )


def agent_context_tokens(chat: Chat, snapshot: MemorySnapshot) -> int:
    """The agent-state message counted with the system prompt: its tokens, plus the role
    overhead of a second system message when the prompt already has one (the engine adds one
    overhead for the system part)."""
    if not snapshot.agent_context:
        return 0
    overhead = engine.ROLE_OVERHEAD_TOKENS if chat.system_prompt_tokens else 0
    return snapshot.agent_context_tokens + overhead
