"""A streamed reply's deadline (LLM_TIMEOUT_SECONDS) counts from the request, and a reply that
ends past it is a timeout, never a reply: the turn's slot may have gone stale by then and the
chat's next turn started. Real openai client, real HTTP, against the scripted server."""

from typing import Any

import pytest

from conversations.chat_model.contract import ModelError
from conversations.chat_model.openai_backend import OpenAIChatModel
from conversations.chat_model.transport import make_openai_client
from tests.test_summarizers import (
    API_KEY,
    Reply,
    ScriptedServer,
    server_fixture,  # noqa: F401  (the "server" fixture)
)

MESSAGES = [{"role": "user", "content": "Tell me a story."}]
# Each wait below stays at least 0.6 s inside the read timeout, so a loaded machine cannot turn
# the deadline under test into a read timeout.
TIMEOUT = 2.0


def chunk(content: str | None = None, finish_reason: str | None = None) -> dict[str, Any]:
    delta = {"role": "assistant", "content": content}
    return {
        "id": "chatcmpl-1",
        "object": "chat.completion.chunk",
        "created": 0,
        "model": "gpt-test",
        "choices": [{"index": 0, "delta": delta, "finish_reason": finish_reason}],
    }


def model(server: ScriptedServer) -> OpenAIChatModel:
    client = make_openai_client(base_url=server.base_url, api_key=API_KEY, timeout=TIMEOUT)
    return OpenAIChatModel(client=client, timeout=TIMEOUT)


def test_a_slow_first_byte_counts_against_the_deadline(server: ScriptedServer) -> None:
    """Headers after 1 s, the rest 1.4 s later: each wait is within the 2 s read timeout, the
    whole reply is not: the deadline starts with the request, not at the headers."""
    server.script(
        Reply(delay=1.0, events=[chunk("Once"), 1.4, chunk(" upon"), chunk(finish_reason="stop")])
    )
    stream = model(server).stream(MESSAGES, "m")
    received = []
    with pytest.raises(ModelError) as caught:
        for delta in stream:
            received.append(delta)
    assert caught.value.status == 504
    assert "did not finish its reply within 2 seconds" in str(caught.value)
    assert received == ["Once"]


def test_a_stream_that_ends_past_the_deadline_is_no_reply(server: ScriptedServer) -> None:
    """Every chunk came in time; the stream's end ([DONE]) came after the deadline. The deadline
    was checked only when a chunk arrived, so the late end made a complete reply."""
    server.script(
        Reply(delay=1.0, events=[chunk("Once"), chunk(finish_reason="stop"), 1.4])  # then [DONE]
    )
    stream = model(server).stream(MESSAGES, "m")
    with pytest.raises(ModelError) as caught:
        list(stream)
    assert caught.value.status == 504
    assert stream.result is None


def test_a_reply_within_the_deadline_is_a_reply(server: ScriptedServer) -> None:
    server.script(Reply(delay=0.1, events=[chunk("Once"), 0.1, chunk(finish_reason="stop")]))
    stream = model(server).stream(MESSAGES, "m")
    assert list(stream) == ["Once"]
    assert stream.result is not None and stream.result.content == "Once"
