"""Reads a chat's memory state from the database and turns it into the pure engine's input.

The brief and every message after its watermark must come from one snapshot, or from the brief
first and then the messages: a fold that commits in between only makes the snapshot include
messages that are already folded (an older summary plus extra verbatim messages), never a gap.
PostgreSQL reads both in one statement (one snapshot, one round trip); other databases read the
brief first, then the tail.
"""

from collections.abc import Mapping, Sequence
from dataclasses import dataclass, replace
from datetime import datetime
from typing import Any, NamedTuple

from django.conf import settings
from django.db import connection

from conversations import rows
from conversations.agent_rules import clip_to_tokens
from conversations.chat_model.tokens import count_tokens
from conversations.models import AgentState, Brief, Chat, Message, Pin
from memory_worker.engine.state import ROLE_OVERHEAD_TOKENS, ChatState, Msg
from memory_worker.pinned import pinned_block_tokens


class PinnedItem(NamedTuple):
    id: int
    seq: int | None  # the pinned message's, None for a pinned text
    text: str
    tokens: int


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
    # The last failure's error kind (empty after a model fold), and since when the summary is
    # the offline summarizer's fallback (None: the model's).
    failure_kind: str = ""
    fallback_since: datetime | None = None
    # The agent state as the model receives it (a system message after the prompt) and
    # its stored token count: part of the prompt, so part of the bound.
    agent_context: str = ""
    agent_context_tokens: int = 0
    has_agent_state: bool = False
    # The user's pins, oldest first: in every context, after the summary.
    pins: tuple[PinnedItem, ...] = ()
    # The summary's lines a person wrote (an edit): the fold guard keeps them like rules.
    user_lines: Sequence[str] = ()

    @property
    def last_seq(self) -> int:
        return self.unfolded[-1].seq if self.unfolded else self.last_consolidated

    @property
    def pinned_tokens(self) -> int:
        return pinned_block_tokens(pin.tokens for pin in self.pins)

    def pins_shown(self) -> tuple[PinnedItem, ...]:
        """The pins the pinned block shows: a pinned message still verbatim in the unfolded
        tail is already in the context once."""
        return tuple(
            pin for pin in self.pins if pin.seq is None or pin.seq <= self.last_consolidated
        )


UNFOLDED_FIELDS = ("id", "chat_id", "seq", "role", "content", "token_count", "metadata")


def load_snapshot(chat_id: int) -> MemorySnapshot:
    if connection.vendor == "postgresql":
        found = fetch_snapshot_values(snapshot_query("%s"), [chat_id])
        snapshot = snapshot_from_values(chat_id, found) if found is not None else None
        if snapshot is None:
            raise Brief.DoesNotExist(f"chat {chat_id} has no brief")
        return snapshot
    brief, agent = read_brief(chat_id)
    unfolded = read_unfolded(chat_id, brief.last_consolidated)
    return make_snapshot(chat_id, brief, agent, unfolded, read_pins(chat_id))


def read_pins(chat_id: int) -> tuple[PinnedItem, ...]:
    found = Pin.objects.filter(chat_id=chat_id).order_by("id")
    return tuple(PinnedItem(*row) for row in found.values_list("id", "seq", "text", "tokens"))


def make_snapshot(
    chat_id: int,
    brief: Brief,
    agent: Sequence[Any],
    unfolded: tuple[Message, ...],
    pins: tuple[PinnedItem, ...] = (),
) -> MemorySnapshot:
    """``agent``: the agent state's (context block, its tokens, whether the chat has one)."""
    agent_block, agent_tokens, agent_exists = agent
    agent_block, agent_tokens = within_agent_bound(agent_block or "", agent_tokens or 0)
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
        failure_kind=brief.failure_kind,
        fallback_since=brief.fallback_since,
        agent_context=agent_block or "",
        agent_context_tokens=agent_tokens or 0,
        has_agent_state=bool(agent_exists),
        pins=pins,
        user_lines=tuple(brief.user_lines or ()),
    )


# Plain SQL (conversations.rows) for the reads: they run on every turn and every fold, and the
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


def read_chat_and_snapshot(chat_id: int) -> tuple[Chat, MemorySnapshot] | None:
    """The chat and its memory snapshot (a fold's first reads), None if there is no such chat.
    PostgreSQL: one statement."""
    if connection.vendor != "postgresql":
        chat = read_chat(chat_id)
        return (chat, load_snapshot(chat_id)) if chat is not None else None
    found = fetch_chat_with_snapshot(
        f"{chat_with_snapshot_query(rows.quoted_table(Chat))} WHERE chat.id = %s", [chat_id]
    )
    if found is None:
        return None
    chat, snapshot = found
    if snapshot is None:
        raise Brief.DoesNotExist(f"chat {chat_id} has no brief")
    return chat, snapshot


def chat_with_snapshot_query(chats: str) -> str:
    """PostgreSQL: a SELECT of the chat rows of ``chats`` (a table, or a CTE's name), aliased
    ``chat``, each with its snapshot_query row alongside (fetch_chat_with_snapshot reads it).
    LEFT JOIN: a chat comes back even without a brief."""
    fields = rows.selected_fields(Chat)
    return (
        f"SELECT {rows.column_list(fields, 'chat')}, snapshot.* FROM {chats} chat "
        f"LEFT JOIN LATERAL ({snapshot_query('chat.id')}) snapshot ON true"
    )


def fetch_chat_with_snapshot(
    sql: str, params: Sequence[Any]
) -> tuple[Chat, MemorySnapshot | None] | None:
    """The first row of a chat_with_snapshot_query statement: the chat and its snapshot (None if
    it has no brief); None when there is no row."""
    found = rows.fetch_instances(Chat, rows.selected_fields(Chat), sql, params)
    if not found:
        return None
    chat, snapshot_values = found[0]
    return chat, snapshot_from_values(chat.pk, snapshot_values)


def read_brief(chat_id: int) -> tuple[Brief, tuple[Any, ...]]:
    """The brief, and the chat's agent state alongside as (context block, its tokens, whether the
    chat has one): one query."""
    fields = rows.selected_fields(Brief)
    found = rows.fetch_instances(Brief, fields, _brief_query("%s", ""), [chat_id])
    if not found:
        raise Brief.DoesNotExist(f"chat {chat_id} has no brief")
    return found[0]


def snapshot_query(chat_id_sql: str) -> str:
    """PostgreSQL: the brief, the agent state and the unfolded tail of the chat whose id is the
    SQL expression ``chat_id_sql``, in one row (see snapshot_from_values): one statement, so one
    snapshot and one round trip on every turn and fold. The tail comes as one JSON array of rows
    (rows.instances_from_json): decoding one JSON document costs less than converting each row's
    columns (docs/benchmarks.md)."""
    fields = rows.selected_fields(Message, UNFOLDED_FIELDS)
    tail = (
        f", (SELECT json_agg(json_build_array({rows.column_list(fields, 'm')}) ORDER BY m.seq) "
        f"FROM {rows.quoted_table(Message)} m "
        "WHERE m.chat_id = brief.chat_id AND m.seq > brief.last_consolidated) AS tail, "
        "(SELECT json_agg(json_build_array(p.id, p.seq, p.text, p.tokens) ORDER BY p.id) "
        f"FROM {rows.quoted_table(Pin)} p WHERE p.chat_id = brief.chat_id) AS pins"
    )
    return _brief_query(chat_id_sql, tail)


def _brief_query(chat_id_sql: str, more_columns: str) -> str:
    return (
        f"SELECT {rows.column_list(rows.selected_fields(Brief), 'brief')}, "
        "agent.context_block AS agent_block, agent.context_tokens AS agent_tokens, "
        f"agent.chat_id IS NOT NULL AS agent_exists{more_columns} "
        f"FROM {rows.quoted_table(Brief)} brief LEFT JOIN {rows.quoted_table(AgentState)} agent "
        f"ON agent.chat_id = brief.chat_id WHERE brief.chat_id = {chat_id_sql}"
    )


def fetch_snapshot_values(sql: str, params: Sequence[Any]) -> tuple[Any, ...] | None:
    with connection.cursor() as cursor:
        cursor.execute(sql, params)
        found = cursor.fetchone()
    return tuple(found) if found is not None else None


def within_agent_bound(block: str, tokens: int) -> tuple[str, int]:
    """The agent-state block as the context may carry it. New blocks are rendered within
    AGENT_CONTEXT_MAX_TOKENS; one stored before that bound (or under a higher one) is cut here,
    or every turn of its chat stays over the model's window: a 503 that stores nothing, so no
    agent-state run would ever come to render it again."""
    limit = settings.AGENT_CONTEXT_MAX_TOKENS
    if tokens <= limit:
        return block, tokens
    clipped = clip_to_tokens(block, limit, count_tokens)
    return clipped, count_tokens(clipped)


def snapshot_from_values(chat_id: int, values: Sequence[Any]) -> MemorySnapshot | None:
    """The snapshot of one snapshot_query row's values (as the database returned them); None
    when they are the NULLs of an outer join that found no brief."""
    brief_fields = rows.selected_fields(Brief)
    width = len(brief_fields)
    if values[brief_fields.index(Brief._meta.pk)] is None:  # type: ignore[arg-type]
        return None
    brief = rows.build_instance(Brief, brief_fields, values[:width])
    message_fields = rows.selected_fields(Message, UNFOLDED_FIELDS)
    unfolded = rows.instances_from_json(Message, message_fields, values[width + 3] or ())
    pins = tuple(PinnedItem(*pin) for pin in values[width + 4] or ())
    return make_snapshot(chat_id, brief, values[width : width + 3], tuple(unfolded), pins)


def with_appended(snapshot: MemorySnapshot, messages: list[Message]) -> MemorySnapshot:
    """The snapshot after a turn stored ``messages`` (no re-read needed)."""
    return MemorySnapshot(**{**snapshot.__dict__, "unfolded": snapshot.unfolded + tuple(messages)})


# What a fold's commit may set on the brief that the snapshot also holds (a fallback's leaves
# the failure state as it is).
FOLD_SNAPSHOT_FIELDS = (
    "summary",
    "summary_tokens",
    "last_consolidated",
    "turns_mark",
    "last_consolidated_at",
    "next_attempt_at",
    "failure_kind",
    "fallback_since",
    "user_lines",
)


def after_fold(snapshot: MemorySnapshot, brief_values: Mapping[str, Any]) -> MemorySnapshot:
    """The snapshot after a fold committed ``brief_values`` (the brief's new values) over it: the
    same messages read, those up to the new watermark folded (no re-read needed)."""
    watermark = brief_values["last_consolidated"]
    return replace(
        snapshot,
        **{name: brief_values[name] for name in FOLD_SNAPSHOT_FIELDS if name in brief_values},
        version=snapshot.version + 1,
        unfolded=tuple(m for m in snapshot.unfolded if m.seq > watermark),
    )


def engine_state(chat: Chat, snapshot: MemorySnapshot, context_tokens: int) -> ChatState:
    return ChatState(
        last_consolidated=snapshot.last_consolidated,
        last_seq=snapshot.last_seq,
        unfolded=tuple(Msg(m.seq, m.role, m.token_count) for m in snapshot.unfolded),
        summary_tokens=snapshot.summary_tokens,
        system_tokens=chat.system_prompt_tokens + agent_context_tokens(chat, snapshot),
        turns_mark=snapshot.turns_mark,
        # The cooldown counts from the last fold; before the first one, from the chat's
        # creation (otherwise any new chat past its tail would fold at once).
        last_consolidated_at=snapshot.last_consolidated_at or chat.created_at,  # type: ignore[arg-type]
        model_context_tokens=context_tokens,
        pinned_tokens=snapshot.pinned_tokens,
    )


def agent_context_tokens(chat: Chat, snapshot: MemorySnapshot) -> int:
    """The agent-state message counted with the system prompt: its tokens, plus the role
    overhead of a second system message when the prompt already has one (the engine adds one
    overhead for the system part)."""
    if not snapshot.agent_context:
        return 0
    overhead = ROLE_OVERHEAD_TOKENS if chat.system_prompt_tokens else 0
    return snapshot.agent_context_tokens + overhead
