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
from memory_worker.state import load_snapshot
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


def test_a_tool_result_follows_its_call_with_the_agent_state_before_the_turns_user_message(  # type: ignore[no-untyped-def]
    api,
) -> None:
    chat_id = new_chat(api)
    call: Any = {"id": "c1", "type": "function", "function": {"name": "f", "arguments": "{}"}}
    Message.objects.bulk_create(
        [
            Message(chat_id=chat_id, seq=1, role="user", content="look it up", token_count=3),
            Message(
                chat_id=chat_id,
                seq=2,
                role="assistant",
                content="",
                token_count=9,
                metadata={"tool_calls": [call]},
            ),
        ]
    )
    Chat.objects.filter(pk=chat_id).update(last_seq=2)
    chat = Chat.objects.get(pk=chat_id)
    snapshot = dataclasses.replace(load_snapshot(chat_id), agent_context="Agent state: x")
    result: dict[str, object] = {"role": "tool", "tool_call_id": "c1", "content": "42"}
    messages = build_model_messages(chat, snapshot, [result])
    roles = [m["role"] for m in messages]
    assert roles[-4:] == ["system", "user", "assistant", "tool"]
    assert messages[-4]["content"] == "Agent state: x" and messages[-2]["tool_calls"] == [call]
    # With nothing new after the call, as the context endpoint shows it: the same place, and
    # the call is not taken for unanswered.
    shown = build_model_messages(chat, snapshot)
    assert [m["role"] for m in shown][-3:] == ["system", "user", "assistant"]
    assert shown[-3]["content"] == "Agent state: x" and shown[-1]["tool_calls"] == [call]
    # After a finished turn, nothing new: the agent state last.
    finished = [*messages[:-4], *messages[-3:], {"role": "assistant", "content": "It is 42."}]
    Message.objects.create(
        chat_id=chat_id,
        seq=3,
        role="tool",
        content="42",
        token_count=2,
        metadata={"tool_call_id": "c1"},
    )
    Message.objects.create(
        chat_id=chat_id, seq=4, role="assistant", content="It is 42.", token_count=4
    )
    Chat.objects.filter(pk=chat_id).update(last_seq=4)
    snapshot = dataclasses.replace(load_snapshot(chat_id), agent_context="Agent state: x")
    shown = build_model_messages(chat, snapshot)
    assert shown[:-1] == finished and shown[-1]["content"] == "Agent state: x"


def test_with_the_turns_user_message_folded_the_agent_state_stays_off_the_tool_pair(  # type: ignore[no-untyped-def]
    api,
) -> None:
    """The newest turn's user message already folded, its call verbatim and its results new:
    the agent state goes before the verbatim messages, not between the call and its results."""
    chat_id = new_chat(api)
    call: Any = {"id": "c1", "type": "function", "function": {"name": "f", "arguments": "{}"}}
    Message.objects.create(
        chat_id=chat_id,
        seq=1,
        role="assistant",
        content="",
        token_count=9,
        metadata={"tool_calls": [call]},
    )
    Chat.objects.filter(pk=chat_id).update(last_seq=1)
    chat = Chat.objects.get(pk=chat_id)
    snapshot = dataclasses.replace(
        load_snapshot(chat_id), summary="- Asked to look it up.", agent_context="Agent state: x"
    )
    result: dict[str, object] = {"role": "tool", "tool_call_id": "c1", "content": "42"}
    messages = build_model_messages(chat, snapshot, [result])
    assert [m["role"] for m in messages][-4:] == ["system", "system", "assistant", "tool"]
    assert messages[-3]["content"] == "Agent state: x"
    assert str(messages[-4]["content"]).startswith(SUMMARY_HEADER)
    assert messages[-2]["tool_calls"] == [call]
