"""The stream_disconnect log line carries the request's id, like every other line of a request:
the stream is written after the response left RequestIdMiddleware, which had reset the id."""

from __future__ import annotations

import http.client
import json
import logging
from typing import Any
from urllib.parse import urlsplit

import pytest

from tests.fake_openai import FakeOpenAI
from tests.test_request_id import Lines
from tests.test_streaming_turns import (  # noqa: F401  (fixtures)
    DEADLINE,
    Stream,
    _turn_threads_finish,
    eventually,
    new_chat,
    server_url,
    slot_free,
    token,
    uvicorn_url,
)

pytestmark = pytest.mark.django_db(transaction=True)


def streamed_turn(url_of: str, key: str, chat_id: int, request_id: str) -> Stream:
    url = urlsplit(url_of)
    connection = http.client.HTTPConnection(url.hostname or "", url.port, timeout=DEADLINE)
    connection.request(
        "POST",
        f"/api/v1/chats/{chat_id}/turns/",
        body=json.dumps({"content": "a long answer please", "stream": True}),
        headers={
            "Authorization": f"Token {key}",
            "Content-Type": "application/json",
            "Accept": "text/event-stream",
            "X-Request-ID": request_id,
        },
    )
    return Stream(connection)


def test_the_disconnect_line_has_the_request_id(
    api: Any,
    server_url: str,  # noqa: F811  (the fixture, imported above)
    token: str,  # noqa: F811
    use_fake_openai: FakeOpenAI,
) -> None:
    use_fake_openai.chunk_delay = 0.05
    use_fake_openai.reply_words = 40  # about a second of streaming
    lines = Lines()  # formats each record as it is logged, on the server's thread
    logger = logging.getLogger("chatmem.turn")
    logger.addHandler(lines)
    try:
        chat_id = new_chat(api)
        stream = streamed_turn(server_url, token, chat_id, "stream-req-7")
        assert stream.response.getheader("X-Request-ID") == "stream-req-7"
        events = stream.events()
        assert next(events).name == "accepted"
        stream.hang_up()
        disconnect = eventually(
            lambda: [line for line in lines.lines if line.get("event") == "stream_disconnect"],
            "the server notices the disconnect",
        )[0]
        eventually(lambda: slot_free(chat_id), "the turn is stored and its slot released")
    finally:
        logger.removeHandler(lines)
    assert disconnect["chat_id"] == chat_id
    assert disconnect.get("request_id") == "stream-req-7", disconnect
