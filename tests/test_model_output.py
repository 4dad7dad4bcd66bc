"""A model's reply as the turn stores it, through the API on PostgreSQL against a scripted model
server: characters PostgreSQL cannot store (a NUL, an unpaired surrogate) are replaced, not
turned into a 500 or a stream that stops without its last event; a reply the content filter
stopped is a failed turn that stores nothing; a reply over CHATMEM_MAX_MESSAGE_CHARS is cut there
and marked (finish_reason "length", metadata capped_at_chars), on REST and /v1, streamed or not."""

import json
from typing import Any

import pytest
from rest_framework.test import APIClient

from conversations.models import Message
from tests.test_bad_input import bearer
from tests.test_llm import chunk
from tests.test_summarizers import (
    API_KEY,
    Reply,
    ScriptedServer,
    chat_reply,
    server_fixture,  # noqa: F401  (the "server" fixture)
)

pytestmark = pytest.mark.usefixtures("require_postgres")

REPLACED = "\ufffd"


@pytest.fixture
def model(settings: Any, server: ScriptedServer) -> ScriptedServer:
    settings.OPENAI_BASE_URL = server.base_url
    settings.OPENAI_API_KEY = API_KEY
    settings.CHAT_BACKEND = "openai"
    settings.CHAT_MODEL = "gpt-test"
    settings.LLM_TIMEOUT_SECONDS = 5.0
    return server


def new_chat(api: APIClient) -> int:
    return int(api.post("/api/v1/chats/", {}, format="json").json()["id"])


def post_turn(api: APIClient, chat_id: int, **body: Any) -> Any:
    return api.post(f"/api/v1/chats/{chat_id}/turns/", {"content": "hi", **body}, format="json")


def sse_events(response: Any) -> list[tuple[str, Any]]:
    text = b"".join(response.streaming_content).decode()
    events = []
    for block in text.split("\n\n"):
        lines = dict(line.split(": ", 1) for line in block.splitlines() if ": " in line)
        if "event" in lines:
            events.append((lines["event"], json.loads(lines["data"])))
    return events


def stored_replies(chat_id: int) -> list[str]:
    return list(
        Message.objects.filter(chat_id=chat_id, role="assistant").values_list("content", flat=True)
    )


@pytest.mark.parametrize("bad", ["\x00", "\ud800"], ids=["nul", "lone-surrogate"])
def test_a_json_turn_stores_a_reply_with_unstorable_characters_replaced(
    api: APIClient, model: ScriptedServer, bad: str
) -> None:
    model.script(chat_reply(f"one{bad}two"))
    chat_id = new_chat(api)
    response = post_turn(api, chat_id)
    assert response.status_code == 201, response.content
    assert response.json()["assistant_message"]["content"] == f"one{REPLACED}two"
    assert stored_replies(chat_id) == [f"one{REPLACED}two"]


@pytest.mark.parametrize("bad", ["\x00", "\ud800"], ids=["nul", "lone-surrogate"])
def test_a_streamed_turn_sends_and_stores_the_same_replaced_text(
    api: APIClient, model: ScriptedServer, bad: str
) -> None:
    events: list[dict[str, Any] | float] = [
        chunk("one"),
        chunk(f"{bad}two"),
        chunk(finish_reason="stop"),
    ]
    model.script(Reply(events=events))
    chat_id = new_chat(api)
    response = post_turn(api, chat_id, stream=True)
    assert response.status_code == 200
    received = sse_events(response)
    assert received[-1][0] == "done", received
    deltas = "".join(data["content"] for name, data in received if name == "delta")
    assert deltas == f"one{REPLACED}two"
    assert stored_replies(chat_id) == [deltas]


def test_tool_call_arguments_with_a_nul_are_stored(api: APIClient, model: ScriptedServer) -> None:
    reply = chat_reply(None, finish_reason="tool_calls")
    call = {"id": "call_1", "type": "function", "function": {"name": "f", "arguments": "{\x00}"}}
    reply.body["choices"][0]["message"]["tool_calls"] = [call]  # type: ignore[index]
    model.script(reply)
    chat_id = new_chat(api)
    assert post_turn(api, chat_id).status_code == 201
    stored = Message.objects.get(chat_id=chat_id, role="assistant")
    assert stored.metadata["tool_calls"][0]["function"]["arguments"] == "{" + REPLACED + "}"


def test_a_reply_the_content_filter_stopped_is_a_502_that_stores_nothing(
    api: APIClient, model: ScriptedServer
) -> None:
    model.script(chat_reply("The first half of an answ", finish_reason="content_filter"))
    chat_id = new_chat(api)
    response = post_turn(api, chat_id)
    assert response.status_code == 502, response.content
    assert "content filter" in response.json()["detail"]
    assert not Message.objects.filter(chat_id=chat_id).exists()


# --- a reply over the message cap: cut there and marked ------------------------------------------

CAP = 10
LONG = "0123456789abcdefghij"  # twice the cap


def streamed_long_reply() -> Reply:
    return Reply(
        events=[chunk(LONG[:4]), chunk(LONG[4:13]), chunk(LONG[13:]), chunk(finish_reason="stop")]
    )


def assert_capped(chat_id: int) -> None:
    stored = Message.objects.get(chat_id=chat_id, role="assistant")
    assert stored.content == LONG[:CAP]
    assert stored.metadata["finish_reason"] == "length"
    assert stored.metadata["capped_at_chars"] == CAP


def test_a_json_turn_cuts_a_reply_over_the_message_cap(
    api: APIClient, model: ScriptedServer, settings: Any
) -> None:
    settings.CHATMEM_MAX_MESSAGE_CHARS = CAP
    model.script(chat_reply(LONG))
    chat_id = new_chat(api)
    response = post_turn(api, chat_id)
    assert response.status_code == 201, response.content
    reply = response.json()["assistant_message"]
    assert reply["content"] == LONG[:CAP]
    assert reply["metadata"]["capped_at_chars"] == CAP
    assert_capped(chat_id)


def test_a_streamed_turn_sends_nothing_past_the_message_cap(
    api: APIClient, model: ScriptedServer, settings: Any
) -> None:
    settings.CHATMEM_MAX_MESSAGE_CHARS = CAP
    model.script(streamed_long_reply())
    chat_id = new_chat(api)
    response = post_turn(api, chat_id, stream=True)
    received = sse_events(response)
    assert received[-1][0] == "done", received
    deltas = "".join(data["content"] for name, data in received if name == "delta")
    assert deltas == LONG[:CAP]
    assert_capped(chat_id)


def v1_completion(user: Any, **body: Any) -> Any:
    request = {
        "model": "default",
        "user": "capped",
        "messages": [{"role": "user", "content": "hi"}],
    }
    return bearer(user).post("/v1/chat/completions", {**request, **body}, format="json")


def test_v1_cuts_a_reply_over_the_message_cap(
    user: Any, model: ScriptedServer, settings: Any
) -> None:
    settings.CHATMEM_MAX_MESSAGE_CHARS = CAP
    model.script(chat_reply(LONG))
    response = v1_completion(user)
    assert response.status_code == 200, response.content
    choice = response.json()["choices"][0]
    assert choice["message"]["content"] == LONG[:CAP]
    assert choice["finish_reason"] == "length"
    assert_capped(Message.objects.get(role="assistant").chat_id)


def test_v1_streams_nothing_past_the_message_cap(
    user: Any, model: ScriptedServer, settings: Any
) -> None:
    settings.CHATMEM_MAX_MESSAGE_CHARS = CAP
    model.script(streamed_long_reply())
    response = v1_completion(user, stream=True)
    assert response.status_code == 200
    text = b"".join(response.streaming_content).decode()
    chunks = [
        json.loads(line[len("data: ") :])
        for line in text.splitlines()
        if line.startswith("data: {")
    ]
    choices = [c["choices"][0] for c in chunks if c.get("choices")]
    assert "".join(c["delta"].get("content") or "" for c in choices) == LONG[:CAP]
    assert choices[-1]["finish_reason"] == "length"
    assert_capped(Message.objects.get(role="assistant").chat_id)
