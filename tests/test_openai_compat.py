"""The OpenAI-compatible endpoint, driven by the official ``openai`` package against a live
server, with the fake model server behind chatmem: conversations, tool calls, streams, errors;
what it accepts and refuses, how a model's refusal reaches the client, the stream's first chunk,
and a failed stream in the operator's log."""

from __future__ import annotations

import json
import logging
from collections.abc import Iterator
from typing import Any

import httpx
import openai
import pytest
from django.test import Client
from rest_framework.authtoken.models import Token
from rest_framework.test import APIClient

from conversations.models import Brief, Chat, Message
from conversations.services import chat_backend as backends
from conversations.services import exchanges
from conversations.services.context import SUMMARY_HEADER
from tests.support.fake_openai import FakeOpenAI
from tests.test_metrics import scrape, value

HELLO: Any = [{"role": "user", "content": "hello"}]
TOOLS = [
    {
        "type": "function",
        "function": {
            "name": "lookup",
            "description": "Look a value up.",
            "parameters": {"type": "object", "properties": {}},
        },
    }
]


@pytest.fixture
def token(user: Any) -> str:
    return Token.objects.create(user=user).key


@pytest.fixture
def memory(settings: Any, use_fake_openai: FakeOpenAI) -> FakeOpenAI:
    # contract keeps 6 messages verbatim and folds the rest synchronously before the model call,
    # so a 30-turn conversation reaches the model as summary + unfolded history.
    settings.MEMORY_POLICY = "contract"
    return use_fake_openai


@pytest.fixture
def client(live_server: Any, token: str) -> Iterator[openai.OpenAI]:
    with openai.OpenAI(base_url=f"{live_server.url}/v1", api_key=token, max_retries=0) as sdk:
        yield sdk


@pytest.fixture
def retrying_client(live_server: Any, token: str) -> Iterator[openai.OpenAI]:
    # The SDK's default retries: what a client that changed only its base URL gets.
    with openai.OpenAI(base_url=f"{live_server.url}/v1", api_key=token) as sdk:
        yield sdk


def rest(token: str) -> APIClient:
    api = APIClient()
    api.credentials(HTTP_AUTHORIZATION=f"Token {token}")
    return api


def chat_requests(fake: FakeOpenAI) -> list[Any]:
    return [record for record in fake.requests if record.kind == "chat"]


def context_of(token: str, chat_id: int) -> list[dict[str, Any]]:
    response = rest(token).get(f"/api/v1/chats/{chat_id}/context/")
    assert response.status_code == 200
    return list(response.json()["messages"])


def as_sent(messages: list[dict[str, Any]]) -> list[tuple[str, str]]:
    return [(m["role"], m.get("content") or "") for m in messages]


@pytest.mark.parametrize("stream", [False, True], ids=["json", "stream"])
def test_thirty_turns_sending_only_the_new_message(
    client: openai.OpenAI, memory: FakeOpenAI, token: str, stream: bool
) -> None:
    chat_id: int | None = None
    summaries_seen = 0
    for number in range(1, 31):
        content = f"Turn {number}: remember that item {number} is blue."
        before = context_of(token, chat_id) if chat_id else []
        kwargs: dict[str, Any] = {
            "model": "default",
            "messages": [{"role": "user", "content": content}],
            "extra_headers": {"X-Chatmem-Chat-Id": f"story-{stream}"},
        }
        if stream:
            chunks = list(client.chat.completions.create(stream=True, **kwargs))
            reply = "".join(c.choices[0].delta.content or "" for c in chunks if c.choices)
            assert chunks[-1].choices[0].finish_reason == "stop"
        else:
            completion = client.chat.completions.create(**kwargs)
            reply = completion.choices[0].message.content or ""
            assert completion.usage is not None and completion.usage.prompt_tokens > 0
        chat = Chat.objects.get(external_id=f"story-{stream}")
        chat_id = chat.pk
        stored = list(Message.objects.filter(chat=chat).order_by("-seq")[:2])
        assert [(m.role, m.content) for m in reversed(stored)] == [
            ("user", content),
            ("assistant", reply),
        ]
        sent = as_sent(chat_requests(memory)[-1].body["messages"])
        if number > 1:
            # What the model got is chatmem's memory (after any fold this turn forced) + the new
            # message; the fold only ever shortens the verbatim part from the front.
            now = context_of(token, chat_id)[:-2]  # the context now ends with this turn's pair
            assert sent == [*as_sent(now), ("user", content)]
            assert set(as_sent(before)) >= {m for m in as_sent(now) if m[0] != "system"}
        summaries_seen += any(text.startswith(SUMMARY_HEADER) for _, text in sent)
    assert chat_id is not None
    brief = Brief.objects.get(chat_id=chat_id)
    assert brief.last_consolidated > 0 and summaries_seen >= 20
    assert Message.objects.filter(chat_id=chat_id).count() == 60


def test_a_tool_call_round_trip(client: openai.OpenAI, memory: FakeOpenAI) -> None:
    headers = {"X-Chatmem-Chat-Id": "tools"}
    first = client.chat.completions.create(
        model="default",
        messages=[{"role": "user", "content": "CALL_TOOL:lookup what is the answer?"}],
        tools=TOOLS,  # type: ignore[arg-type]
        extra_headers=headers,
    )
    choice = first.choices[0]
    assert choice.finish_reason == "tool_calls"
    assert choice.message.tool_calls
    call = choice.message.tool_calls[0]
    assert call.function.name == "lookup"  # type: ignore[union-attr]
    second = client.chat.completions.create(
        model="default",
        messages=[{"role": "tool", "tool_call_id": call.id, "content": "42"}],
        tools=TOOLS,  # type: ignore[arg-type]
        temperature=0.2,
        extra_headers=headers,
    )
    assert second.choices[0].finish_reason == "stop" and second.choices[0].message.content
    chat = Chat.objects.get(external_id="tools")
    stored = list(Message.objects.filter(chat=chat).order_by("seq"))
    assert [m.role for m in stored] == ["user", "assistant", "tool", "assistant"]
    assert stored[1].metadata["tool_calls"][0]["id"] == call.id
    assert stored[2].metadata == {"tool_call_id": call.id}
    # The model saw its own call and the result, in order, with the tools offered again.
    body = chat_requests(memory)[-1].body
    roles = [m["role"] for m in body["messages"] if m["role"] != "system"]
    assert roles[-3:] == ["user", "assistant", "tool"]
    assert body["messages"][-2]["tool_calls"][0]["id"] == call.id
    assert body["messages"][-1] == {"role": "tool", "content": "42", "tool_call_id": call.id}
    assert body["tools"][0]["function"]["name"] == "lookup"
    assert body["temperature"] == 0.2  # sampling parameters are forwarded as sent


def test_a_streamed_tool_call(client: openai.OpenAI, memory: FakeOpenAI) -> None:
    chunks = list(
        client.chat.completions.create(  # type: ignore[call-overload]
            model="default",
            messages=[{"role": "user", "content": "CALL_TOOL:lookup now"}],
            tools=TOOLS,
            stream=True,
            stream_options={"include_usage": True},
            extra_headers={"X-Chatmem-Chat-Id": "stream-tools"},
        )
    )
    calls = [
        c for chunk in chunks if chunk.choices for c in chunk.choices[0].delta.tool_calls or []
    ]
    assert calls and calls[0].function and calls[0].function.name == "lookup"
    finishes = [chunk.choices[0].finish_reason for chunk in chunks if chunk.choices]
    assert finishes[-1] == "tool_calls"
    assert chunks[-1].usage is not None and chunks[-1].usage.prompt_tokens > 0
    stored = Message.objects.filter(chat__external_id="stream-tools").order_by("seq")
    assert stored.last().metadata["tool_calls"][0]["id"] == calls[0].id  # type: ignore[union-attr]


def test_resending_the_whole_history_stores_nothing_twice(
    client: openai.OpenAI, memory: FakeOpenAI, token: str
) -> None:
    history: list[dict[str, Any]] = [{"role": "system", "content": "You are terse."}]
    for number in range(1, 9):
        history.append({"role": "user", "content": f"full-history message {number}"})
        completion = client.chat.completions.create(
            model="default",
            messages=history,  # type: ignore[arg-type]
            user="resender",
        )
        history.append({"role": "assistant", "content": completion.choices[0].message.content})
        chat = Chat.objects.get(external_id="resender")
        # The model got chatmem's memory plus the one new message: the same as a client that
        # sends only the new message would produce.
        sent = as_sent(chat_requests(memory)[-1].body["messages"])
        new_message = ("user", f"full-history message {number}")
        assert sent == [*as_sent(context_of(token, chat.pk)[:-2]), new_message]
    stored = list(Message.objects.filter(chat=chat).order_by("seq"))
    assert [m.content for m in stored if m.role == "user"] == [
        f"full-history message {n}" for n in range(1, 9)
    ]
    assert len(stored) == 16
    assert chat.system_prompt == "You are terse."  # the first request's system message


def test_models_and_openai_shaped_errors(
    client: openai.OpenAI, memory: FakeOpenAI, live_server: Any
) -> None:
    assert [model.id for model in client.models.list()] == ["default"]
    with pytest.raises(openai.NotFoundError) as not_found:
        client.chat.completions.create(
            model="no-such-model", messages=[{"role": "user", "content": "hi"}], user="x"
        )
    assert not_found.value.code == "model_not_found"
    with pytest.raises(openai.BadRequestError) as unnamed:
        client.chat.completions.create(
            model="default", messages=[{"role": "user", "content": "hi"}]
        )
    assert unnamed.value.code == "missing_chat_id"
    with pytest.raises(openai.BadRequestError) as no_new:
        client.chat.completions.create(
            model="default", messages=[{"role": "assistant", "content": "hello"}], user="x"
        )
    assert no_new.value.param == "messages"
    body = no_new.value.body
    assert isinstance(body, dict) and set(body) == {"message", "type", "param", "code"}
    bad = openai.OpenAI(base_url=f"{live_server.url}/v1", api_key="wrong", max_retries=0)
    with bad, pytest.raises(openai.AuthenticationError):
        bad.models.list()
    assert not Chat.objects.exists()  # nothing stored by a refused request


def test_a_model_failure_is_an_openai_error_and_stores_nothing(
    client: openai.OpenAI, memory: FakeOpenAI
) -> None:
    memory.queue_faults("chat", ["500"])
    with pytest.raises(openai.APIStatusError) as failed:
        client.chat.completions.create(
            model="default", messages=[{"role": "user", "content": "hello"}], user="failing"
        )
    assert failed.value.status_code == 502
    assert not Message.objects.filter(chat__external_id="failing").exists()


def test_streaming_under_asgi_is_an_async_stream(
    memory: FakeOpenAI, token: str, transactional_db: None
) -> None:
    """Under ASGI a synchronous iterator would be read whole before the first byte went out."""
    from asgiref.sync import async_to_sync
    from django.test import AsyncClient

    async def stream() -> tuple[Any, list[bytes]]:
        response = await AsyncClient().post(
            "/v1/chat/completions",
            {"model": "default", "stream": True, "messages": [{"role": "user", "content": "hi"}]},
            content_type="application/json",
            headers={"Authorization": f"Bearer {token}", "X-Chatmem-Chat-Id": "asgi"},
        )
        return response, [chunk async for chunk in response.streaming_content]  # type: ignore[attr-defined]

    response, chunks = async_to_sync(stream)()
    assert response.is_async
    events = b"".join(chunks).decode().split("\n\n")
    assert events[-2] == "data: [DONE]"
    deltas = [json.loads(e[6:])["choices"][0]["delta"].get("content") for e in events[1:-3]]
    reply = Message.objects.filter(chat__external_id="asgi", role="assistant").get()
    assert "".join(d or "" for d in deltas) == reply.content


def test_a_streamed_reply_trickling_past_the_model_deadline_stops(
    memory: FakeOpenAI, live_server: Any, token: str, settings: Any
) -> None:
    """Each chunk came well within the read timeout, and /v1 streams had no deadline for the
    whole reply: a long one held the chat's slot past TURN_SLOT_STALE_SECONDS, and the next
    request took it over. (Read raw: the SDK raises the error event as APIError.)"""
    import httpx

    settings.LLM_TIMEOUT_SECONDS = 0.6
    memory.chunk_delay = 0.1
    memory.reply_words = 40
    body = {"model": "default", "messages": [{"role": "user", "content": "a long story"}]}
    headers = {"Authorization": f"Bearer {token}", "X-Chatmem-Chat-Id": "trickle"}
    with httpx.stream(
        "POST",
        f"{live_server.url}/v1/chat/completions",
        json={**body, "stream": True},
        headers=headers,
        timeout=30,
    ) as response:
        events = [line[6:] for line in response.iter_lines() if line.startswith("data: ")]
    assert any('"content"' in event for event in events[1:-1])  # it did stream for a while
    error = json.loads(events[-1])["error"]
    assert "did not finish its reply within 0.6 seconds" in error["message"]
    assert "[DONE]" not in events
    chat = Chat.objects.get(external_id="trickle")
    assert not Message.objects.filter(chat=chat).exists()
    assert Chat.objects.get(pk=chat.pk).turn_token is None  # the slot is free again


def test_a_silent_model_keeps_the_stream_alive(
    client: openai.OpenAI, memory: FakeOpenAI, live_server: Any, token: str, monkeypatch: Any
) -> None:
    """While the model says nothing (thinking, a slow first token) the /v1 stream sent nothing
    either, and a proxy's idle timeout could cut it; it now sends SSE comments, which clients
    (the OpenAI SDK among them) skip."""
    import httpx

    from conversations.services import exchanges

    monkeypatch.setattr(exchanges, "HEARTBEAT_SECONDS", 0.05)
    memory.chunk_delay = 0.2
    memory.reply_words = 3
    body = {
        "model": "default",
        "messages": [{"role": "user", "content": "take your time"}],
        "stream": True,
    }
    headers = {"Authorization": f"Bearer {token}", "X-Chatmem-Chat-Id": "silent"}
    with httpx.stream(
        "POST", f"{live_server.url}/v1/chat/completions", json=body, headers=headers, timeout=30
    ) as response:
        text = "".join(response.iter_text())
    assert ": keep-alive" in text and text.rstrip().endswith("data: [DONE]")
    with client.chat.completions.create(
        model="default",
        messages=[{"role": "user", "content": "again"}],
        stream=True,
        extra_headers={"X-Chatmem-Chat-Id": "silent"},
    ) as stream:
        reply = "".join(c.choices[0].delta.content or "" for c in stream if c.choices)
    stored = Message.objects.filter(chat__external_id="silent").order_by("-seq").first()
    assert stored is not None and reply == stored.content and reply


@pytest.mark.parametrize("stream", [False, True], ids=["json", "stream"])
def test_the_models_cached_tokens_reach_the_message_the_metrics_the_usage_brief_and_admin(
    client: openai.OpenAI, memory: FakeOpenAI, stream: bool, token: str, admin_client: Client
) -> None:
    """The model server's report of its prompt cache (OpenAI's rule, in the test server) is kept
    in the reply's metadata, counted in /metrics by model variant, passed through in /v1 usage,
    plain and streamed, and totalled in the brief and on the admin's chat page. The second turn
    repeats the first's long prompt as its prefix."""
    before = scrape(Client())
    long_fact = "The vault code is 4417. " * 220  # 5,280 characters: 1,320 of the server's tokens
    usages = []
    for content in (long_fact, "And the door code?"):
        kwargs: dict[str, Any] = {
            "model": "default",
            "messages": [{"role": "user", "content": content}],
            "extra_headers": {"X-Chatmem-Chat-Id": f"cached-{stream}"},
        }
        if stream:
            chunks = list(
                client.chat.completions.create(
                    stream=True, stream_options={"include_usage": True}, **kwargs
                )
            )
            usages.append(chunks[-1].usage)
        else:
            usages.append(client.chat.completions.create(**kwargs).usage)
    cached = [usage.prompt_tokens_details.cached_tokens for usage in usages]
    assert cached[0] == 0 and cached[1] >= 1024 and (cached[1] - 1024) % 128 == 0
    replies = Message.objects.filter(chat__external_id=f"cached-{stream}", role="assistant")
    assert [m.metadata["cached_tokens"] for m in replies.order_by("seq")] == cached
    after = scrape(Client())
    grown = {
        cache: value(after, "chatmem_model_input_tokens_total", variant="default", cache=cache)
        - value(before, "chatmem_model_input_tokens_total", variant="default", cache=cache)
        for cache in ("cached", "uncached")
    }
    prompts = sum(usage.prompt_tokens for usage in usages)
    assert grown == {"cached": cached[1], "uncached": prompts - cached[1]}
    chat = Chat.objects.get(external_id=f"cached-{stream}")
    # The chat belongs to the token's user: the brief is theirs to read.
    chat.owner = Token.objects.get(key=token).user
    chat.save(update_fields=["owner"])
    brief = rest(token).get(f"/api/v1/chats/{chat.pk}/brief/").json()
    assert brief["prompt_cache"] == {
        "replies": 2,
        "prompt_tokens": prompts,
        "cached_tokens": cached[1],
        "cached_share": cached[1] / prompts,
    }
    page = admin_client.get(f"/admin/conversations/chat/{chat.pk}/change/").content.decode()
    assert f"{cached[1]:,} of {prompts:,} prompt tokens ({cached[1] / prompts:.0%})" in page


@pytest.mark.parametrize("stream", [False, True], ids=["json", "stream"])
def test_a_chats_prompt_cache_key_is_sent_and_a_refused_one_is_dropped_once_for_good(
    client: openai.OpenAI, memory: FakeOpenAI, token: str, stream: bool
) -> None:
    """Every model request of a chat carries its prompt_cache_key (OpenAI routes by it to the
    machines holding the chat's cached prefix). An endpoint that refuses the parameter gets
    the same request again without it, the turn succeeds, and it is never sent it again: the
    REST API's turns included."""
    backends._chat_model.cache_clear()  # a model that has not met a refusal yet

    def ask(chat: str) -> None:
        kwargs: dict[str, Any] = {
            "model": "default",
            "messages": [{"role": "user", "content": "hello"}],
            "extra_headers": {"X-Chatmem-Chat-Id": chat},
        }
        if stream:
            assert list(client.chat.completions.create(stream=True, **kwargs))
        else:
            assert client.chat.completions.create(**kwargs).choices[0].message.content

    ask(f"keyed-{stream}")
    chat_id = Chat.objects.get(external_id=f"keyed-{stream}").pk
    assert chat_requests(memory)[-1].body["prompt_cache_key"] == f"chatmem-chat-{chat_id}"
    memory.refused_params = ("prompt_cache_key",)
    ask(f"keyed-{stream}")
    first, second = chat_requests(memory)[-2:]
    assert "prompt_cache_key" in first.body and "prompt_cache_key" not in second.body
    assert first.body["messages"] == second.body["messages"]
    ask(f"keyed-{stream}")
    response = rest(token).post(f"/api/v1/chats/{chat_id}/turns/", {"content": "hi"}, "json")
    assert response.status_code == 201
    assert [("prompt_cache_key" in r.body) for r in chat_requests(memory)] == [
        True,
        True,
        False,
        False,
        False,
    ]
    backends._chat_model.cache_clear()


def sse_chunks(live_server: Any, token: str, chat: str, include_usage: bool) -> list[Any]:
    import httpx

    body: dict[str, Any] = {
        "model": "default",
        "messages": [{"role": "user", "content": "count the chunks"}],
        "stream": True,
    }
    if include_usage:
        body["stream_options"] = {"include_usage": True}
    headers = {"Authorization": f"Bearer {token}", "X-Chatmem-Chat-Id": chat}
    with httpx.stream(
        "POST", f"{live_server.url}/v1/chat/completions", json=body, headers=headers, timeout=30
    ) as response:
        lines = [line for line in response.iter_lines() if line.startswith("data: ")]
    assert lines[-1] == "data: [DONE]"
    return [json.loads(line.removeprefix("data: ")) for line in lines[:-1]]


def test_stream_chunks_share_one_id_unique_per_completion(
    memory: FakeOpenAI, live_server: Any, token: str
) -> None:
    """As OpenAI sends them: every chunk of a completion has the same id and created, a new
    completion a new id (two streams of one chat shared an id), and with include_usage every
    chunk but the usage one says "usage": null."""
    memory.reply_words = 12
    first = sse_chunks(live_server, token, "ids", include_usage=True)
    second = sse_chunks(live_server, token, "ids", include_usage=False)
    for chunks in (first, second):
        assert len(chunks) > 3
        assert len({c["id"] for c in chunks}) == 1 and len({c["created"] for c in chunks}) == 1
    assert first[0]["id"] != second[0]["id"]
    assert all(c["usage"] is None for c in first[:-1])
    assert first[-1]["choices"] == [] and first[-1]["usage"]["total_tokens"] > 0
    assert all("usage" not in c for c in second)
    # The chunk that ends the reply says where it was stored, as a JSON completion's body does.
    (ending,) = [c for c in second if c["choices"] and c["choices"][0]["finish_reason"]]
    chat = Chat.objects.get(external_id="ids")
    stored = list(Message.objects.filter(chat=chat).order_by("seq").values_list("seq", flat=True))
    assert ending["chatmem"] == {
        "chat_id": chat.pk,
        "seqs": stored[-2:],
        "summary_version": 0,
        "unfolded": len(stored),
        "degraded": False,
        "folds_paused": False,
    }


# --- what is accepted and refused, a model's refusal, a failed stream in the log ------------------


def post(live_server: Any, token: str, body: dict[str, Any]) -> httpx.Response:
    return httpx.post(
        f"{live_server.url}/v1/chat/completions",
        json={"model": "default", "messages": HELLO, "user": "client", **body},
        headers={"Authorization": f"Bearer {token}"},
        timeout=30,
    )


def sse_data(response: httpx.Response) -> list[str]:
    return [line[6:] for line in response.iter_lines() if line.startswith("data: ")]


def test_a_request_the_model_refuses_is_not_retried_and_says_why(
    retrying_client: openai.OpenAI, use_fake_openai: FakeOpenAI
) -> None:
    """The model's 400 comes back as a 502 that says what the model refused, marked not to be
    retried: the SDK, which retries a 5xx, does not send the same doomed request again."""
    use_fake_openai.queue_faults("chat", ["400"])
    with pytest.raises(openai.APIStatusError) as failed:
        retrying_client.chat.completions.create(model="default", messages=HELLO, user="refused")
    assert failed.value.status_code == 502
    assert "Invalid request (fake)." in failed.value.message
    assert failed.value.response.headers["x-should-retry"] == "false"
    assert len(chat_requests(use_fake_openai)) == 1
    assert not Message.objects.filter(chat__external_id="refused").exists()


def test_a_prompt_over_the_models_window_is_not_retried_plain_or_streamed(
    live_server: Any,
    token: str,
    retrying_client: openai.OpenAI,
    use_fake_openai: FakeOpenAI,
) -> None:
    """The model server's context-size refusal (llama.cpp's: a 400, or an error event in a
    stream it started) is a 502 marked not to be retried, and a stream's error says so."""
    use_fake_openai.queue_faults("chat", ["context_exceeded"])
    with pytest.raises(openai.APIStatusError) as failed:
        retrying_client.chat.completions.create(model="default", messages=HELLO, user="window")
    assert failed.value.status_code == 502
    assert failed.value.response.headers["x-should-retry"] == "false"
    assert "longer than its context window" in failed.value.message
    assert len(chat_requests(use_fake_openai)) == 1
    use_fake_openai.queue_faults("chat", ["context_exceeded"])
    response = post(live_server, token, {"stream": True})
    error = json.loads(sse_data(response)[-1])["error"]
    assert "sending it again cannot help" in error["message"]
    assert "retry the turn" not in error["message"]
    assert not Message.objects.filter(chat__external_id="window").exists()


def test_a_transient_model_failure_stays_retryable(
    live_server: Any, token: str, use_fake_openai: FakeOpenAI
) -> None:
    use_fake_openai.queue_faults("chat", ["500"])
    response = post(live_server, token, {})
    assert response.status_code == 502
    assert "x-should-retry" not in response.headers
    assert "retry the turn" in response.json()["error"]["message"]


def test_the_rest_turn_tells_its_client_too(
    token: str, use_fake_openai: FakeOpenAI, transactional_db: None
) -> None:
    api = APIClient()
    api.credentials(HTTP_AUTHORIZATION=f"Token {token}")
    chat_id = api.post("/api/v1/chats/", {}, format="json").json()["id"]
    use_fake_openai.queue_faults("chat", ["400"])
    response = api.post(f"/api/v1/chats/{chat_id}/turns/", {"content": "hi"}, format="json")
    assert response.status_code == 502
    assert response["x-should-retry"] == "false"
    assert "Invalid request (fake)." in response.json()["detail"]


def test_stream_null_is_the_default(
    live_server: Any, token: str, use_fake_openai: FakeOpenAI
) -> None:
    response = post(live_server, token, {"stream": None})
    assert response.status_code == 200
    assert response.json()["object"] == "chat.completion"


def test_the_offline_model_says_it_answered(live_server: Any, token: str, settings: Any) -> None:
    """The response named the model the client asked for (gpt-4o-mini) when the offline echo
    model had answered."""
    settings.CHAT_BACKEND = "offline"
    response = post(live_server, token, {})
    assert response.status_code == 200, response.content
    assert response.json()["model"] == "offline"
    streamed = post(live_server, token, {"stream": True})
    chunks = [json.loads(data) for data in sse_data(streamed) if data != "[DONE]"]
    assert chunks and {chunk["model"] for chunk in chunks} == {"offline"}


@pytest.mark.parametrize(
    ("extra", "param", "words"),
    [
        ({"stream_options": {"include_usage": True}}, "stream_options", "only allowed when"),
        ({"logprobs": True}, "logprobs", "not supported"),
        ({"top_logprobs": 3}, "top_logprobs", "not supported"),
        ({"top_k": 40}, "top_k", "Unrecognized request argument supplied: top_k"),
        ({"logit_bias": [1, 2]}, "logit_bias", "must be an object"),
    ],
)
def test_what_would_change_the_answer_unseen_is_refused(
    live_server: Any,
    token: str,
    use_fake_openai: FakeOpenAI,
    extra: dict[str, Any],
    param: str,
    words: str,
) -> None:
    """Accepted and dropped, these would get a 200 answering something other than what was
    asked."""
    response = post(live_server, token, extra)
    assert response.status_code == 400
    error = response.json()["error"]
    assert error["param"] == param
    assert words in error["message"]
    assert error["code"] is None  # not DRF's generic "error"
    assert not chat_requests(use_fake_openai)
    assert not Chat.objects.exists()


def test_answer_shaping_parameters_reach_the_model(
    live_server: Any, token: str, use_fake_openai: FakeOpenAI
) -> None:
    sent = {"logit_bias": {"1234": -100}, "reasoning_effort": "low", "logprobs": False}
    ignored = {"store": False, "service_tier": "auto", "prompt_cache_retention": "24h"}
    response = post(live_server, token, {**sent, **ignored})
    assert response.status_code == 200
    [request] = chat_requests(use_fake_openai)
    assert request.body["logit_bias"] == {"1234": -100}
    assert request.body["reasoning_effort"] == "low"
    for not_forwarded in ("logprobs", "user", *ignored):
        assert not_forwarded not in request.body


def test_a_streamed_tool_call_has_no_content(
    retrying_client: openai.OpenAI, use_fake_openai: FakeOpenAI, live_server: Any, token: str
) -> None:
    """The first chunk is sent before the reply's kind is known: it carries the role only, so a
    streamed tool call's content is null, as the JSON completion says."""
    tools: Any = [{"type": "function", "function": {"name": "lookup", "parameters": {}}}]
    with retrying_client.chat.completions.stream(
        model="default",
        user="tools",
        messages=[{"role": "user", "content": "CALL_TOOL:lookup now"}],
        tools=tools,
    ) as stream:
        final = stream.get_final_completion()
    message = final.choices[0].message
    assert message.tool_calls and message.content is None
    with httpx.stream(
        "POST",
        f"{live_server.url}/v1/chat/completions",
        json={"model": "default", "messages": HELLO, "user": "first", "stream": True},
        headers={"Authorization": f"Bearer {token}"},
        timeout=30,
    ) as response:
        first = json.loads(sse_data(response)[0])
    assert first["choices"][0]["delta"] == {"role": "assistant"}


def test_a_bug_in_a_streamed_exchange_is_logged(
    live_server: Any,
    token: str,
    use_fake_openai: FakeOpenAI,
    monkeypatch: Any,
    caplog: pytest.LogCaptureFixture,
) -> None:
    """The client gets a server_error event, and the operator a log line with the traceback."""

    def broken(*args: Any, **kwargs: Any) -> Any:
        raise RuntimeError("a bug while storing")

    monkeypatch.setattr(exchanges, "store_exchange", broken)
    with (
        caplog.at_level(logging.ERROR, logger="chatmem.turn"),
        httpx.stream(
            "POST",
            f"{live_server.url}/v1/chat/completions",
            json={"model": "default", "messages": HELLO, "user": "bug", "stream": True},
            headers={"Authorization": f"Bearer {token}"},
            timeout=30,
        ) as response,
    ):
        events = sse_data(response)
    assert json.loads(events[-1])["error"]["code"] == "server_error"
    [record] = [r for r in caplog.records if r.getMessage() == "streamed exchange failed"]
    assert record.exc_info and "a bug while storing" in str(record.exc_info[1])


def test_a_body_over_the_limit_is_an_openai_error(
    live_server: Any, token: str, settings: Any, use_fake_openai: FakeOpenAI
) -> None:
    """In OpenAI's error shape, not the REST API's {"detail", "code"}, which the SDKs would show
    as a bare status."""
    settings.CHATMEM_MAX_BODY_BYTES = 1000
    response = post(live_server, token, {"messages": [{"role": "user", "content": "x" * 2000}]})
    assert response.status_code == 413
    assert response.json()["error"]["code"] == "request_too_large"
    assert not chat_requests(use_fake_openai)
