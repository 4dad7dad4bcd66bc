"""Reads a chat's memory state from the database and turns it into the pure engine's input.

Read order matters: the brief first, then every message after its watermark. A fold that
commits in between only makes the snapshot include messages that are already folded (an
older summary plus extra verbatim messages): never a gap.
"""

from dataclasses import dataclass

from django.db import connection

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
    brief = read_brief(chat_id)
    unfolded = tuple(
        Message.objects.filter(chat_id=chat_id, seq__gt=brief.last_consolidated)
        .order_by("seq")
        .only(*UNFOLDED_FIELDS)
    )
    return MemorySnapshot(
        chat_id=chat_id,
        summary=brief.summary,
        summary_tokens=brief.summary_tokens,
        last_consolidated=brief.last_consolidated,
        version=brief.version,
        turns_mark=brief.turns_mark,
        last_consolidated_at=brief.last_consolidated_at,
        unfolded=unfolded,
        agent_context=getattr(brief, "agent_block", None) or "",
        agent_context_tokens=getattr(brief, "agent_tokens", None) or 0,
        has_agent_state=bool(getattr(brief, "agent_exists", False)),
    )


def read_brief(chat_id: int) -> Brief:
    """The brief with the chat's agent state (seed 004) alongside, as ``agent_block``,
    ``agent_tokens`` and ``agent_exists``: one query on the turn's hot path. Plain SQL through
    raw() because the ORM spelling (three correlated subqueries) costs more to build, per turn,
    than the query costs to run."""
    quote = connection.ops.quote_name
    brief_table, agent_table = quote(Brief._meta.db_table), quote(AgentState._meta.db_table)
    found = list(
        Brief.objects.raw(
            f"SELECT brief.*, agent.context_block AS agent_block, "
            f"agent.context_tokens AS agent_tokens, agent.chat_id IS NOT NULL AS agent_exists "
            f"FROM {brief_table} brief LEFT JOIN {agent_table} agent "
            f"ON agent.chat_id = brief.chat_id WHERE brief.chat_id = %s",
            [chat_id],
        )
    )
    if not found:
        raise Brief.DoesNotExist(f"chat {chat_id} has no brief")
    return found[0]


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
