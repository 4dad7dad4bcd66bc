"""The fake OpenAI server's streamed replies, on the wire: chunked server-sent events, paced by
``chunk_delay`` (what the streamed-turn tests rely on to disconnect mid-reply)."""

import http.client
import json
import time
from collections.abc import Iterator
from urllib.parse import urlsplit

import pytest

from tests.support.fake_openai import FakeOpenAI


@pytest.fixture
def server() -> Iterator[FakeOpenAI]:
    with FakeOpenAI(reply_words=10) as fake:
        yield fake


def stream_request(server: FakeOpenAI) -> http.client.HTTPResponse:
    url = urlsplit(server.base_url)
    connection = http.client.HTTPConnection(url.hostname or "", url.port, timeout=10)
    body = {
        "model": "fake-chat",
        "messages": [{"role": "user", "content": "stream please"}],
        "stream": True,
    }
    connection.request("POST", "/v1/chat/completions", body=json.dumps(body))
    return connection.getresponse()


def data_lines(response: http.client.HTTPResponse) -> Iterator[tuple[float, str]]:
    """(arrival time, payload) of each `data:` line, read as it arrives."""
    while line := response.readline():
        if line.startswith(b"data: "):
            yield time.monotonic(), line.removeprefix(b"data: ").decode().strip()


def test_stream_is_chunked_sse_ending_with_done(server: FakeOpenAI) -> None:
    response = stream_request(server)
    assert response.status == 200
    assert response.getheader("Content-Type", "").startswith("text/event-stream")
    assert response.getheader("Transfer-Encoding") == "chunked"
    payloads = [payload for _, payload in data_lines(response)]
    assert payloads[-1] == "[DONE]"
    chunks = [json.loads(payload) for payload in payloads[:-1]]
    assert all(chunk["object"] == "chat.completion.chunk" for chunk in chunks)
    content = "".join(chunk["choices"][0]["delta"].get("content") or "" for chunk in chunks)
    assert content.startswith("fake reply #1 to: stream please")
    assert len(content.split()) == 10
    assert chunks[-1]["choices"][0]["finish_reason"] == "stop"


def test_chunk_delay_paces_the_content_chunks(server: FakeOpenAI) -> None:
    server.chunk_delay = 0.1
    started = time.monotonic()
    arrivals = [
        at
        for at, payload in data_lines(stream_request(server))
        if payload != "[DONE]" and json.loads(payload)["choices"][0]["delta"].get("content")
    ]
    assert len(arrivals) == 5  # ten words, two per chunk
    # Each content chunk waits chunk_delay before it is sent, so the k-th cannot arrive sooner
    # than k delays after the request: lower bounds only, which load cannot break.
    for number, at in enumerate(arrivals, start=1):
        assert at - started >= number * 0.1 - 0.005, (number, at - started)
