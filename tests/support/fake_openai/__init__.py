"""A local fake of the OpenAI HTTP API, with fault injection, for chatmem's tests and benchmarks.

Standard library only, so benchmarks and CI can use it without extra packages. It speaks the wire
formats the official ``openai`` SDK parses:

- ``POST /v1/chat/completions`` (plain JSON, or server-sent events with ``stream: true``; tool
  calls when the last user message contains ``CALL_TOOL:<name>`` and the request has ``tools``),
- ``POST /v1/responses`` (the summarizer's hosted-prompt Responses call),
- ``GET /v1/models``.

A request is a **summarize** request when any of its text contains the fold input's
``=== EXISTING_SUMMARY ===`` marker, otherwise a **chat** request. Replies are deterministic.

Every request to a model endpoint is recorded (``server.requests``) and faults can be injected per
kind, either probabilistically (``set_faults``) or in a fixed order (``queue_faults``)::

    with FakeOpenAI(latency=0.1) as server:
        server.queue_faults("summarize", ["429", "timeout"])
        ...  # point the code under test at server.base_url
        assert server.wait_for(lambda: len(server.summarize_requests()) >= 3, timeout=5)

Standalone (benchmarks, manual runs)::

    python -m tests.support.fake_openai --port 8999 --latency 1.0 --fault-rate 0.3 --faults 429,500

A model window, as llama.cpp's server has one: with ``context_window`` and ``prompt_counter`` (a
tokenizer's ``text -> tokens``), a chat request whose prompt, rendered as a ChatML template
would be, has at least that many tokens is refused with llama.cpp's error (400, or an ``error``
event in a stream it had started); ``server.prompt_sizes`` records every counted prompt.

Streamed replies (``stream: true``) are chunked server-sent events, two words per chunk, with
``chunk_delay`` seconds before each content chunk (``--chunk-delay``), so clients can be tested
against a reply that arrives slowly.
"""

from tests.support.fake_openai.bodies import (
    CACHE_PROMPTS_KEPT,
    PrefixCache,
    cacheable,
    chat_completion_body,
    chunk_body,
    common_prefix_tokens,
    common_start,
    completion_tokens,
    error_body,
    responses_body,
    stream_deltas,
    tool_call_body,
    usage_body,
)
from tests.support.fake_openai.faults import RecordedRequest, validate_faults
from tests.support.fake_openai.handler import model_body
from tests.support.fake_openai.replies import (
    BOTH_LIMITS_MESSAGE,
    CAP_IN_INSTRUCTIONS,
    LIMIT_MODES,
    PADDING,
    RUNAWAY_TOKENS,
    SUMMARY_HABITS,
    Reply,
    apply_answer_fault,
    apply_limit_mode,
    chat_reply_text,
    existing_bullets,
    honoured_limit,
    padded,
    read_fold_input,
    refuses_both_limits,
    render_summary,
    section_lines,
    split_for_stream,
    summary_text,
    transcript,
    turn_bullets,
    turn_heading,
)
from tests.support.fake_openai.server import FakeOpenAI
from tests.support.fake_openai.wire import (
    ANSWER_FAULTS,
    ARTIFACT_PATTERN,
    CONTEXT_FAULTS,
    DEFAULT_MODELS,
    END_NEW_TURNS_MARKER,
    END_SUMMARY_MARKER,
    FAULT_NAMES,
    FILLER_WORDS,
    GOAL_WORDS,
    HTTP_FAULTS,
    KINDS,
    LLAMA_CPP_CONTEXT_ERROR,
    NEW_TURNS_MARKER,
    NO_FAULT,
    REFUSAL_TEXT,
    SUMMARY_HEADINGS,
    SUMMARY_MARKER,
    TOOL_MARKER,
    WORDS_PER_STREAM_CHUNK,
    approx_tokens,
    chatml_prompt_tokens,
    classify,
    content_text,
    is_fold_input,
    last_user_text,
    prompt_tokens,
    request_texts,
    requested_tool,
)

__all__ = [
    "ANSWER_FAULTS",
    "ARTIFACT_PATTERN",
    "BOTH_LIMITS_MESSAGE",
    "CACHE_PROMPTS_KEPT",
    "CAP_IN_INSTRUCTIONS",
    "CONTEXT_FAULTS",
    "DEFAULT_MODELS",
    "END_NEW_TURNS_MARKER",
    "END_SUMMARY_MARKER",
    "FAULT_NAMES",
    "FILLER_WORDS",
    "GOAL_WORDS",
    "HTTP_FAULTS",
    "KINDS",
    "LIMIT_MODES",
    "LLAMA_CPP_CONTEXT_ERROR",
    "NEW_TURNS_MARKER",
    "NO_FAULT",
    "PADDING",
    "REFUSAL_TEXT",
    "RUNAWAY_TOKENS",
    "SUMMARY_HABITS",
    "SUMMARY_HEADINGS",
    "SUMMARY_MARKER",
    "TOOL_MARKER",
    "WORDS_PER_STREAM_CHUNK",
    "FakeOpenAI",
    "PrefixCache",
    "RecordedRequest",
    "Reply",
    "apply_answer_fault",
    "apply_limit_mode",
    "approx_tokens",
    "cacheable",
    "chat_completion_body",
    "chat_reply_text",
    "chatml_prompt_tokens",
    "chunk_body",
    "classify",
    "common_prefix_tokens",
    "common_start",
    "completion_tokens",
    "content_text",
    "error_body",
    "existing_bullets",
    "honoured_limit",
    "is_fold_input",
    "last_user_text",
    "model_body",
    "padded",
    "prompt_tokens",
    "read_fold_input",
    "refuses_both_limits",
    "render_summary",
    "request_texts",
    "requested_tool",
    "responses_body",
    "section_lines",
    "split_for_stream",
    "stream_deltas",
    "summary_text",
    "tool_call_body",
    "transcript",
    "turn_bullets",
    "turn_heading",
    "usage_body",
    "validate_faults",
]
