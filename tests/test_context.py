"""The context the model receives, laid out for a provider's prefix cache: the system prompt,
pins and summary first, the verbatim messages in order, and what changes every turn (the agent
state) just before the turn's user message, never above the summary; a tool result still follows
the call it answers."""

from __future__ import annotations

import dataclasses
import itertools
from typing import Any

import pytest

from conversations.models import Brief, Chat, Message
from conversations.services.context import SUMMARY_HEADER, build_model_messages
from memory_worker.folding.snapshot import load_snapshot
from tests.test_agent_state import agent_turn, new_chat

pytestmark = pytest.mark.django_db


def test_between_folds_each_prompt_starts_with_the_whole_previous_one_but_its_last_turn(  # type: ignore[no-untyped-def]
    api, use_fake_openai, settings
) -> None:
    """Three turns whose agent state changes every turn, on a chat with a system prompt, a pin
    and a summary, no fold between them: each model request repeats the previous one token for
    token up to its agent state, so a prefix cache misses only the newest turn. Anything
    volatile placed above the summary (or between verbatim messages) fails this."""
    settings.AGENT_SUMMARY_BACKEND = "offline"
    chat_id = new_chat(api, system_prompt="Be brief.")
    assert (
        api.post(
            f"/api/v1/chats/{chat_id}/pins/", {"text": "Euros only."}, format="json"
        ).status_code
        == 201
    )
    Brief.objects.filter(chat_id=chat_id).update(summary="## Facts / Constraints\n- Cello.")
    for number in range(3):
        agent_turn(
            api,
            chat_id,
            f"plan {number}",
            {"decision": "clarify", "goal": f"goal {number}", "clarification_questions": ["?"]},
        )
    prompts = [r.body["messages"] for r in use_fake_openai.chat_requests()]
    assert len(prompts) == 3
    for earlier, later in itertools.pairwise(prompts):
        stable = earlier[:-1]
        if earlier[-2]["content"].startswith("Agent state"):
            stable = earlier[:-2]
        assert later[: len(stable)] == stable
    last = prompts[-1]
    assert [m["content"] for m in last[:2]] == ["Be brief.", last[1]["content"]]
    assert "Euros only." in last[1]["content"]
    assert last[2]["content"].startswith(SUMMARY_HEADER)
    assert last[-2]["content"].startswith("Agent state") and last[-1]["role"] == "user"


CALL: Any = {"id": "c1", "type": "function", "function": {"name": "f", "arguments": "{}"}}
CALLING: dict[str, Any] = {"role": "assistant", "content": "", "metadata": {"tool_calls": [CALL]}}
RESULT: dict[str, object] = {"role": "tool", "tool_call_id": "c1", "content": "42"}
AGENT_STATE = "Agent state: x"


def store(chat_id: int, *messages: dict[str, Any]) -> Chat:
    """``messages`` stored after the chat's last (role, content, metadata each); the chat as it
    is then."""
    last = Chat.objects.get(pk=chat_id).last_seq
    Message.objects.bulk_create(
        Message(chat_id=chat_id, seq=last + n, token_count=5, **message)
        for n, message in enumerate(messages, 1)
    )
    Chat.objects.filter(pk=chat_id).update(last_seq=last + len(messages))
    return Chat.objects.get(pk=chat_id)


def with_agent_state(chat_id: int, **changes: Any) -> Any:
    return dataclasses.replace(load_snapshot(chat_id), agent_context=AGENT_STATE, **changes)


def test_a_tool_result_follows_its_call_with_the_agent_state_before_the_turns_user_message(  # type: ignore[no-untyped-def]
    api,
) -> None:
    chat_id = new_chat(api)
    chat = store(chat_id, {"role": "user", "content": "look it up"}, CALLING)
    messages = build_model_messages(chat, with_agent_state(chat_id), [RESULT])
    roles = [m["role"] for m in messages]
    assert roles[-4:] == ["system", "user", "assistant", "tool"]
    assert messages[-4]["content"] == AGENT_STATE and messages[-2]["tool_calls"] == [CALL]
    # With nothing new after the call, as the context endpoint shows it: the same place, and
    # the call is not taken for unanswered.
    shown = build_model_messages(chat, with_agent_state(chat_id))
    assert [m["role"] for m in shown][-3:] == ["system", "user", "assistant"]
    assert shown[-3]["content"] == AGENT_STATE and shown[-1]["tool_calls"] == [CALL]
    # After a finished turn, nothing new: the agent state last.
    finished = [*messages[:-4], *messages[-3:], {"role": "assistant", "content": "It is 42."}]
    chat = store(
        chat_id,
        {"role": "tool", "content": "42", "metadata": {"tool_call_id": "c1"}},
        {"role": "assistant", "content": "It is 42."},
    )
    shown = build_model_messages(chat, with_agent_state(chat_id))
    assert shown[:-1] == finished and shown[-1]["content"] == AGENT_STATE


def test_with_the_turns_user_message_folded_the_agent_state_stays_off_the_tool_pair(  # type: ignore[no-untyped-def]
    api,
) -> None:
    """The newest turn's user message already folded, its call verbatim and its results new:
    the agent state goes before the verbatim messages, not between the call and its results."""
    chat_id = new_chat(api)
    chat = store(chat_id, CALLING)
    snapshot = with_agent_state(chat_id, summary="- Asked to look it up.")
    messages = build_model_messages(chat, snapshot, [RESULT])
    assert [m["role"] for m in messages][-4:] == ["system", "system", "assistant", "tool"]
    assert messages[-3]["content"] == AGENT_STATE
    assert str(messages[-4]["content"]).startswith(SUMMARY_HEADER)
    assert messages[-2]["tool_calls"] == [CALL]
