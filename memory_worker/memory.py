"""Memory as the web app sees it: ``conversations``' one door into ``memory_worker``.

``conversations`` imports from ``memory_worker`` only this module and the pure engine (policy,
engine_state, presets, turn_groups, isolation_policy), but for the plain model calls named at
the end; ``lint-imports`` fails the build on any other import (pyproject.toml,
``[tool.importlinter]``; docs/design.md, the map). Everything here is re-exported from the
module that implements it (in parentheses below), which says how it works; two names say whose
they are: agent_state_limits (agent_summaries.limits) and use_agent_model (agent_turns.use_model).

A turn's snapshot (memory_worker.state)
    MemorySnapshot, PinnedItem; load_snapshot, engine_state, with_appended,
    chat_with_snapshot_query, fetch_chat_with_snapshot
The fold before a turn's model call
    fold_before_turn (turn_fold), FoldResult (outcomes), time_for_a_chunk and
    turn_fold_deadline (deadlines)
After a turn commits: the fold and the agent state's summary queued
    decide_for_chat (folds), request_consolidation (runs), RequestTrigger (dispatch);
    request_agent_summary, agent_state_limits, TURN_DIGEST (agent_summaries);
    use_agent_model (agent_turns: the chat model the agent state's summaries ask)
A manual fold
    ManualRequest, request_manual_fold (manual_folds); lag_ms (fold_ledger)
A person's edit of the summary
    edit_summary, EditRefused, OverCap, VersionMoved (summary_edit)
Pins
    pinned_block, pinned_block_tokens, pinned_message_text, pin_room (pinned)
The effective policy
    effective_policy, policy_for_chat, policy_for_new_settings, chat_tokens,
    variant_context_tokens (chat_policy)
The request path's Redis and the chat's lock
    breaker_open, trip_if_timeout (request_redis); redis_client, request_chat_lock (runtime)
Shared with the summarizers: token counts, the OpenAI client, a setting's range
    count_tokens, tokenizer_problems (tokens); make_openai_client, token_limit_field,
    LIMIT_KEYS (openai_transport); out_of_range (checks)

The web app's model calls (conversations.llm, model_http, openai_chat_model,
offline_chat_model) are plain Python, loaded before Django's apps (the logging configuration
imports conversations.metrics, which imports conversations.llm), so they cannot come through
this door, which loads the models: they import the plain modules they share with the
summarizers (tokens, text, openai_transport, offline_summarizer) directly, the only exceptions
the import contract names.
"""

from memory_worker.agent_summaries import TURN_DIGEST, request_agent_summary
from memory_worker.agent_summaries import limits as agent_state_limits
from memory_worker.agent_turns import use_model as use_agent_model
from memory_worker.chat_policy import (
    chat_tokens,
    effective_policy,
    policy_for_chat,
    policy_for_new_settings,
    variant_context_tokens,
)
from memory_worker.checks import out_of_range
from memory_worker.deadlines import time_for_a_chunk, turn_fold_deadline
from memory_worker.dispatch import RequestTrigger
from memory_worker.fold_ledger import lag_ms
from memory_worker.folds import decide_for_chat
from memory_worker.manual_folds import ManualRequest, request_manual_fold
from memory_worker.openai_transport import LIMIT_KEYS, make_openai_client, token_limit_field
from memory_worker.outcomes import FoldResult
from memory_worker.pinned import pin_room, pinned_block, pinned_block_tokens, pinned_message_text
from memory_worker.request_redis import breaker_open, trip_if_timeout
from memory_worker.runs import request_consolidation
from memory_worker.runtime import redis_client, request_chat_lock
from memory_worker.state import (
    MemorySnapshot,
    PinnedItem,
    chat_with_snapshot_query,
    engine_state,
    fetch_chat_with_snapshot,
    load_snapshot,
    with_appended,
)
from memory_worker.summary_edit import EditRefused, OverCap, VersionMoved, edit_summary
from memory_worker.tokens import count_tokens, tokenizer_problems
from memory_worker.turn_fold import fold_before_turn

__all__ = [
    "LIMIT_KEYS",
    "TURN_DIGEST",
    "EditRefused",
    "FoldResult",
    "ManualRequest",
    "MemorySnapshot",
    "OverCap",
    "PinnedItem",
    "RequestTrigger",
    "VersionMoved",
    "agent_state_limits",
    "breaker_open",
    "chat_tokens",
    "chat_with_snapshot_query",
    "count_tokens",
    "decide_for_chat",
    "edit_summary",
    "effective_policy",
    "engine_state",
    "fetch_chat_with_snapshot",
    "fold_before_turn",
    "lag_ms",
    "load_snapshot",
    "make_openai_client",
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
    "request_consolidation",
    "request_manual_fold",
    "time_for_a_chunk",
    "token_limit_field",
    "tokenizer_problems",
    "trip_if_timeout",
    "turn_fold_deadline",
    "use_agent_model",
    "variant_context_tokens",
    "with_appended",
]
