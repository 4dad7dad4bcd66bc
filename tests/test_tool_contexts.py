"""Tool calls in the context the model receives: every tool message follows the assistant call it
answers, whatever memory folded before it, and no assistant call goes unanswered. OpenAI-compatible
servers refuse a context that breaks either rule, so a chat that sent one failed every turn."""

from typing import Any

import pytest
from rest_framework.test import APIClient

from conversations.chat_model.contract import ChatCompletion
from conversations.models import Brief, Chat
from conversations.services import exchanges
from memory_worker.engine.state import ROLE_OVERHEAD_TOKENS
from tests.test_bad_input import bearer

pytestmark = pytest.mark.django_db

TOOLS = [{"type": "function", "function": {"name": "lookup", "parameters": {"type": "object"}}}]


class ToolCallingModel:
    """Answers every request with one call of ``lookup``, and records what it was sent."""

    def __init__(self) -> None:
        self.contexts: list[list[dict[str, Any]]] = []

    def complete(self, messages: Any, model: str, tools: Any = None) -> ChatCompletion:
        self.contexts.append([dict(message) for message in messages])
        call = {
            "id": f"call_{len(self.contexts)}",
            "type": "function",
            "function": {"name": "lookup", "arguments": "{}"},
        }
        return ChatCompletion("", "tool_calls", 10, 5, model, (call,))


def tool_rules_broken(context: list[dict[str, Any]]) -> list[str]:
    """What an OpenAI-compatible server would refuse in ``context``."""
    broken: list[str] = []
    waiting: set[str] = set()
    for message in context:
        if message["role"] == "tool":
            if message.get("tool_call_id") not in waiting:
                broken.append(f"tool result {message.get('tool_call_id')} follows no call")
            waiting.discard(message.get("tool_call_id"))
            continue
        if waiting:
            broken.append(f"calls {sorted(waiting)} unanswered before a {message['role']}")
        waiting = {call["id"] for call in message.get("tool_calls") or ()}
    return broken


@pytest.fixture
def model(monkeypatch: Any, settings: Any) -> ToolCallingModel:
    settings.MEMORY_POLICY = "contract"  # at most 10 messages in the context
    calling = ToolCallingModel()
    monkeypatch.setattr(exchanges, "get_chat_model", lambda: calling)
    return calling


def exchange(client: APIClient, messages: list[dict[str, Any]]) -> Any:
    body = {"model": "default", "user": "agent", "messages": messages, "tools": TOOLS}
    return client.post("/v1/chat/completions", body, format="json")


def test_a_long_tool_loop_never_reaches_the_model_split(user: Any, model: ToolCallingModel) -> None:
    """Each tool result continues the same turn. Once that turn alone outgrows the contract
    preset's 10 messages, a fold before it would have to split it (the call folded, its result
    sent): the exchange is refused with a 503 instead, and nothing is folded or stored."""
    client = bearer(user)
    for number in range(4):  # plain history first: the folds have something to take
        messages = [{"role": "user", "content": f"fact {number}"}]
        assert exchange(client, messages).status_code == 200
        messages = [{"role": "tool", "tool_call_id": f"call_{len(model.contexts)}", "content": "x"}]
        assert exchange(client, messages).status_code == 200
    refused = None
    for _round in range(12):
        result = {"role": "tool", "tool_call_id": f"call_{len(model.contexts)}", "content": "42"}
        response = exchange(client, [result])
        if response.status_code != 200:
            refused = response
            break
    for context in model.contexts:
        assert tool_rules_broken(context) == [], context
    assert refused is not None and refused.status_code == 503, "the loop outgrew no bound"
    assert "tool results" in refused.json()["error"]["message"]
    chat = Chat.objects.get(external_id="agent")
    newest_user = chat.messages.filter(role="user").order_by("-seq").first()
    assert newest_user is not None
    assert Brief.objects.get(chat=chat).last_consolidated < newest_user.seq


def test_a_call_answered_by_a_user_message_is_left_out_of_the_next_context(
    api: APIClient, user: Any, model: ToolCallingModel, monkeypatch: Any
) -> None:
    """The client sent its next user message instead of the call's result: the stored call
    stays stored, but the model is not sent a call with no result after it."""
    from conversations.services import turn_model

    assert exchange(bearer(user), [{"role": "user", "content": "look it up"}]).status_code == 200
    monkeypatch.setattr(turn_model, "get_chat_model", lambda: model)
    chat_id = Chat.objects.get(external_id="agent").pk
    response = api.post(f"/api/v1/chats/{chat_id}/turns/", {"content": "never mind"}, format="json")
    assert response.status_code == 201, response.content
    sent = model.contexts[-1]
    assert tool_rules_broken(sent) == []
    assistant = next(m for m in sent if m["role"] == "assistant")
    assert assistant["content"] and "tool_calls" not in assistant
    assert Chat.objects.get(pk=chat_id).messages.get(seq=2).metadata["tool_calls"]
    context = api.get(f"/api/v1/chats/{chat_id}/context/").json()["messages"]
    assert tool_rules_broken(context) == []


def test_a_tool_results_tokens_count_its_call_id(user: Any, model: ToolCallingModel) -> None:
    """The id reaches the model with the result; counted with the content only, a long tool
    loop's context passed its policy's token bound by ten or so tokens a result."""
    from conversations.chat_model.tokens import count_tokens
    from conversations.models import Message

    client = bearer(user)
    assert exchange(client, [{"role": "user", "content": "look it up"}]).status_code == 200
    result = {"role": "tool", "tool_call_id": "call_1", "content": "42"}
    assert exchange(client, [result]).status_code == 200
    stored = Message.objects.get(chat__external_id="agent", role="tool")
    assert stored.token_count == count_tokens("42") + count_tokens("call_1")


def test_several_new_messages_each_bring_their_role_overhead() -> None:
    assert exchanges.new_messages_tokens([7]) == 7
    assert exchanges.new_messages_tokens([7, 5, 3]) == 15 + 2 * ROLE_OVERHEAD_TOKENS
