"""The OpenAI-compatible endpoint as a demanding client meets it: what it accepts and refuses,
how a model's refusal reaches the client, the stream's first chunk, and a failed stream in the
operator's log. The official ``openai`` package against a live server, the fake model behind."""

from __future__ import annotations

import json
import logging
from collections.abc import Iterator
from typing import Any

import httpx
import openai
import pytest
from rest_framework.authtoken.models import Token
from rest_framework.test import APIClient

from conversations.models import Chat, Message
from conversations.services import exchanges
from tests.fake_openai import FakeOpenAI

HELLO: Any = [{"role": "user", "content": "hello"}]


@pytest.fixture
def token(user: Any) -> str:
    return Token.objects.create(user=user).key


@pytest.fixture
def client(live_server: Any, token: str) -> Iterator[openai.OpenAI]:
    # The SDK's default retries: what a client that changed only its base URL gets.
    with openai.OpenAI(base_url=f"{live_server.url}/v1", api_key=token) as sdk:
        yield sdk


def chat_requests(fake: FakeOpenAI) -> list[Any]:
    return [record for record in fake.requests if record.kind == "chat"]


def post(live_server: Any, token: str, body: dict[str, Any]) -> httpx.Response:
    return httpx.post(
        f"{live_server.url}/v1/chat/completions",
        json={"model": "default", "messages": HELLO, "user": "review", **body},
        headers={"Authorization": f"Bearer {token}"},
        timeout=30,
    )


def sse_data(response: httpx.Response) -> list[str]:
    return [line[6:] for line in response.iter_lines() if line.startswith("data: ")]


def test_a_request_the_model_refuses_is_not_retried_and_says_why(
    client: openai.OpenAI, use_fake_openai: FakeOpenAI
) -> None:
    """The model's 400 was a 502 with no word of what it refused, and the SDK, retrying 5xx,
    sent the same doomed request three times."""
    use_fake_openai.queue_faults("chat", ["400"])
    with pytest.raises(openai.APIStatusError) as failed:
        client.chat.completions.create(model="default", messages=HELLO, user="refused")
    assert failed.value.status_code == 502
    assert "Invalid request (fake)." in failed.value.message
    assert failed.value.response.headers["x-should-retry"] == "false"
    assert len(chat_requests(use_fake_openai)) == 1
    assert not Message.objects.filter(chat__external_id="refused").exists()


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
    """These were accepted and dropped: a 200 answered differently from what was asked."""
    response = post(live_server, token, extra)
    assert response.status_code == 400
    error = response.json()["error"]
    assert error["param"] == param
    assert words in error["message"]
    assert error["code"] is None  # DRF's generic "error" was leaking in as the code
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
    client: openai.OpenAI, use_fake_openai: FakeOpenAI, live_server: Any, token: str
) -> None:
    """The first chunk said "content": "" before the reply's kind was known, so a streamed tool
    call's content came out "" where the JSON completion says null."""
    tools: Any = [{"type": "function", "function": {"name": "lookup", "parameters": {}}}]
    with client.chat.completions.stream(
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
    """The client got a server_error event; the operator got no log line at all."""

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
    """It was the REST API's {"detail", "code"}: the SDKs showed a bare status."""
    settings.CHATMEM_MAX_BODY_BYTES = 1000
    response = post(live_server, token, {"messages": [{"role": "user", "content": "x" * 2000}]})
    assert response.status_code == 413
    assert response.json()["error"]["code"] == "request_too_large"
    assert not chat_requests(use_fake_openai)
