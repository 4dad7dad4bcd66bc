"""The turn's chat model (docs/design.md, the turn, step 5): the OpenAI-compatible model against a
scripted HTTP server (real openai client, real HTTP, JSON and server-sent events), and the offline
model. No database, no Django."""

import socket
import subprocess
import sys
import time
from collections.abc import Callable
from typing import Any

import pytest

from conversations.chat_model import openai_backend as openai_chat_model
from conversations.chat_model.contract import ChatCompletion, ModelError
from conversations.chat_model.offline_backend import OfflineChatModel
from conversations.chat_model.openai_backend import OpenAIChatModel
from conversations.chat_model.tokens import count_tokens
from conversations.chat_model.transport import make_openai_client
from conversations.services.chat_backend import chat_backend_name, get_chat_model
from memory_worker.summaries.backends import summarizer_backend_name
from tests.support.fake_openai import FakeOpenAI

# The scripted server lives with the summarizer tests; both suites talk to it the same way.
from tests.test_summarizers import (
    API_KEY,
    RATE_LIMITED,
    SERVER_ERROR,
    Reply,
    ScriptedServer,
    chat_reply,
    error_reply,
    server_fixture,  # noqa: F401  (the "server" fixture: pytest finds it in this module)
)

MESSAGES = [
    {"role": "system", "content": "You are a piano teacher."},
    {"role": "user", "content": "How long should I practise?"},
]


def openai_model(server: ScriptedServer, timeout: float = 5.0) -> OpenAIChatModel:
    client = make_openai_client(base_url=server.base_url, api_key=API_KEY, timeout=timeout)
    return OpenAIChatModel(client=client, timeout=timeout)


def chunk(
    content: str | None = None,
    finish_reason: str | None = None,
    usage: tuple[int, int] | None = None,
) -> dict[str, Any]:
    event: dict[str, Any] = {
        "id": "chatcmpl-1",
        "object": "chat.completion.chunk",
        "created": 0,
        "model": "gpt-test-2025",
        "choices": [],
    }
    if content is not None or finish_reason is not None:
        delta = {"role": "assistant", "content": content}
        event["choices"] = [{"index": 0, "delta": delta, "finish_reason": finish_reason}]
    if usage:
        event["usage"] = {
            "prompt_tokens": usage[0],
            "completion_tokens": usage[1],
            "total_tokens": sum(usage),
        }
    return event


HELLO_EVENTS: list[dict[str, Any] | float] = [
    chunk("Hel"),
    chunk("lo"),
    chunk(" world"),
    chunk(finish_reason="stop"),
    chunk(usage=(31, 3)),
]

# ---------------------------------------------------------------------------------------------
# complete()


def test_complete_returns_content_finish_reason_usage_and_model(server: ScriptedServer) -> None:
    server.script(chat_reply("Twenty minutes a day.", usage=(31, 6)))
    completion = openai_model(server).complete(MESSAGES, "gpt-test")
    assert completion == ChatCompletion("Twenty minutes a day.", "stop", 31, 6, "gpt-test")
    [request] = server.requests
    assert request.body["model"] == "gpt-test"
    assert request.body["messages"] == MESSAGES
    assert "stream" not in request.body


def test_a_reply_cut_by_length_is_still_a_reply(server: ScriptedServer) -> None:
    server.script(chat_reply("Twenty minutes a", finish_reason="length"))
    completion = openai_model(server).complete(MESSAGES, "gpt-test")
    assert (completion.content, completion.finish_reason) == ("Twenty minutes a", "length")


def test_a_refusal_is_shown_as_the_reply(server: ScriptedServer) -> None:
    server.script(chat_reply(None, refusal="I can't help with that."))
    assert openai_model(server).complete(MESSAGES, "m").content == "I can't help with that."


def test_missing_usage_is_counted_locally(server: ScriptedServer) -> None:
    server.script(chat_reply("Twenty minutes a day.", usage=None))
    completion = openai_model(server).complete(MESSAGES, "gpt-4")
    assert completion.prompt_tokens == sum(count_tokens(m["content"], "gpt-4") for m in MESSAGES)
    assert completion.completion_tokens == count_tokens("Twenty minutes a day.", "gpt-4")


@pytest.mark.parametrize(
    ("reply", "words"),
    [
        (chat_reply(""), "empty reply"),
        (chat_reply("   "), "empty reply"),
        (chat_reply(None, finish_reason="content_filter"), "content filter"),
    ],
)
def test_an_empty_reply_is_a_502(server: ScriptedServer, reply: Reply, words: str) -> None:
    server.script(reply)
    with pytest.raises(ModelError) as caught:
        openai_model(server).complete(MESSAGES, "m")
    assert caught.value.status == 502
    assert words in str(caught.value)


@pytest.mark.parametrize(
    ("reply", "words"),
    [
        (SERVER_ERROR, "HTTP 500"),
        (RATE_LIMITED, "HTTP 429, rate_limit_exceeded"),
        (error_reply(404, "The model does not exist", "invalid_request_error"), "HTTP 404"),
    ],
)
def test_upstream_errors_are_502(server: ScriptedServer, reply: Reply, words: str) -> None:
    server.script(reply)
    with pytest.raises(ModelError) as caught:
        openai_model(server).complete(MESSAGES, "m")
    assert caught.value.status == 502
    assert words in str(caught.value)
    assert len(server.requests) == 1  # no hidden client retries: the turn fails fast


def test_error_message_for_the_client_carries_no_secret(server: ScriptedServer) -> None:
    server.script(
        error_reply(401, f"Incorrect API key provided: {API_KEY}", "invalid_request_error")
    )
    with pytest.raises(ModelError) as caught:
        openai_model(server).complete(MESSAGES, "m")
    assert caught.value.status == 502
    assert str(caught.value) == "The model endpoint returned an error (HTTP 401)."


def test_a_timeout_is_a_504(server: ScriptedServer) -> None:
    # The server would answer after 10 s (its daemon handler thread never holds up shutdown):
    # a call that waited for the answer could not pass the bound below, however slow the machine.
    server.script(Reply(delay=10.0, body=chat_reply("late").body))
    started = time.monotonic()
    with pytest.raises(ModelError) as caught:
        openai_model(server, timeout=0.3).complete(MESSAGES, "m")
    assert caught.value.status == 504
    assert "0.3 seconds" in str(caught.value)
    assert time.monotonic() - started < 5.0
    assert len(server.requests) == 1  # no hidden retry


# A context with everything a turn can carry: a tool offered, a tool call and its result.
TOOL_CONTEXT: list[dict[str, Any]] = [
    *MESSAGES,
    {
        "role": "assistant",
        "content": None,
        "tool_calls": [
            {
                "id": "call_1",
                "type": "function",
                "function": {"name": "metronome", "arguments": '{"bpm": 60}'},
            }
        ],
    },
    {"role": "tool", "tool_call_id": "call_1", "content": "set to 60"},
    {"role": "user", "content": "And then?"},
]
# The same messages for the SDK's typed parameter (plain dicts are what its TypedDicts are).
SDK_MESSAGES: Any = TOOL_CONTEXT
TOOL_OPTIONS: dict[str, Any] = {
    "tools": [
        {
            "type": "function",
            "function": {
                "name": "metronome",
                "parameters": {"type": "object", "properties": {"bpm": {"type": "integer"}}},
            },
        }
    ],
    "tool_choice": "auto",
}


@pytest.mark.parametrize("streamed", [False, True])
def test_requests_are_what_the_sdks_create_sends(server: ScriptedServer, streamed: bool) -> None:
    """The turn posts its body past the SDK's parameter transform (see create_chat_completion);
    the request on the wire must stay byte-for-byte what ``chat.completions.create`` sends:
    same path, JSON body and authorization."""
    client = make_openai_client(base_url=server.base_url, api_key=API_KEY, timeout=5.0)
    model = OpenAIChatModel(client=client, timeout=5.0)
    extra: dict[str, Any] = {"stream": True, "stream_options": {"include_usage": True}}
    if streamed:
        server.script(Reply(events=HELLO_EVENTS), Reply(events=HELLO_EVENTS))
        list(
            client.chat.completions.create(
                model="m", messages=SDK_MESSAGES, **extra, **TOOL_OPTIONS
            )
        )
        list(model.stream(TOOL_CONTEXT, "m", TOOL_OPTIONS))
    else:
        server.script(chat_reply("Twice."), chat_reply("Twice."))
        client.chat.completions.create(model="m", messages=SDK_MESSAGES, **TOOL_OPTIONS)
        assert model.complete(TOOL_CONTEXT, "m", TOOL_OPTIONS).content == "Twice."
    sdk, ours = server.requests
    assert ours.path == sdk.path == "/v1/chat/completions"
    assert ours.body == sdk.body
    assert ours.headers["authorization"] == sdk.headers["authorization"] == f"Bearer {API_KEY}"
    assert ours.headers["content-type"] == sdk.headers["content-type"]


# prompt_cache_key refused: how vLLM/FastAPI (422, the field in ``loc``) and OpenAI (400, the
# field in the message) answer a parameter they do not take.
KEY_REFUSED_422 = Reply(
    status=422,
    body={
        "detail": [
            {
                "type": "extra_forbidden",
                "loc": ["body", "prompt_cache_key"],
                "msg": "Extra inputs are not permitted",
            }
        ]
    },
)
# A 400 for something else that echoes the request's parameters, the key among them.
ECHOING_400 = error_reply(
    400,
    "Invalid 'temperature' for this model; request: {'prompt_cache_key': 'k', 'temperature': 3}",
    "invalid_request_error",
)
CACHE_KEY = {"prompt_cache_key": "chatmem-chat-1"}


def call_with_key(server: ScriptedServer, model: OpenAIChatModel, how: str, name: str = "m") -> str:
    server.script(Reply(events=HELLO_EVENTS) if how == "stream" else chat_reply("Hello world"))
    return call_scripted(model, how, name)


def call_scripted(model: OpenAIChatModel, how: str, name: str = "m") -> str:
    if how == "stream":
        stream = model.stream(MESSAGES, name, CACHE_KEY)
        return "".join(stream)
    return model.complete(MESSAGES, name, CACHE_KEY).content


def keyed(server: ScriptedServer) -> list[bool]:
    return ["prompt_cache_key" in request.body for request in server.requests]


@pytest.mark.parametrize("how", ["direct", "sdk", "stream"])
def test_a_refused_cache_key_is_dropped_for_that_model_once_the_request_passes_without_it(
    server: ScriptedServer, how: str
) -> None:
    """The same request is sent again without the key; once that one is answered, the model
    is never sent the key again; another model of the endpoint still is."""
    client = make_openai_client(base_url=server.base_url, api_key=API_KEY, timeout=5.0)
    model = OpenAIChatModel(client=client, timeout=5.0, direct=how == "direct")
    server.script(KEY_REFUSED_422)
    assert call_with_key(server, model, how) == "Hello world"
    assert keyed(server) == [True, False]
    assert server.requests[0].body["messages"] == server.requests[1].body["messages"]
    assert call_with_key(server, model, how) == "Hello world"
    assert call_with_key(server, model, how, name="other") == "Hello world"
    assert keyed(server) == [True, False, False, True]


@pytest.mark.parametrize("how", ["direct", "sdk", "stream"])
def test_an_error_that_only_echoes_the_cache_key_fails_the_call_and_keeps_the_key(
    server: ScriptedServer, how: str
) -> None:
    """A 400 naming the key among the request's parameters, for something else: the request
    without the key fails the same way, the call fails with that error, and the key is still
    sent next time."""
    client = make_openai_client(base_url=server.base_url, api_key=API_KEY, timeout=5.0)
    model = OpenAIChatModel(client=client, timeout=5.0, direct=how == "direct")
    server.script(ECHOING_400, ECHOING_400)
    with pytest.raises(ModelError) as caught:
        call_scripted(model, how)
    assert "HTTP 400" in str(caught.value)
    assert call_with_key(server, model, how) == "Hello world"
    assert keyed(server) == [True, False, True]


# ---------------------------------------------------------------------------------------------
# stream()


def test_stream_yields_deltas_then_holds_the_completion(server: ScriptedServer) -> None:
    server.script(Reply(events=HELLO_EVENTS))
    stream = openai_model(server).stream(MESSAGES, "gpt-test")
    assert stream.result is None
    assert list(stream) == ["Hel", "lo", " world"]
    assert stream.result == ChatCompletion("Hello world", "stop", 31, 3, "gpt-test-2025")
    [request] = server.requests
    assert request.body["stream"] is True
    assert request.body["stream_options"] == {"include_usage": True}


def test_stream_without_usage_counts_locally(server: ScriptedServer) -> None:
    server.script(Reply(events=HELLO_EVENTS[:-1]))
    stream = openai_model(server).stream(MESSAGES, "gpt-4")
    assert "".join(stream) == "Hello world"
    assert stream.result is not None
    assert stream.result.completion_tokens == count_tokens("Hello world", "gpt-4")


def test_stream_request_failure_raises_before_any_delta(server: ScriptedServer) -> None:
    server.script(SERVER_ERROR)
    with pytest.raises(ModelError) as caught:
        openai_model(server).stream(MESSAGES, "m")
    assert caught.value.status == 502


def test_an_error_event_mid_stream_raises_after_the_deltas_so_far(server: ScriptedServer) -> None:
    error_event = {"error": {"message": "overloaded", "type": "server_error", "code": "overloaded"}}
    server.script(Reply(events=[chunk("Hel"), error_event]))
    stream = openai_model(server).stream(MESSAGES, "m")
    received = []
    with pytest.raises(ModelError) as caught:
        for delta in stream:
            received.append(delta)
    assert received == ["Hel"]
    assert caught.value.status == 502
    assert "overloaded" in str(caught.value)
    assert stream.result is None


@pytest.mark.parametrize(
    "error",
    [
        # llama.cpp's server
        {
            "code": 400,
            "message": "the request exceeds the available context size, try increasing it",
            "type": "exceed_context_size_error",
        },
        # OpenAI, vLLM
        {
            "message": "This model's maximum context length is 8192 tokens.",
            "type": "invalid_request_error",
            "code": "context_length_exceeded",
        },
    ],
)
def test_an_error_event_saying_the_prompt_exceeds_the_window_is_not_retryable(
    server: ScriptedServer, error: dict[str, Any]
) -> None:
    server.script(Reply(events=[{"error": error}]))
    stream = openai_model(server).stream(MESSAGES, "m")
    with pytest.raises(ModelError) as caught:
        list(stream)
    assert (caught.value.status, caught.value.retryable) == (502, False)
    assert "longer than its context window" in str(caught.value)
    assert error["message"] in str(caught.value)


def test_an_error_event_says_why_the_server_stopped_and_stays_retryable(
    server: ScriptedServer,
) -> None:
    error_event = {"error": {"message": "slot unavailable", "type": "server_error"}}
    server.script(Reply(events=[chunk("Hel"), error_event]))
    with pytest.raises(ModelError) as caught:
        list(openai_model(server).stream(MESSAGES, "m"))
    assert caught.value.retryable
    assert "stopped the reply with an error. It said: slot unavailable" in str(caught.value)


def test_a_400_saying_the_prompt_exceeds_the_window_says_so(server: ScriptedServer) -> None:
    body = {
        "error": {
            "code": 400,
            "message": "the request exceeds the available context size, try increasing it",
            "type": "exceed_context_size_error",
        }
    }
    server.script(Reply(status=400, body=body))
    with pytest.raises(ModelError) as caught:
        openai_model(server).complete(MESSAGES, "m")
    assert not caught.value.retryable
    assert "longer than its context window; sending it again cannot help" in str(caught.value)


def test_a_stream_cut_before_its_finish_is_a_502(server: ScriptedServer) -> None:
    server.script(Reply(events=[chunk("Hel"), chunk("lo")], done=False))
    stream = openai_model(server).stream(MESSAGES, "m")
    with pytest.raises(ModelError) as caught:
        list(stream)
    assert caught.value.status == 502
    # The server ended the stream itself: told apart from a broken connection.
    assert "ended its reply stream before the reply was complete" in str(caught.value)
    assert "without saying why" in str(caught.value)


def test_a_connection_broken_mid_stream_is_a_502(server: ScriptedServer) -> None:
    server.script(Reply(events=[chunk("Hel")], done=False, abort=True))
    stream = openai_model(server).stream(MESSAGES, "m")
    with pytest.raises(ModelError) as caught:
        list(stream)
    assert caught.value.status == 502
    assert "broke during the reply (a network failure" in str(caught.value)


def test_an_unreachable_endpoint_is_a_502() -> None:
    with socket.socket() as probe:
        probe.bind(("127.0.0.1", 0))
        port = probe.getsockname()[1]
    client = make_openai_client(f"http://127.0.0.1:{port}/v1", API_KEY, timeout=2.0)
    with pytest.raises(ModelError) as caught:
        OpenAIChatModel(client, timeout=2.0).complete(MESSAGES, "m")
    assert caught.value.status == 502
    assert str(caught.value) == "Could not connect to the model endpoint."


def test_a_stream_that_stalls_is_a_504(server: ScriptedServer) -> None:
    server.script(Reply(events=[chunk("Hel"), 1.0, chunk(finish_reason="stop")]))
    stream = openai_model(server, timeout=0.3).stream(MESSAGES, "m")
    with pytest.raises(ModelError) as caught:
        list(stream)
    assert caught.value.status == 504


def test_an_empty_stream_is_a_502(server: ScriptedServer) -> None:
    server.script(Reply(events=[chunk(""), chunk(finish_reason="stop"), chunk(usage=(5, 0))]))
    with pytest.raises(ModelError) as caught:
        list(openai_model(server).stream(MESSAGES, "m"))
    assert caught.value.status == 502


@pytest.mark.parametrize("deltas_read", [0, 1])
def test_closing_a_stream_early_releases_the_connection_once(
    server: ScriptedServer, monkeypatch: pytest.MonkeyPatch, deltas_read: int
) -> None:
    """close() releases the upstream response exactly once, also for a stream never iterated
    (its generator's own cleanup never runs). The release the model hands the stream is wrapped
    to record its calls; the generator's own close of the response is not counted."""
    released: list[object] = []

    class RecordingStream(openai_chat_model.CompletionStream):
        def __init__(self, deltas: Any, release: Callable[[], object] | None = None) -> None:
            assert release is not None, "the model handed the stream no release"

            def recording_release() -> object:
                released.append(release)
                return release()

            super().__init__(deltas, release=recording_release)

    monkeypatch.setattr(openai_chat_model, "CompletionStream", RecordingStream)
    server.script(Reply(events=HELLO_EVENTS))
    stream = openai_model(server).stream(MESSAGES, "m")
    assert [next(stream) for _ in range(deltas_read)] == ["Hel"][:deltas_read]
    assert released == []
    stream.close()
    assert len(released) == 1
    with pytest.raises(StopIteration):
        next(stream)
    assert len(released) == 1


# ---------------------------------------------------------------------------------------------
# Offline model


def test_offline_reply_is_deterministic_and_marked() -> None:
    model = OfflineChatModel()
    completion = model.complete(MESSAGES, "gpt-test")
    assert completion.content == (
        "[offline model] You said: How long should I practise? "
        "(Context: 2 messages, summary present: no.)"
    )
    assert completion == model.complete(MESSAGES, "gpt-test")
    assert completion.finish_reason == "stop"
    assert completion.prompt_tokens == sum(count_tokens(m["content"], "gpt-test") for m in MESSAGES)
    assert completion.completion_tokens == count_tokens(completion.content, "gpt-test")


def test_offline_sees_the_summary_and_echoes_at_most_200_chars() -> None:
    messages = [
        {"role": "system", "content": "Summary of the earlier conversation (memory):\n\n- x"},
        {"role": "user", "content": "a" * 500},
    ]
    content = OfflineChatModel().complete(messages, "m").content
    assert f"You said: {'a' * 200}. " in content
    assert "a" * 201 not in content
    assert content.endswith("(Context: 2 messages, summary present: yes.)")


def test_offline_without_a_user_message() -> None:
    content = OfflineChatModel().complete([], "").content
    assert content.startswith("[offline model] You said: (nothing).")


def test_offline_streams_word_by_word() -> None:
    model = OfflineChatModel()
    stream = model.stream(MESSAGES, "m")
    deltas = list(stream)
    assert len(deltas) > 5
    assert all(delta.strip() for delta in deltas)
    assert "".join(deltas) == model.complete(MESSAGES, "m").content
    assert stream.result == model.complete(MESSAGES, "m")


def test_model_modules_do_not_import_django() -> None:
    code = (
        "import sys, conversations.chat_model.openai_backend,"
        " conversations.chat_model.offline_backend,"
        " memory_worker.summaries.chat_completions, memory_worker.summaries.responses\n"
        "assert not [m for m in sys.modules if m.split('.')[0] == 'django'], 'django imported'\n"
    )
    subprocess.run([sys.executable, "-c", code], check=True, timeout=60)


def test_a_base_url_without_a_key_is_a_local_server_not_the_echo_model(settings: Any) -> None:
    """Ollama, vLLM and llama.cpp need no key: with OPENAI_BASE_URL alone, turns went to the
    offline echo model without a word."""
    settings.CHAT_BACKEND, settings.MEMORY_SUMMARIZER_BACKEND = "", ""
    settings.OPENAI_API_KEY = ""
    with FakeOpenAI() as server:
        settings.OPENAI_BASE_URL = server.base_url
        assert (chat_backend_name(), summarizer_backend_name()) == ("openai", "chat")
        completion = get_chat_model().complete([{"role": "user", "content": "hi"}], "fake-chat")
        assert completion.content.startswith("fake reply #1")
    settings.OPENAI_BASE_URL = None
    assert (chat_backend_name(), summarizer_backend_name()) == ("offline", "offline")
