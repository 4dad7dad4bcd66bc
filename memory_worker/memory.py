"""Memory as the web app sees it: ``conversations``' one door into ``memory_worker``.

``conversations`` imports from ``memory_worker`` only this module and the pure engine
(``memory_worker.engine``); ``lint-imports`` fails the build on any other import
(pyproject.toml, ``[tool.importlinter]``; docs/design.md, the map). The model client both apps
call through (token counts, the transport, the chat model) is ``conversations.chat_model``, below
either. Everything here is re-exported from the module that implements it (in parentheses), which
says how it works; two names say whose they are: agent_state_limits (agents.summaries.limits) and
use_agent_model (agents.turns.use_model).

A turn's snapshot (folding.snapshot)
    MemorySnapshot, PinnedItem; load_snapshot, engine_state, with_appended,
    chat_with_snapshot_query, fetch_chat_with_snapshot
The fold before a turn's model call
    fold_before_turn (scheduling.before_turn), FoldStatus (folding.outcomes), time_for_a_chunk
    and turn_fold_deadline (coordination.deadlines)
After a turn commits: the fold and the agent state's summary queued
    decide_for_chat (folding.execute), request_fold (scheduling.runs), RequestReason
    (coordination.dispatch); request_agent_summary, agent_state_limits, TURN_DIGEST
    (agents.summaries); use_agent_model (agents.turns: the chat model the agent state's
    summaries ask)
A manual fold
    ManualRequest, request_manual_fold (scheduling.manual); lag_ms (folding.ledger)
A person's edit of the summary
    edit_summary, EditRefused, OverCap, VersionMoved (folding.summary_edit)
Pins
    pinned_block, pinned_block_tokens, pinned_message_text, pin_room (pinned)
The effective policy
    effective_policy, policy_for_chat, policy_for_new_settings, chat_tokens,
    variant_context_tokens (folding.effective_policy)
The request path's Redis and the chat's lock
    breaker_open, trip_if_timeout (coordination.request_redis); redis_client,
    request_chat_lock (coordination.runtime)
A setting's range, as the summarizers' settings are checked
    out_of_range (checks)"""

from memory_worker.agents.summaries import TURN_DIGEST, request_agent_summary
from memory_worker.agents.summaries import limits as agent_state_limits
from memory_worker.agents.turns import use_model as use_agent_model
from memory_worker.checks import out_of_range
from memory_worker.coordination.deadlines import time_for_a_chunk, turn_fold_deadline
from memory_worker.coordination.dispatch import RequestReason
from memory_worker.coordination.request_redis import breaker_open, trip_if_timeout
from memory_worker.coordination.runtime import redis_client, request_chat_lock
from memory_worker.folding.effective_policy import (
    chat_tokens,
    effective_policy,
    policy_for_chat,
    policy_for_new_settings,
    variant_context_tokens,
)
from memory_worker.folding.execute import decide_for_chat
from memory_worker.folding.ledger import lag_ms
from memory_worker.folding.outcomes import FoldStatus
from memory_worker.folding.snapshot import (
    MemorySnapshot,
    PinnedItem,
    chat_with_snapshot_query,
    engine_state,
    fetch_chat_with_snapshot,
    load_snapshot,
    with_appended,
)
from memory_worker.folding.summary_edit import EditRefused, OverCap, VersionMoved, edit_summary
from memory_worker.pinned import pin_room, pinned_block, pinned_block_tokens, pinned_message_text
from memory_worker.scheduling.before_turn import fold_before_turn
from memory_worker.scheduling.manual import ManualRequest, request_manual_fold
from memory_worker.scheduling.runs import request_fold

__all__ = [
    "TURN_DIGEST",
    "EditRefused",
    "FoldStatus",
    "ManualRequest",
    "MemorySnapshot",
    "OverCap",
    "PinnedItem",
    "RequestReason",
    "VersionMoved",
    "agent_state_limits",
    "breaker_open",
    "chat_tokens",
    "chat_with_snapshot_query",
    "decide_for_chat",
    "edit_summary",
    "effective_policy",
    "engine_state",
    "fetch_chat_with_snapshot",
    "fold_before_turn",
    "lag_ms",
    "load_snapshot",
    "out_of_range",
    "pin_room",
    "pinned_block",
    "pinned_block_tokens",
    "pinned_message_text",
    "policy_for_chat",
    "policy_for_new_settings",
    "redis_client",
    "request_agent_summary",
    "request_chat_lock",
    "request_fold",
    "request_manual_fold",
    "time_for_a_chunk",
    "trip_if_timeout",
    "turn_fold_deadline",
    "use_agent_model",
    "variant_context_tokens",
    "with_appended",
]
