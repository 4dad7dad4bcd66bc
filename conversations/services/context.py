"""The exact message list the model receives, laid out for a provider's prefix
cache: what changes least comes first. The system prompt, the user's pins (a system message:
memory_worker.pinned), the summary as a system message when non-empty, every unfolded message
verbatim in order, then the new messages. The agent state (docs/agent-state.md: session theme,
active entities, pending clarification), which may change every turn, goes as a system message just
before the turn's user message, so between two folds each prompt starts with the whole of the
one before it but its last turn."""

from collections.abc import Sequence
from typing import Any

from conversations.models import Chat, Message, Role
from memory_worker.memory import MemorySnapshot, pinned_block

SUMMARY_HEADER = "Summary of the earlier conversation (memory):\n\n"


def model_message(message: Message) -> dict[str, object]:
    entry: dict[str, object] = {"role": message.role, "content": message.content}
    # Tool traffic must reach the model in the shape it was produced in.
    for key in ("tool_calls", "tool_call_id", "name"):
        if key in message.metadata:
            entry[key] = message.metadata[key]
    return entry


def build_model_messages(
    chat: Chat, snapshot: MemorySnapshot, new_messages: Sequence[dict[str, object]] = ()
) -> list[dict[str, object]]:
    """The context built from the chat's memory ``snapshot``, ending with ``new_messages`` (the
    new user message, or tool results continuing the newest turn)."""
    messages: list[dict[str, object]] = []
    if chat.system_prompt:
        messages.append({"role": Role.SYSTEM.value, "content": chat.system_prompt})
    pinned = pinned_block(pin.text for pin in snapshot.pins_shown())
    if (
        pinned
    ):  # counted in the bound by memory_worker.folding.snapshot (MemorySnapshot.pinned_tokens)
        messages.append({"role": Role.SYSTEM.value, "content": pinned})
    if snapshot.summary:
        messages.append({"role": Role.SYSTEM.value, "content": SUMMARY_HEADER + snapshot.summary})
    first_verbatim = len(messages)
    messages.extend(model_message(message) for message in snapshot.unfolded)
    first_new = len(messages)
    messages.extend(new_messages)
    if (
        snapshot.agent_context
    ):  # counted in the bound by memory_worker.folding.snapshot.agent_context_tokens
        agent: dict[str, object] = {"role": Role.SYSTEM.value, "content": snapshot.agent_context}
        messages.insert(agent_state_index(messages, first_verbatim, first_new), agent)
    return without_unanswered_tool_calls(messages)


def agent_state_index(
    messages: list[dict[str, object]], first_verbatim: int, first_new: int
) -> int:
    """Where the agent state goes: as late as the turn's tool traffic allows, since everything
    after it misses the cache. Before the new user message; at the end when nothing new follows
    a finished turn (the context a client inspects). Between a call and its results it would
    break the pair (and a call with nothing after it reads as unanswered), so when tool results
    continue the newest turn, or nothing new follows a call, it goes before that turn's user
    message, or before the verbatim messages when that one is folded."""
    if first_new < len(messages) and messages[first_new].get("role") == Role.USER.value:
        return first_new
    if first_new == len(messages) and not (messages and messages[-1].get("tool_calls")):
        return first_new
    users = [
        index
        for index in range(first_verbatim, first_new)
        if messages[index].get("role") == Role.USER.value
    ]
    return users[-1] if users else first_verbatim


# What an assistant message whose calls all went unanswered says instead, when it said nothing.
UNANSWERED_CALLS_NOTE = "(Called tools; no results came back.)"


def without_unanswered_tool_calls(messages: list[dict[str, object]]) -> list[dict[str, object]]:
    """The messages with every tool call that no tool message right after it answers taken out
    of its assistant message (a client that sent its next user message instead of the results).
    OpenAI-compatible servers refuse a context with an unanswered call, so the chat would fail
    every turn until the call is folded. The stored message keeps its calls; taking them out
    here only makes the context smaller than its counted bound. The last message is left as it
    is: nothing has followed it yet."""
    repaired = list(messages)
    for index, message in enumerate(messages[:-1]):
        calls = message.get("tool_calls")
        if message.get("role") != Role.ASSISTANT.value or not isinstance(calls, list):
            continue
        answered = _answered_ids(messages[index + 1 :])
        kept = [call for call in calls if isinstance(call, dict) and call.get("id") in answered]
        if len(kept) < len(calls):
            repaired[index] = _with_calls(message, kept)
    return repaired


def _answered_ids(following: list[dict[str, object]]) -> set[object]:
    answered = set()
    for message in following:
        if message.get("role") != Role.TOOL.value:
            break
        answered.add(message.get("tool_call_id"))
    return answered


def _with_calls(message: dict[str, object], calls: list[dict[str, Any]]) -> dict[str, object]:
    entry = {key: value for key, value in message.items() if key != "tool_calls"}
    if calls:
        entry["tool_calls"] = calls
    elif not str(entry.get("content") or "").strip():
        entry["content"] = UNANSWERED_CALLS_NOTE
    return entry
