"""The fake OpenAI server, driven by the official ``openai`` SDK so its wire formats are proven
against the parser chatmem really uses. No Django, no database."""

from __future__ import annotations

import contextlib
import os
import signal
import subprocess
import sys
import threading
import time
from collections.abc import Iterator
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path
from types import SimpleNamespace
from typing import Any

import openai
import pytest
from hypothesis import given
from hypothesis import strategies as st
from openai.types.chat import ChatCompletionMessageParam, ChatCompletionToolParam
from openai.types.responses import ResponsePromptParam

from memory_worker.summaries.contract import FoldMessage, format_fold_input, summary_instructions
from tests.support.fake_openai import (
    PADDING,
    SUMMARY_HEADINGS,
    FakeOpenAI,
    cacheable,
    common_start,
    summary_text,
)

REPO_ROOT = Path(__file__).resolve().parent.parent

SUMMARIZER_INPUT = format_fold_input(
    "## Facts / Constraints\n- The user plays the cello.",
    [
        FoldMessage(1, "user", "I want to learn the Bach prelude in G major by June"),
        FoldMessage(2, "assistant", "Practice the first eight bars slowly with a metronome at 60."),
        FoldMessage(3, "user", "Should I use vibrato on the long notes?"),
        FoldMessage(
            4,
            "assistant",
            "Not yet; keep the tone straight and even, see bowing.md for the exercise.",
        ),
    ],
)


@pytest.fixture
def settings() -> SimpleNamespace:
    # conftest.py's autouse fixture asks for pytest-django's `settings`; this file runs with
    # `-p no:django`, so a throwaway namespace absorbs what it sets.
    return SimpleNamespace()


@pytest.fixture
def server() -> Iterator[FakeOpenAI]:
    with FakeOpenAI() as fake:
        yield fake


@pytest.fixture
def client(server: FakeOpenAI) -> openai.OpenAI:
    return make_client(server)


def make_client(server: FakeOpenAI, **options: Any) -> openai.OpenAI:
    options = {"api_key": "test", "max_retries": 0, **options}
    return openai.OpenAI(base_url=server.base_url, **options)


def ask(client: openai.OpenAI, text: str = "hello there", **extra: Any) -> Any:
    """A one-message chat completion (a Stream when ``stream=True`` is passed)."""
    messages: list[ChatCompletionMessageParam] = [{"role": "user", "content": text}]
    return client.chat.completions.create(model="fake-chat", messages=messages, **extra)


def summarize(client: openai.OpenAI, fold_input: str = SUMMARIZER_INPUT) -> Any:
    """A summarizer call as chatmem's chat-completions summarizer backend makes it."""
    messages: list[ChatCompletionMessageParam] = [
        {"role": "system", "content": "Rewrite the summary."},
        {"role": "user", "content": fold_input},
    ]
    return client.chat.completions.create(model="fake-summarizer", messages=messages)


# -- chat completions ------------------------------------------------------------------------------


def test_chat_completion_is_deterministic_with_usage(client: openai.OpenAI) -> None:
    completion = ask(client, "hello there")

    choice = completion.choices[0]
    assert choice.message.content == "fake reply #1 to: hello there"
    assert choice.finish_reason == "stop"
    assert completion.usage is not None
    assert completion.usage.prompt_tokens == len("hello there") // 4 + 4
    assert completion.usage.completion_tokens == len(choice.message.content) // 4
    assert ask(client, "again").choices[0].message.content == "fake reply #2 to: again"


def test_stream_deltas_join_to_the_full_reply(server: FakeOpenAI, client: openai.OpenAI) -> None:
    server.reply_words = 40
    expected = ask(client, "stream me").choices[0].message.content
    server.reset()  # so the streamed reply is #1 again

    stream = ask(client, "stream me", stream=True, stream_options={"include_usage": True})
    chunks = list(stream)

    deltas = [
        c.choices[0].delta.content for c in chunks if c.choices and c.choices[0].delta.content
    ]
    assert "".join(deltas) == expected
    assert len(expected.split()) == 40 and len(deltas) > 5
    assert chunks[0].choices[0].delta.role == "assistant"
    assert [c.choices[0].finish_reason for c in chunks if c.choices][-1] == "stop"
    assert chunks[-1].choices == [] and chunks[-1].usage is not None
    assert chunks[-1].usage.completion_tokens == len(expected) // 4


def test_streamed_truncation_finishes_with_length(
    server: FakeOpenAI, client: openai.OpenAI
) -> None:
    server.queue_faults("chat", ["truncated"])

    chunks = list(ask(client, "cut me short please", stream=True))

    text = "".join(c.choices[0].delta.content or "" for c in chunks)
    full = "fake reply #1 to: cut me short please"
    assert text == full[: len(full) // 2]
    assert chunks[-1].choices[0].finish_reason == "length"


def test_reply_fn_overrides_chat_replies(server: FakeOpenAI, client: openai.OpenAI) -> None:
    server.reply_fn = lambda body: f"{len(body['messages'])} message(s)"

    assert ask(client).choices[0].message.content == "1 message(s)"


TOOLS: list[ChatCompletionToolParam] = [
    {"type": "function", "function": {"name": "get_weather", "parameters": {}}}
]


def test_tool_call_round_trip(client: openai.OpenAI) -> None:
    first = ask(client, "Weather? CALL_TOOL:get_weather", tools=TOOLS)

    choice = first.choices[0]
    assert choice.finish_reason == "tool_calls"
    call = choice.message.tool_calls[0]
    assert (call.id, call.function.name, call.function.arguments) == ("call_1", "get_weather", "{}")

    messages = [
        {"role": "user", "content": "Weather? CALL_TOOL:get_weather"},
        choice.message.model_dump(exclude_none=True),
        {"role": "tool", "tool_call_id": call.id, "content": "sunny"},
    ]
    second: Any = client.chat.completions.create(model="fake-chat", messages=messages, tools=TOOLS)
    assert second.choices[0].finish_reason == "stop"
    assert second.choices[0].message.content.startswith("fake reply #2")


def test_streamed_tool_call(client: openai.OpenAI) -> None:
    chunks = list(ask(client, "CALL_TOOL:lookup please", tools=TOOLS, stream=True))

    calls = [call for c in chunks for call in (c.choices[0].delta.tool_calls or [])]
    assert calls[0].id == "call_1" and calls[0].function.name == "lookup"
    assert "".join(call.function.arguments or "" for call in calls) == "{}"
    assert chunks[-1].choices[0].finish_reason == "tool_calls"


def test_tool_marker_without_tools_is_plain_text(client: openai.OpenAI) -> None:
    completion = ask(client, "CALL_TOOL:get_weather")

    assert completion.choices[0].message.tool_calls is None
    assert completion.choices[0].finish_reason == "stop"


# -- summarize requests and recording --------------------------------------------------------------


def test_summarize_request_is_classified_and_recorded(
    server: FakeOpenAI, client: openai.OpenAI
) -> None:
    ask(client, "plain chat")
    summary = summarize(client).choices[0].message.content or ""

    assert [r.kind for r in server.requests] == ["chat", "summarize"]
    record = server.summarize_requests()[0]
    assert record["path"] == "/chat/completions"
    assert record.body["model"] == "fake-summarizer"
    assert record.headers["authorization"] == "Bearer test"
    assert record.fault is None and record.received_at <= time.monotonic()
    assert "Turn 2:\nUser: " in record.text
    assert len(server.chat_requests()) == 1
    assert server.counters()["summarize"] == 1

    for heading in SUMMARY_HEADINGS:
        assert f"## {heading}" in summary
    assert "- The user plays the cello." in summary  # the existing summary is carried over
    assert "User: I want to learn the Bach prelude" in summary
    assert "bowing.md" in summary


def test_content_parts_are_read_for_classification(
    server: FakeOpenAI, client: openai.OpenAI
) -> None:
    parts: Any = [{"type": "text", "text": SUMMARIZER_INPUT}]

    client.chat.completions.create(
        model="fake-summarizer", messages=[{"role": "user", "content": parts}]
    )

    assert server.counters()["summarize"] == 1


def test_summarize_latency_only_slows_summaries(server: FakeOpenAI, client: openai.OpenAI) -> None:
    # The chat request is bounded at half the summaries' latency: a round trip that also slept
    # the summarize latency could not pass, however slow the machine is otherwise.
    server.summarize_latency = 1.0

    started = time.monotonic()
    ask(client)
    chat_seconds = time.monotonic() - started
    summarize(client)
    summarize_seconds = time.monotonic() - started - chat_seconds

    assert chat_seconds < 0.5 <= 1.0 <= summarize_seconds


def test_summary_respects_the_word_cap(server: FakeOpenAI, client: openai.OpenAI) -> None:
    server.summary_cap_words = 40

    summary = summarize(client).choices[0].message.content or ""

    assert len(summary.split()) <= 40
    assert "Not yet" in summary  # the newest facts survive; the oldest are dropped first


def test_reset_forgets_requests(server: FakeOpenAI, client: openai.OpenAI) -> None:
    ask(client)
    server.reset()

    assert server.requests == [] and server.counters()["total"] == 0
    assert ask(client).choices[0].message.content.startswith("fake reply #1")


def test_wait_for_polls_until_true_or_deadline(server: FakeOpenAI, client: openai.OpenAI) -> None:
    threading.Timer(0.1, ask, args=(client,)).start()

    assert server.wait_for(lambda: len(server.chat_requests()) == 1, timeout=5)
    assert server.wait_for(lambda s: s.counters()["chat"] == 1, timeout=1)
    assert not server.wait_for(lambda: False, timeout=0.05)


# -- Responses API ---------------------------------------------------------------------------------


PROMPT: ResponsePromptParam = {"id": "pmpt_summary", "version": "3"}


def test_responses_api_with_hosted_prompt(server: FakeOpenAI, client: openai.OpenAI) -> None:
    response = client.responses.create(prompt=PROMPT, input=SUMMARIZER_INPUT)

    assert response.status == "completed"
    assert "## Decisions" in response.output_text
    assert response.usage is not None and response.usage.input_tokens > 0
    record = server.summarize_requests()[0]
    assert record.path == "/responses" and record.body["prompt"] == PROMPT


def test_responses_api_chat_kind(server: FakeOpenAI, client: openai.OpenAI) -> None:
    response = client.responses.create(model="fake-chat", input="just chatting")

    assert response.output_text == "fake reply #1 to: just chatting"
    assert server.chat_requests()[0].path == "/responses"


def test_responses_truncated_and_refused(server: FakeOpenAI, client: openai.OpenAI) -> None:
    server.queue_faults("summarize", ["truncated", "refusal"])

    truncated, refused, complete = (
        client.responses.create(prompt=PROMPT, input=SUMMARIZER_INPUT) for _ in range(3)
    )

    assert truncated.status == "incomplete"
    assert truncated.incomplete_details is not None
    assert truncated.incomplete_details.reason == "max_output_tokens"
    assert truncated.output_text == complete.output_text[: len(complete.output_text) // 2]
    assert refused.output_text == ""
    message: Any = refused.output[0]
    assert message.content[0].refusal == "I can't help with that"


def test_models_list(client: openai.OpenAI) -> None:
    assert [m.id for m in client.models.list()] == [
        "fake-chat",
        "fake-mini",
        "fake-deep",
        "fake-summarizer",
    ]


# -- faults ----------------------------------------------------------------------------------------


@pytest.mark.parametrize(
    ("fault", "error", "code"),
    [
        ("429", openai.RateLimitError, "rate_limit_exceeded"),
        ("insufficient_quota", openai.RateLimitError, "insufficient_quota"),
        ("500", openai.InternalServerError, None),
        ("400", openai.BadRequestError, None),
        ("content_filter", openai.BadRequestError, "content_filter"),
    ],
)
def test_http_faults_raise_sdk_errors(
    server: FakeOpenAI,
    client: openai.OpenAI,
    fault: str,
    error: type[openai.APIStatusError],
    code: str | None,
) -> None:
    server.queue_faults("chat", [fault])

    with pytest.raises(error) as raised:
        ask(client)

    assert raised.value.code == code
    assert server.requests[0].fault == fault
    assert server.counters()["faults"] == {fault: 1}


def test_a_refused_marker_fails_only_the_summaries_holding_it(
    server: FakeOpenAI, client: openai.OpenAI
) -> None:
    server.refuse_summaries_containing("FORBIDDEN-WORD")
    server.queue_faults("summarize", ["500"])
    poisoned = format_fold_input("", [FoldMessage(1, "user", "say FORBIDDEN-WORD twice")])

    with pytest.raises(openai.BadRequestError) as refused:
        summarize(client, poisoned)
    # The queued fault is left for the next summary without the marker.
    with pytest.raises(openai.InternalServerError):
        summarize(client)
    assert summarize(client).choices[0].message.content
    assert ask(client, "chat about FORBIDDEN-WORD").choices[0].message.content  # a chat request

    assert refused.value.code == "content_filter"
    assert [r.fault for r in server.requests] == ["content_filter", "500", None, None]
    server.clear_faults()
    assert summarize(client, poisoned).choices[0].message.content


@pytest.mark.parametrize(
    ("fault", "code", "error_type"),
    [
        ("context_length_exceeded", "context_length_exceeded", "invalid_request_error"),
        ("context_exceeded", "400", "exceed_context_size_error"),  # the SDK reads it as text
    ],
)
def test_a_too_large_marker_fails_only_the_summaries_holding_it_with_a_context_error(
    server: FakeOpenAI, client: openai.OpenAI, fault: str, code: object, error_type: str
) -> None:
    server.too_large_summaries_containing("HUGE-TEXT", fault=fault)
    large = format_fold_input("", [FoldMessage(1, "user", "HUGE-TEXT and more")])

    with pytest.raises(openai.BadRequestError) as refused:
        summarize(client, large)
    assert summarize(client).choices[0].message.content
    assert (refused.value.code, refused.value.type) == (code, error_type)
    server.clear_faults()
    assert summarize(client, large).choices[0].message.content


def test_timeout_fault_times_the_client_out(server: FakeOpenAI) -> None:
    server.timeout_sleep = 1.5
    server.queue_faults("chat", ["timeout"])

    with pytest.raises(openai.APITimeoutError):
        ask(make_client(server, timeout=0.5))


def test_timeout_fault_answers_a_patient_client(server: FakeOpenAI) -> None:
    server.timeout_sleep = 0.2
    server.queue_faults("chat", ["timeout"])
    started = time.monotonic()

    assert ask(make_client(server, timeout=5)).choices[0].message.content
    assert time.monotonic() - started >= 0.2


def test_truncated_empty_and_refusal_answers(server: FakeOpenAI, client: openai.OpenAI) -> None:
    server.queue_faults("chat", ["truncated", "empty", "refusal"])

    truncated = ask(client, "x" * 40).choices[0]
    empty = ask(client).choices[0]
    refused = ask(client).choices[0]

    full = "fake reply #1 to: " + "x" * 40
    assert truncated.finish_reason == "length"
    assert truncated.message.content == full[: len(full) // 2]
    assert (empty.message.content, empty.finish_reason) == ("", "stop")
    assert refused.message.content is None
    assert refused.message.refusal == "I can't help with that"


def test_stream_cut_raises_during_iteration(server: FakeOpenAI, client: openai.OpenAI) -> None:
    server.queue_faults("chat", ["stream_cut"])
    received = []

    with pytest.raises(openai.APIConnectionError):
        for chunk in ask(client, "one two three four five six", stream=True):
            received.append(chunk.choices[0].delta.content)

    assert received[1:] == ["fake reply ", "#1 to: "]  # the role delta, then two deltas


def test_queued_faults_apply_in_order_then_stop(server: FakeOpenAI, client: openai.OpenAI) -> None:
    server.queue_faults("chat", ["429", "500"])
    server.queue_faults("summarize", ["400"])

    with pytest.raises(openai.RateLimitError):
        ask(client)
    with pytest.raises(openai.BadRequestError) as summarize_error:
        summarize(client)
    with pytest.raises(openai.InternalServerError):
        ask(client)
    ask(client)
    summarize(client)

    assert summarize_error.value.status_code == 400
    assert [r.fault for r in server.chat_requests()] == ["429", "500", None]
    assert [r.fault for r in server.summarize_requests()] == ["400", None]


def test_sdk_retries_quickly_after_a_429(server: FakeOpenAI) -> None:
    server.queue_faults("any", ["429"])

    completion = ask(make_client(server, max_retries=2))

    assert completion.choices[0].message.content
    rejected, retried = server.requests
    assert (rejected.fault, retried.fault) == ("429", None)
    # retry-after-ms: 10 is honoured, not the SDK's default 0.375-0.5 s first backoff.
    assert retried.received_at - rejected.received_at < 0.3


def test_probabilistic_faults_are_seeded() -> None:
    def fault_sequence(seed: int) -> list[str | None]:
        with FakeOpenAI() as fake:
            fake.set_faults("chat", rate=0.5, faults=["500", "400"], seed=seed)
            fake_client = make_client(fake)
            for _ in range(20):
                with contextlib.suppress(openai.APIStatusError):
                    ask(fake_client)
            return [r.fault for r in fake.requests]

    first = fault_sequence(seed=7)
    assert first == fault_sequence(seed=7)
    assert {None, "500", "400"} == set(first)


def test_faults_for_one_kind_spare_the_other(server: FakeOpenAI, client: openai.OpenAI) -> None:
    server.set_faults("summarize", rate=1.0, faults=["500"])

    assert ask(client).choices[0].message.content
    with pytest.raises(openai.InternalServerError):
        summarize(client)

    server.clear_faults()
    assert summarize(client).choices[0].message.content


def test_unknown_fault_names_are_rejected(server: FakeOpenAI) -> None:
    with pytest.raises(ValueError, match="unknown faults"):
        server.queue_faults("chat", ["503"])
    with pytest.raises(ValueError, match="kind"):
        server.set_faults("embeddings", rate=0.1, faults=["500"])


# -- auth, concurrency, shutdown, command line -----------------------------------------------------


def test_auth_rejects_a_wrong_key() -> None:
    with FakeOpenAI(api_key="secret") as fake:
        with pytest.raises(openai.AuthenticationError) as raised:
            ask(make_client(fake, api_key="wrong"))
        assert raised.value.code == "invalid_api_key"
        assert ask(make_client(fake, api_key="secret")).choices[0].message.content
        assert [r.fault for r in fake.requests] == ["unauthorized", None]


def test_serves_300_concurrent_requests_with_latency() -> None:
    # A latency long enough for 300 client threads to start on a loaded 2-core machine before
    # the first requests are answered.
    with FakeOpenAI(latency=3.0) as fake:
        fake_client = make_client(fake, timeout=30)
        with ThreadPoolExecutor(max_workers=300) as pool:
            replies = list(pool.map(lambda i: ask(fake_client, f"q{i}"), range(300)))

        assert all(r.choices[0].message.content for r in replies)
        assert fake.counters()["chat"] == 300
        # Concurrency itself, not a wall-clock bound: 100 requests were in their latency at once.
        assert fake.counters()["max_in_flight"] >= 100


def test_stop_interrupts_a_sleeping_timeout_fault() -> None:
    fake = FakeOpenAI(timeout_sleep=30).start()
    fake.queue_faults("chat", ["timeout"])
    fake_client = make_client(fake, timeout=60)
    outcome: list[BaseException] = []

    def call() -> None:
        try:
            ask(fake_client)
        except openai.APIError as error:
            outcome.append(error)

    caller = threading.Thread(target=call)
    caller.start()
    assert fake.wait_for(lambda: fake.counters()["in_flight"] == 1, timeout=5)

    started = time.monotonic()
    fake.stop()  # must not wait out the 30 s sleep
    caller.join(timeout=5)

    assert time.monotonic() - started < 3
    assert not caller.is_alive()
    assert isinstance(outcome[0], openai.APIConnectionError)  # the server hung up


def test_runs_standalone_until_sigterm() -> None:
    command = [
        sys.executable,
        "-m",
        "tests.support.fake_openai",
        "--port",
        "0",
        "--latency",
        "0.01",
    ]
    process = subprocess.Popen(
        command, cwd=REPO_ROOT, stdout=subprocess.PIPE, text=True, env={**os.environ}
    )
    try:
        assert process.stdout is not None
        banner = process.stdout.readline().strip()
        assert banner.startswith("listening on http://127.0.0.1:") and banner.endswith("/v1")
        base_url = banner.removeprefix("listening on ")
        standalone = openai.OpenAI(base_url=base_url, api_key="test", max_retries=0)
        assert ask(standalone).choices[0].message.content == "fake reply #1 to: hello there"
    finally:
        process.send_signal(signal.SIGTERM)
        assert process.wait(timeout=10) == 0


def fold_body(existing: str, contents: list[str], cap: int, follow_up: str = "") -> dict[str, Any]:
    fold = format_fold_input(
        existing, [FoldMessage(n, "user", text) for n, text in enumerate(contents, start=1)]
    )
    messages = [
        {"role": "system", "content": summary_instructions(cap)},
        {"role": "user", "content": fold},
    ]
    if follow_up:
        messages += [
            {"role": "assistant", "content": "draft"},
            {"role": "user", "content": follow_up},
        ]
    return {"model": "m", "messages": messages}


LONG_TALK = [f"We talked about topic number {n} at quite some length today." for n in range(40)]


def test_a_padding_summarizer_fills_its_cap_with_prose_and_keeps_fewer_facts() -> None:
    body = fold_body("", LONG_TALK, cap=300)
    plain, pads = summary_text(body, 200), summary_text(body, 200, ["pads"])
    assert any(line in pads for line in PADDING) and not any(line in plain for line in PADDING)
    assert pads.count("topic number") < plain.count("topic number")
    assert 0.8 * 300 * 4 <= len(pads) <= 300 * 4


def test_a_summarizer_that_ignores_repairs_answers_them_with_its_draft() -> None:
    old = "## Facts / Constraints\n- Keep the vault code 4821."
    follow_up = "That summary drops these lines:\n- Keep the vault code 4821.\nRewrite it."
    body = fold_body(old, LONG_TALK, cap=300, follow_up=follow_up)
    assert "4821" in summary_text(body, 60)  # an obedient one keeps the named line
    assert "4821" not in summary_text(body, 60, ["ignores-repairs"])


# -- the prompt cache ----------------------------------------------------------------------------


def test_the_prompt_cache_serves_a_repeated_prefix_by_openais_rule(client: openai.OpenAI) -> None:
    """A prompt's cached tokens are its longest prefix in common with an earlier prompt, in the
    server's tokens (4 a message, then a token per 4 characters), served only from 1,024 tokens
    up and in steps of 128; a prompt that changes near its start is a miss."""
    stable = "The vault code is 4417. " * 200  # 4,800 characters: 1,200 tokens
    first: list[ChatCompletionMessageParam] = [
        {"role": "system", "content": stable},
        {"role": "user", "content": "hello"},
    ]
    again: list[ChatCompletionMessageParam] = [*first, {"role": "user", "content": "more"}]
    changed: list[ChatCompletionMessageParam] = [
        {"role": "system", "content": "Now: " + stable},
        {"role": "user", "content": "hello"},
    ]

    def cached(messages: list[ChatCompletionMessageParam]) -> int:
        usage = client.chat.completions.create(model="fake-chat", messages=messages).usage
        assert usage is not None and usage.prompt_tokens_details is not None
        return usage.prompt_tokens_details.cached_tokens or 0

    assert cached(first) == 0
    # In common with the first: 4 + 1,200, then 4 + 1 for "hello": 1,209, served 1,152.
    assert cached(again) == 1152
    assert cached(changed) == 0
    assert [cacheable(n) for n in (1023, 1024, 1151, 1152, 1300)] == [0, 1024, 1024, 1152, 1280]


@given(st.text(alphabet="ab", max_size=12), st.text(alphabet="ab", max_size=12))
def test_common_start_is_the_longest_common_start(a: str, b: str) -> None:
    n = common_start(a, b)
    assert a[:n] == b[:n] and (n == min(len(a), len(b)) or a[n] != b[n])
