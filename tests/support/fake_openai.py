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

from __future__ import annotations

import argparse
import contextlib
import inspect
import json
import random
import re
import signal
import socket
import sys
import threading
import time
from collections import deque
from collections.abc import Callable, Iterable, Iterator
from dataclasses import dataclass, field, replace
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from typing import Any

SUMMARY_MARKER = "=== EXISTING_SUMMARY ==="
END_SUMMARY_MARKER = "=== END_EXISTING_SUMMARY ==="
NEW_TURNS_MARKER = "=== NEW_TURNS ==="
END_NEW_TURNS_MARKER = "=== END_NEW_TURNS ==="
SUMMARY_HEADINGS = (
    "Facts / Constraints",
    "Goals / Preferences",
    "Decisions",
    "Open Items",
    "Key Artifacts",
)
DEFAULT_MODELS = ("fake-chat", "fake-mini", "fake-deep", "fake-summarizer")
KINDS = ("chat", "summarize", "any")
REFUSAL_TEXT = "I can't help with that"

# Faults answered with an HTTP error: name -> (status, error type, error code, message).
HTTP_FAULTS: dict[str, tuple[int, str, str | None, str]] = {
    "429": (429, "rate_limit_exceeded", "rate_limit_exceeded", "Rate limit reached (fake)."),
    "insufficient_quota": (
        429,
        "insufficient_quota",
        "insufficient_quota",
        "You exceeded your current quota (fake).",
    ),
    "500": (500, "server_error", None, "The server had an error processing your request (fake)."),
    "400": (400, "invalid_request_error", None, "Invalid request (fake)."),
    # As a provider's content filter refuses a prompt.
    "content_filter": (
        400,
        "invalid_request_error",
        "content_filter",
        "The prompt was rejected by the content filter (fake).",
    ),
    # OpenAI's refusal of a prompt over the model's window ("context_exceeded" is llama.cpp's).
    "context_length_exceeded": (
        400,
        "invalid_request_error",
        "context_length_exceeded",
        "This model's maximum context length is 8192 tokens. However, your messages resulted in "
        "9000 tokens. Please reduce the length of the messages (fake).",
    ),
    # As OpenAI words it, echoing the key it was sent (masked).
    "401": (
        401,
        "invalid_request_error",
        "invalid_api_key",
        "Incorrect API key provided: sk-test-****1234 (fake).",
    ),
}
# Faults that change a normal answer rather than replacing it.
# "context_exceeded": llama.cpp's refusal of a prompt over its window, whatever the prompt.
ANSWER_FAULTS = ("timeout", "truncated", "empty", "refusal", "stream_cut", "context_exceeded")
FAULT_NAMES = (*HTTP_FAULTS, *ANSWER_FAULTS)
# A prompt over the model's window, as OpenAI's API and llama.cpp's server answer it.
CONTEXT_FAULTS = ("context_length_exceeded", "context_exceeded")
# In a queue of faults: this request is answered normally (``queue_faults("summarize", ["ok",
# "500"])`` fails the second request).
NO_FAULT = "ok"

FILLER_WORDS = ("lorem", "ipsum", "dolor", "sit", "amet", "consectetur", "adipiscing", "elit")
GOAL_WORDS = ("want", "prefer", "goal", "like", "need", "plan", "hope", "aim")
ARTIFACT_PATTERN = re.compile(r"https?://\S+|`[^`]+`|\b[\w-]+\.(?:py|js|ts|md|txt|json|pdf|csv)\b")
TOOL_MARKER = re.compile(r"CALL_TOOL:([A-Za-z0-9_-]+)")
WORDS_PER_STREAM_CHUNK = 2
# llama.cpp's server refusing a prompt longer than its context (type exceed_context_size_error).
LLAMA_CPP_CONTEXT_ERROR = "the request exceeds the available context size, try increasing it"


# --------------------------------------------------------------------------------------------
# Reading requests
# --------------------------------------------------------------------------------------------


def content_text(content: Any) -> str:
    """Text of a message ``content``: a string, or a list of content parts (``{"text": ...}``)."""
    if isinstance(content, str):
        return content
    if isinstance(content, list):
        return "\n".join(content_text(part) for part in content)
    if isinstance(content, dict):
        return content_text(content.get("text", content.get("content", "")))
    return ""


def request_texts(body: dict[str, Any]) -> list[str]:
    """Every text of a chat-completions or Responses request, in order."""
    texts = [content_text(message.get("content")) for message in body.get("messages") or []]
    texts.append(content_text(body.get("instructions")))
    texts.append(content_text(body.get("input")))
    return [text for text in texts if text]


def classify(body: dict[str, Any]) -> str:
    return "summarize" if any(is_fold_input(text) for text in request_texts(body)) else "chat"


def approx_tokens(text: str) -> int:
    # Deterministic and cheap: tests assert on exact usage numbers.
    return len(text) // 4


def prompt_tokens(body: dict[str, Any]) -> int:
    messages = body.get("messages")
    if messages is not None:
        return sum(approx_tokens(content_text(m.get("content"))) + 4 for m in messages)
    return sum(approx_tokens(text) + 4 for text in request_texts(body))


def chatml_prompt_tokens(body: dict[str, Any], counter: Callable[[str], int]) -> int:
    """A chat request's prompt as a ChatML template renders it: each message's content, 5
    tokens of role and markers around it, 3 for the assistant's opening."""
    messages = body.get("messages") or []
    return sum(counter(content_text(m.get("content"))) + 5 for m in messages) + 3


def last_user_text(body: dict[str, Any]) -> str:
    for message in reversed(body.get("messages") or []):
        if message.get("role") == "user":
            return content_text(message.get("content"))
    return content_text(body.get("input"))


def requested_tool(body: dict[str, Any]) -> str | None:
    """The tool named by ``CALL_TOOL:<name>`` when the request offers tools and the user asks."""
    messages = body.get("messages") or []
    if not body.get("tools") or not messages or messages[-1].get("role") != "user":
        return None
    match = TOOL_MARKER.search(content_text(messages[-1].get("content")))
    return match.group(1) if match else None


# --------------------------------------------------------------------------------------------
# Deterministic replies
# --------------------------------------------------------------------------------------------


def chat_reply_text(number: int, body: dict[str, Any], reply_words: int | None) -> str:
    text = f"fake reply #{number} to: {last_user_text(body)[:60]}"
    words = text.split()
    if reply_words is None or len(words) >= reply_words:
        return text
    # Benchmarks need long assistant messages; pad with filler up to exactly reply_words words.
    filler = [FILLER_WORDS[i % len(FILLER_WORDS)] for i in range(reply_words - len(words))]
    return " ".join([*words, *filler])


def is_fold_input(text: str) -> bool:
    """A summarizer's input: a text that opens with the summary's section and ends with the new
    turns' (a chat message that merely quotes a marker is a chat message)."""
    lines = text.strip().splitlines()
    return bool(lines) and lines[0] == SUMMARY_MARKER and lines[-1] == END_NEW_TURNS_MARKER


def section_lines(lines: list[str], start: str, end: str) -> list[str]:
    """The lines between a line that is exactly ``start`` and the next that is exactly ``end``:
    a marker counts at the start of a line, as a model reads it."""
    if start not in lines:
        return []
    begin = lines.index(start) + 1
    finish = lines.index(end, begin) if end in lines[begin:] else len(lines)
    return lines[begin:finish]


def read_fold_input(source: str) -> tuple[str, list[tuple[str, str]]]:
    """A summarize request's existing summary ("" for NONE) and its new messages as (role,
    content): the summary is one JSON string, each message a "Role: <JSON string>" line among
    "Turn n:" lines."""
    lines = source.splitlines()
    existing = "\n".join(section_lines(lines, SUMMARY_MARKER, END_SUMMARY_MARKER)).strip()
    summary = "" if existing in ("", "NONE") else str(json.loads(existing))
    messages = []
    for line in section_lines(lines, NEW_TURNS_MARKER, END_NEW_TURNS_MARKER):
        role, separator, text = line.partition(": ")
        if separator and text.startswith('"'):
            messages.append((role.lower(), str(json.loads(text))))
    return summary, messages


def transcript(messages: Iterable[tuple[str, str]]) -> str:
    """The new messages as "User: …" / "Assistant: …" lines, one per message."""
    return "\n".join(
        f"{role.capitalize()}: {' '.join(content.split())}" for role, content in messages
    )


def existing_bullets(summary: str) -> list[tuple[str, str]]:
    """(heading, bullet) pairs of a previous summary; free text lands under the first heading."""
    if summary.strip().upper() in ("", "NONE"):
        return []
    heading = SUMMARY_HEADINGS[0]
    bullets = []
    for raw_line in summary.splitlines():
        line = raw_line.strip()
        if line.startswith("## ") and line[3:].strip() in SUMMARY_HEADINGS:
            heading = line[3:].strip()
        elif line and line not in ("- (none)", "(none)"):
            bullets.append((heading, line.removeprefix("- ").strip()))
    return bullets


def turn_bullets(messages: Iterable[tuple[str, str]]) -> list[tuple[str, str]]:
    """(heading, bullet) pairs from the first words of each user and assistant message."""
    bullets = []
    for role, content in messages:
        speaker, text = role.capitalize(), " ".join(content.split())
        if speaker not in ("User", "Assistant") or not text:
            continue
        bullets.append((turn_heading(speaker, text), f"{speaker}: {' '.join(text.split()[:12])}"))
        bullets.extend(("Key Artifacts", artifact) for artifact in ARTIFACT_PATTERN.findall(text))
    return bullets


def turn_heading(speaker: str, text: str) -> str:
    if speaker == "Assistant":
        return "Decisions"
    if text.rstrip().endswith("?"):
        return "Open Items"
    if any(word in text.lower().split() for word in GOAL_WORDS):
        return "Goals / Preferences"
    return "Facts / Constraints"


def render_summary(bullets: list[tuple[str, str]]) -> str:
    parts = []
    for heading in SUMMARY_HEADINGS:
        lines = [f"- {text}" for section, text in bullets if section == heading] or ["- (none)"]
        parts.append("\n".join([f"## {heading}", *lines]))
    return "\n\n".join(parts)


# A summarizer's bad habits (``summary_habits``), as real models have them: "pads" keeps the
# newest facts in half the room it is given and fills the rest with prose toward its cap;
# "ignores-repairs" answers a follow-up naming lines to keep exactly as it answered the draft.
SUMMARY_HABITS = ("pads", "ignores-repairs")
PADDING = (
    "The conversation went on in a friendly and relaxed way.",
    "Both sides stayed polite and the exchange felt productive overall.",
    "The user seemed satisfied with the answers so far.",
    "Several topics came up briefly before moving on to other things.",
    "The assistant explained its reasoning in plain language.",
    "There was some general discussion about how things usually go.",
)
CAP_IN_INSTRUCTIONS = re.compile(r"within (\d+) tokens")


def summary_text(body: dict[str, Any], cap_words: int, habits: Iterable[str] = ()) -> str:
    """A valid seed-000/003 summary: old bullets kept, new ones added, oldest dropped over cap.
    A follow-up naming lines to keep (the fold guard's repair) keeps those and drops others,
    unless it ``habits`` to ignore it (SUMMARY_HABITS)."""
    habits = frozenset(habits)
    texts = request_texts(body)
    source = next(text for text in reversed(texts) if is_fold_input(text))
    existing, messages = read_fold_input(source)
    follow_up = texts[-1] if texts[-1] != source else ""
    if "ignores-repairs" in habits:
        follow_up = ""
    if "pads" in habits:
        cap_words //= 2
    keep = {line[2:].strip().lower() for line in follow_up.splitlines() if line.startswith("- ")}
    bullets, seen = [], set()
    for heading, text in existing_bullets(existing) + turn_bullets(messages):
        if text.lower() not in seen:
            seen.add(text.lower())
            bullets.append((heading, text))
    rendered = render_summary(bullets)
    droppable = [bullet for bullet in bullets if bullet[1].lower() not in keep]
    while droppable and len(rendered.split()) > cap_words:
        bullets.remove(droppable.pop(0))  # the oldest go first, like a real rewrite under a cap
        rendered = render_summary(bullets)
    if "pads" in habits:
        replaced = len(existing) + sum(len(content) for _, content in messages)
        rendered = padded(rendered, texts, replaced)
    return rendered


def padded(summary: str, texts: list[str], replaced_chars: int) -> str:
    """``summary`` with prose bullets (no rule, no value) at the end of its first section, up to
    about 95 % of the cap its instructions name (four characters a token), and no longer than
    what it replaces (a summary longer than its input is refused as no summary)."""
    found = CAP_IN_INSTRUCTIONS.search(texts[0]) if texts else None
    cap_tokens = int(found.group(1)) if found else 500
    limit = min(int(cap_tokens * 0.95) * 4, replaced_chars)
    head, _, rest = summary.partition("\n\n")
    head = head.replace("\n- (none)", "")
    for number in range(200):
        line = f"- {PADDING[number % len(PADDING)]}"
        if len(head) + len(line) + 1 + len(rest) + 2 > limit:
            break
        head += "\n" + line
    return f"{head}\n\n{rest}" if rest else head


@dataclass(frozen=True)
class Reply:
    """What the fake model answers, before it is put in a wire format."""

    text: str | None
    finish_reason: str = "stop"
    refusal: str | None = None
    tool_call: tuple[str, str] | None = None  # (call id, function name)


def apply_answer_fault(reply: Reply, fault: str | None) -> Reply:
    if fault == "truncated":
        text = reply.text or ""
        return replace(reply, text=text[: len(text) // 2], finish_reason="length")
    if fault == "empty":
        return Reply(text="")
    if fault == "refusal":
        return Reply(text=None, refusal=REFUSAL_TEXT)
    return reply


def split_for_stream(text: str) -> list[str]:
    """Word-group chunks whose concatenation is exactly ``text``."""
    words = re.findall(r"\s*\S+\s*", text) or ([text] if text else [])
    return [
        "".join(words[i : i + WORDS_PER_STREAM_CHUNK])
        for i in range(0, len(words), WORDS_PER_STREAM_CHUNK)
    ]


# --------------------------------------------------------------------------------------------
# Output limits: a server that honours one limit field only
# --------------------------------------------------------------------------------------------

# ``limit_mode``: "local" honours only ``max_tokens`` and ignores ``max_completion_tokens``, as
# llama.cpp's server and Ollama do; "openai" honours only ``max_completion_tokens`` and, as
# OpenAI's API does, refuses a request that sets both. In either mode every text reply runs on
# (filler words, a looping small model) to ``runaway_tokens`` unless the honoured field stops
# it first, with finish_reason "length". Tokens are the fake's own (``approx_tokens``).
LIMIT_MODES: dict[str, tuple[str, ...]] = {
    "local": ("max_tokens",),
    "openai": ("max_completion_tokens",),
}
RUNAWAY_TOKENS = 3000
BOTH_LIMITS_MESSAGE = (
    "Setting 'max_tokens' and 'max_completion_tokens' at the same time is not supported (fake)."
)


def honoured_limit(body: dict[str, Any], mode: str) -> int | None:
    limits = [body[key] for key in LIMIT_MODES[mode] if isinstance(body.get(key), int)]
    return min(limits) if limits else None


def refuses_both_limits(body: dict[str, Any], mode: str | None) -> bool:
    return mode == "openai" and all(
        body.get(key) is not None for key in ("max_tokens", "max_completion_tokens")
    )


def apply_limit_mode(
    reply: Reply, body: dict[str, Any], mode: str | None, runaway_tokens: int
) -> Reply:
    if mode is None or reply.text is None or reply.tool_call:
        return reply
    words = reply.text.split(" ")
    filler = 0
    while approx_tokens(" ".join(words)) < runaway_tokens:
        words.append(FILLER_WORDS[filler % len(FILLER_WORDS)])
        filler += 1
    text = " ".join(words)
    limit = honoured_limit(body, mode)
    if limit is not None and approx_tokens(text) > limit:
        return replace(reply, text=text[: limit * 4].rstrip(), finish_reason="length")
    return replace(reply, text=text)


# --------------------------------------------------------------------------------------------
# Wire formats
# --------------------------------------------------------------------------------------------


def error_body(message: str, error_type: str, code: str | None = None) -> dict[str, Any]:
    return {"error": {"message": message, "type": error_type, "param": None, "code": code}}


def completion_tokens(reply: Reply) -> int:
    return approx_tokens(reply.text or reply.refusal or "") + (1 if reply.tool_call else 0)


def usage_body(body: dict[str, Any], reply: Reply, cached: int = 0) -> dict[str, Any]:
    prompt, completion = prompt_tokens(body), completion_tokens(reply)
    return {
        "prompt_tokens": prompt,
        "completion_tokens": completion,
        "total_tokens": prompt + completion,
        "prompt_tokens_details": {"cached_tokens": cached},
    }


# OpenAI's prompt caching: a prefix of at least 1,024 tokens is cached, in steps of 128.
CACHE_MIN_TOKENS, CACHE_STEP_TOKENS = 1024, 128
CACHE_PROMPTS_KEPT = 64


def cacheable(prefix_tokens: int) -> int:
    """How much of a ``prefix_tokens`` long common prefix OpenAI's rule serves from its cache."""
    if prefix_tokens < CACHE_MIN_TOKENS:
        return 0
    steps = (prefix_tokens - CACHE_MIN_TOKENS) // CACHE_STEP_TOKENS
    return CACHE_MIN_TOKENS + steps * CACHE_STEP_TOKENS


def common_prefix_tokens(a: list[tuple[str, str]], b: list[tuple[str, str]]) -> int:
    """The common prefix of two prompts (role, content), in this server's tokens (``prompt_tokens``:
    4 a message, then its content): whole messages while they match, then the matching start
    of the first that differs."""
    tokens = 0
    for (role_a, text_a), (role_b, text_b) in zip(a, b, strict=False):
        if role_a != role_b:
            break
        if text_a == text_b:
            tokens += 4 + approx_tokens(text_a)
            continue
        return tokens + 4 + approx_tokens(text_a[: common_start(text_a, text_b)])
    return tokens


def common_start(a: str, b: str) -> int:
    """The length of the longest common start of ``a`` and ``b``: a binary search of slice
    comparisons, which run in C, so a busy server keeps answering at its pace."""
    low, high = 0, min(len(a), len(b))
    while low < high:
        middle = (low + high + 1) // 2
        if a[:middle] == b[:middle]:
            low = middle
        else:
            high = middle - 1
    return low


class PrefixCache:
    """A prompt cache following OpenAI's rule, over the last prompts this server answered on
    /chat/completions (per model): a prompt's cached tokens are its longest prefix in common
    with one of them, rounded down to the rule's steps."""

    def __init__(self) -> None:
        self._lock = threading.Lock()
        self._prompts: deque[tuple[str, list[tuple[str, str]]]] = deque(maxlen=CACHE_PROMPTS_KEPT)

    def cached_tokens(self, body: dict[str, Any]) -> int:
        model = str(body.get("model") or "")
        prompt = [
            (str(m.get("role")), content_text(m.get("content"))) for m in body.get("messages") or []
        ]
        with self._lock:
            seen = [earlier for name, earlier in self._prompts if name == model]
            self._prompts.append((model, prompt))
        longest = max((common_prefix_tokens(prompt, earlier) for earlier in seen), default=0)
        return cacheable(longest)


def tool_call_body(reply: Reply) -> dict[str, Any]:
    assert reply.tool_call is not None
    call_id, name = reply.tool_call
    return {"id": call_id, "type": "function", "function": {"name": name, "arguments": "{}"}}


def chat_completion_body(
    completion_id: str, body: dict[str, Any], model: str, reply: Reply, cached: int = 0
) -> dict[str, Any]:
    message: dict[str, Any] = {
        "role": "assistant",
        "content": reply.text,
        "refusal": reply.refusal,
        "annotations": [],
    }
    if reply.tool_call:
        message["tool_calls"] = [tool_call_body(reply)]
    return {
        "id": completion_id,
        "object": "chat.completion",
        "created": int(time.time()),
        "model": model,
        "system_fingerprint": None,
        "choices": [
            {
                "index": 0,
                "message": message,
                "logprobs": None,
                "finish_reason": reply.finish_reason,
            }
        ],
        "usage": usage_body(body, reply, cached),
    }


def chunk_body(
    completion_id: str,
    model: str,
    delta: dict[str, Any],
    finish_reason: str | None = None,
    with_usage: bool = False,
) -> dict[str, Any]:
    chunk: dict[str, Any] = {
        "id": completion_id,
        "object": "chat.completion.chunk",
        "created": int(time.time()),
        "model": model,
        "system_fingerprint": None,
        "choices": [{"index": 0, "delta": delta, "logprobs": None, "finish_reason": finish_reason}],
    }
    if with_usage:
        chunk["usage"] = None  # OpenAI sends null on every chunk but the usage one
    return chunk


def stream_deltas(reply: Reply) -> Iterator[dict[str, Any]]:
    """The deltas of a streamed answer, after the role delta and before the finish chunk."""
    if reply.tool_call:
        call_id, name = reply.tool_call
        yield {
            "tool_calls": [
                {
                    "index": 0,
                    "id": call_id,
                    "type": "function",
                    "function": {"name": name, "arguments": ""},
                }
            ]
        }
        yield {"tool_calls": [{"index": 0, "function": {"arguments": "{}"}}]}
    elif reply.refusal is not None:
        yield {"refusal": reply.refusal}
    for piece in split_for_stream(reply.text or ""):
        yield {"content": piece}


def responses_body(
    response_id: str, body: dict[str, Any], model: str, reply: Reply
) -> dict[str, Any]:
    incomplete = reply.finish_reason == "length"
    if reply.refusal is not None:
        content: list[dict[str, Any]] = [{"type": "refusal", "refusal": reply.refusal}]
    else:
        content = [{"type": "output_text", "text": reply.text or "", "annotations": []}]
    prompt, completion = prompt_tokens(body), completion_tokens(reply)
    return {
        "id": response_id,
        "object": "response",
        "created_at": int(time.time()),
        "status": "incomplete" if incomplete else "completed",
        "incomplete_details": {"reason": "max_output_tokens"} if incomplete else None,
        "error": None,
        "model": model,
        "prompt": body.get("prompt"),
        "instructions": None,
        "output": [
            {
                "id": f"msg_{response_id}",
                "type": "message",
                "role": "assistant",
                "status": "incomplete" if incomplete else "completed",
                "content": content,
            }
        ],
        "parallel_tool_calls": True,
        "tool_choice": "auto",
        "tools": [],
        "usage": {
            "input_tokens": prompt,
            "input_tokens_details": {"cached_tokens": 0},
            "output_tokens": completion,
            "output_tokens_details": {"reasoning_tokens": 0},
            "total_tokens": prompt + completion,
        },
    }


# --------------------------------------------------------------------------------------------
# Recording and fault plans
# --------------------------------------------------------------------------------------------


@dataclass(frozen=True)
class RecordedRequest:
    """One request as the server saw it. Also readable as a mapping: ``record["body"]``."""

    kind: str  # "chat" | "summarize"
    path: str
    body: dict[str, Any]
    headers: dict[str, str]  # header names lower-cased
    received_at: float  # time.monotonic()
    fault: str | None  # injected fault name, "unauthorized" for a failed auth check, or None
    number: int  # 1-based position among requests of the same kind (the "#n" in chat replies)

    def __getitem__(self, key: str) -> Any:
        return getattr(self, key)

    @property
    def text(self) -> str:
        """All the request's text joined, for ``"..." in record.text`` assertions."""
        return "\n".join(request_texts(self.body))


@dataclass
class _FaultConfig:
    rate: float
    faults: list[str]
    rng: random.Random


@dataclass
class _FaultPlan:
    """Which fault (if any) the next request of a kind gets. Queued faults win over random ones,
    and kind-specific settings win over "any"."""

    lock: threading.Lock = field(default_factory=threading.Lock)
    queues: dict[str, deque[str]] = field(default_factory=lambda: {k: deque() for k in KINDS})
    configs: dict[str, _FaultConfig] = field(default_factory=dict)
    # Summarize requests holding any of these strings: refused by the content filter, always.
    refused_markers: list[str] = field(default_factory=list)
    # Summarize requests holding any of these strings: over the model's window, always, answered
    # with ``too_large_fault`` (OpenAI's or llama.cpp's error).
    too_large_markers: list[str] = field(default_factory=list)
    too_large_fault: str = "context_length_exceeded"

    def set(self, kind: str, rate: float, faults: Iterable[str], seed: int | None) -> None:
        names = validate_faults(kind, faults)
        if not 0.0 <= rate <= 1.0:
            raise ValueError(f"fault rate must be within [0, 1], got {rate}")
        with self.lock:
            self.configs[kind] = _FaultConfig(rate, names, random.Random(seed))

    def queue(self, kind: str, faults: Iterable[str]) -> None:
        names = validate_faults(kind, faults)
        with self.lock:
            self.queues[kind].extend(names)

    def clear(self, kind: str | None = None) -> None:
        with self.lock:
            for key in KINDS if kind is None else (kind,):
                self.queues[key].clear()
                self.configs.pop(key, None)
            if kind in (None, "summarize", "any"):
                self.refused_markers.clear()
                self.too_large_markers.clear()

    def refuse(self, markers: Iterable[str]) -> None:
        with self.lock:
            self.refused_markers.extend(markers)

    def too_large(self, markers: Iterable[str], fault: str) -> None:
        if fault not in CONTEXT_FAULTS:
            raise ValueError(f"fault must be one of {CONTEXT_FAULTS}, got {fault!r}")
        with self.lock:
            self.too_large_markers.extend(markers)
            self.too_large_fault = fault

    def draw(self, kind: str, body: dict[str, Any] | None = None) -> str | None:
        # Before the queues: a marked request consumes no queued fault.
        if kind == "summarize" and body is not None:
            if self._holds(body, self.refused_markers):
                return "content_filter"
            if self._holds(body, self.too_large_markers, new_turns_only=True):
                return self.too_large_fault
        fault = self._draw(kind)
        return None if fault == NO_FAULT else fault

    def _holds(self, body: dict[str, Any], found: list[str], new_turns_only: bool = False) -> bool:
        with self.lock:
            markers = list(found)
        texts = request_texts(body)
        if new_turns_only:
            # The large message itself, not a summary that quotes it: folded, it is small.
            lines = [line for text in texts for line in text.splitlines()]
            texts = section_lines(lines, NEW_TURNS_MARKER, END_NEW_TURNS_MARKER)
        return any(marker in text for text in texts for marker in markers)

    def _draw(self, kind: str) -> str | None:
        with self.lock:
            for key in (kind, "any"):
                if self.queues[key]:
                    return self.queues[key].popleft()
            for key in (kind, "any"):
                config = self.configs.get(key)
                if config and config.faults and config.rng.random() < config.rate:
                    return config.rng.choice(config.faults)
        return None


def validate_faults(kind: str, faults: Iterable[str]) -> list[str]:
    if kind not in KINDS:
        raise ValueError(f"kind must be one of {KINDS}, got {kind!r}")
    names = [str(name) for name in faults]
    unknown = [name for name in names if name not in (*FAULT_NAMES, NO_FAULT)]
    if unknown:
        raise ValueError(f"unknown faults {unknown}; known: {FAULT_NAMES} and {NO_FAULT!r}")
    return names


class _Recorder:
    """Thread-safe request log and counters."""

    def __init__(self) -> None:
        self._lock = threading.Lock()
        self._in_flight = 0
        self.reset()

    def reset(self) -> None:
        with self._lock:
            self._records: list[RecordedRequest] = []
            self._numbers = {"chat": 0, "summarize": 0}
            self._faults: dict[str, int] = {}
            self._tool_calls = 0
            # Requests still being answered are not forgotten: in_flight stays accurate.
            self._max_in_flight = self._in_flight

    def record(
        self, kind: str, path: str, body: dict[str, Any], headers: dict[str, str], fault: str | None
    ) -> RecordedRequest:
        with self._lock:
            self._numbers[kind] += 1
            if fault:
                self._faults[fault] = self._faults.get(fault, 0) + 1
            record = RecordedRequest(
                kind, path, body, headers, time.monotonic(), fault, self._numbers[kind]
            )
            self._records.append(record)
            return record

    def next_tool_call_id(self) -> str:
        with self._lock:
            self._tool_calls += 1
            return f"call_{self._tool_calls}"

    def enter(self) -> None:
        with self._lock:
            self._in_flight += 1
            self._max_in_flight = max(self._max_in_flight, self._in_flight)

    def leave(self) -> None:
        with self._lock:
            self._in_flight -= 1

    def records(self) -> list[RecordedRequest]:
        with self._lock:
            return list(self._records)

    def counters(self) -> dict[str, Any]:
        with self._lock:
            return {
                "total": len(self._records),
                "chat": self._numbers["chat"],
                "summarize": self._numbers["summarize"],
                "faults": dict(self._faults),
                "in_flight": self._in_flight,
                "max_in_flight": self._max_in_flight,
            }


# --------------------------------------------------------------------------------------------
# HTTP
# --------------------------------------------------------------------------------------------


class _HTTPServer(ThreadingHTTPServer):
    daemon_threads = True
    allow_reuse_address = True
    # Benchmarks open hundreds of connections at once; a small backlog would refuse some.
    request_queue_size = 1024

    def __init__(self, address: tuple[str, int], fake: FakeOpenAI) -> None:
        self.fake = fake
        super().__init__(address, _Handler)

    def handle_error(self, request: Any, client_address: Any) -> None:
        # Clients that give up (timeouts, stream cuts) are expected; anything else is a bug.
        if not isinstance(sys.exc_info()[1], ConnectionError | TimeoutError):
            super().handle_error(request, client_address)


class _Handler(BaseHTTPRequestHandler):
    # HTTP/1.1 keep-alive: every JSON answer has a Content-Length and streams are chunked, so
    # the SDK's connection pool can reuse connections.
    protocol_version = "HTTP/1.1"
    server_version = "FakeOpenAI/1.0"
    timeout = 60  # idle keep-alive connections are dropped after this many seconds
    # Headers and body go out in separate writes; with Nagle on, the client's delayed ACK
    # adds ~40 ms to every response.
    disable_nagle_algorithm = True
    server: _HTTPServer

    def setup(self) -> None:
        super().setup()
        self.server.fake._track_connection(self.connection)

    def finish(self) -> None:
        self.server.fake._untrack_connection(self.connection)
        super().finish()

    def log_message(self, format: str, *args: Any) -> None:
        pass  # keep test output clean

    # -- routing -----------------------------------------------------------------------------

    def do_GET(self) -> None:
        path = self._route()
        fake = self.server.fake
        if not self._authorized():
            self._send_unauthorized()
        elif path == "/models":
            self._send_json(200, {"object": "list", "data": [model_body(m) for m in fake.models]})
        elif path.startswith("/models/") and path[len("/models/") :] in fake.models:
            self._send_json(200, model_body(path[len("/models/") :]))
        else:
            self._send_error(404, "invalid_request_error", f"Unknown path {self.path}", None)

    def do_POST(self) -> None:
        body_bytes = self.rfile.read(int(self.headers.get("Content-Length") or 0))
        path = self._route()
        if path not in ("/chat/completions", "/responses"):
            self._send_error(404, "invalid_request_error", f"Unknown path {self.path}", None)
            return
        try:
            body = json.loads(body_bytes or b"{}")
        except ValueError:
            self._send_error(400, "invalid_request_error", "Body is not valid JSON.", None)
            return
        if not isinstance(body, dict):
            self._send_error(400, "invalid_request_error", "Body must be a JSON object.", None)
            return
        try:
            self.server.fake._serve_model_request(self, path, body)
        except OSError:
            self.close_connection = True  # the client went away (timeout, cut); nothing to say

    def _route(self) -> str:
        path = self.path.split("?", 1)[0].rstrip("/")
        return path.removeprefix("/v1")

    def _authorized(self) -> bool:
        key = self.server.fake.api_key
        return key is None or self.headers.get("Authorization") == f"Bearer {key}"

    # -- writing -----------------------------------------------------------------------------

    def _send_json(self, status: int, payload: Any, headers: dict[str, str] | None = None) -> None:
        data = json.dumps(payload).encode()
        self.send_response(status)
        self.send_header("Content-Type", "application/json")
        self.send_header("Content-Length", str(len(data)))
        for name, value in (headers or {}).items():
            self.send_header(name, value)
        self.end_headers()
        self.wfile.write(data)

    def _send_error(
        self,
        status: int,
        error_type: str,
        message: str,
        code: str | None,
        headers: dict[str, str] | None = None,
    ) -> None:
        self._send_json(status, error_body(message, error_type, code), headers)

    def _send_unauthorized(self) -> None:
        self._send_error(
            401,
            "invalid_request_error",
            "Incorrect API key provided (fake).",
            "invalid_api_key",
            {"WWW-Authenticate": 'Bearer realm="fake-openai"'},
        )

    def _send_cut_json(self, payload: Any) -> None:
        """Promise the whole body, send half, hang up: the client sees a broken connection."""
        data = json.dumps(payload).encode()
        self.send_response(200)
        self.send_header("Content-Type", "application/json")
        self.send_header("Content-Length", str(len(data)))
        self.end_headers()
        self.wfile.write(data[: len(data) // 2])
        self._hang_up()

    def _start_sse(self) -> None:
        # Chunked rather than Connection: close, so a cut stream (no terminating chunk) is a
        # protocol error the SDK raises, instead of a clean end of body.
        self.send_response(200)
        self.send_header("Content-Type", "text/event-stream; charset=utf-8")
        self.send_header("Cache-Control", "no-cache")
        self.send_header("Transfer-Encoding", "chunked")
        self.end_headers()

    def _send_sse(self, data: str) -> None:
        event = f"data: {data}\n\n".encode()
        self.wfile.write(b"%x\r\n%s\r\n" % (len(event), event))

    def _end_sse(self) -> None:
        self._send_sse("[DONE]")
        self.wfile.write(b"0\r\n\r\n")

    def _hang_up(self) -> None:
        self.close_connection = True
        with contextlib.suppress(OSError):  # the client may have hung up first
            self.connection.shutdown(socket.SHUT_RDWR)


def model_body(model_id: str) -> dict[str, Any]:
    return {"id": model_id, "object": "model", "created": 0, "owned_by": "fake-openai"}


# --------------------------------------------------------------------------------------------
# The server
# --------------------------------------------------------------------------------------------


class FakeOpenAI:
    """A fake OpenAI-compatible server on a background thread.

    Runtime knobs are plain attributes, safe to assign while serving: ``latency`` (seconds before
    answering a chat request), ``summarize_latency``, ``timeout_sleep`` (the "timeout" fault),
    ``chunk_delay`` (seconds between streamed chunks), ``reply_words`` (pad chat replies to this
    many words), ``reply_fn`` (``request_json -> str`` overriding chat replies), ``summary_fn``
    (the same for summaries), ``summary_cap_words``, ``summary_habits`` (SUMMARY_HABITS),
    ``api_key``, ``models``, ``limit_mode`` and ``runaway_tokens`` (LIMIT_MODES).
    """

    def __init__(
        self,
        host: str = "127.0.0.1",
        port: int = 0,
        *,
        latency: float = 0.0,
        summarize_latency: float = 0.0,
        api_key: str | None = None,
        models: Iterable[str] = DEFAULT_MODELS,
        reply_fn: Callable[[dict[str, Any]], str] | None = None,
        summary_fn: Callable[[dict[str, Any]], str] | None = None,
        reply_words: int | None = None,
        summary_cap_words: int = 300,
        summary_habits: Iterable[str] = (),
        timeout_sleep: float = 2.0,
        chunk_delay: float = 0.0,
        fault_rate: float = 0.0,
        faults: Iterable[str] = (),
        fault_kind: str = "any",
        seed: int | None = 1,
        limit_mode: str | None = None,
        runaway_tokens: int = RUNAWAY_TOKENS,
        prompt_counter: Callable[[str], int] | None = None,
        context_window: int | None = None,
    ) -> None:
        if limit_mode is not None and limit_mode not in LIMIT_MODES:
            raise ValueError(f"limit_mode must be one of {sorted(LIMIT_MODES)} or None")
        self.limit_mode, self.runaway_tokens = limit_mode, runaway_tokens
        self.host, self.port = host, port
        self.latency, self.summarize_latency = latency, summarize_latency
        self.api_key = api_key
        self.models = tuple(models)
        self.reply_fn, self.summary_fn = reply_fn, summary_fn
        self.reply_words = reply_words
        self.summary_cap_words = summary_cap_words
        self.summary_habits = tuple(summary_habits)
        self.timeout_sleep = timeout_sleep
        self.chunk_delay = chunk_delay
        self.prompt_counter, self.context_window = prompt_counter, context_window
        self.prompt_sizes: list[int] = []  # chat prompts counted with prompt_counter
        self._faults = _FaultPlan()
        self._recorder = _Recorder()
        self.cache = PrefixCache()  # reports cached prompt tokens by OpenAI's rule
        # Request parameters answered with a 400, as a server that does not know them does.
        self.refused_params: tuple[str, ...] = ()
        if fault_rate or faults:
            self.set_faults(fault_kind, fault_rate, list(faults), seed)
        self._stopping = threading.Event()  # wakes every latency/timeout wait at shutdown
        self._httpd: _HTTPServer | None = None
        self._thread: threading.Thread | None = None
        self._connections: set[socket.socket] = set()
        self._connections_lock = threading.Lock()

    # -- lifecycle ---------------------------------------------------------------------------

    @property
    def base_url(self) -> str:
        if self._httpd is None:
            raise RuntimeError("FakeOpenAI is not started; call start() or use it as a context")
        host = "127.0.0.1" if self.host in ("", "0.0.0.0") else self.host
        return f"http://{host}:{self._httpd.server_address[1]}/v1"

    def start(self) -> FakeOpenAI:
        if self._httpd is not None:
            return self
        self._stopping.clear()
        self._httpd = _HTTPServer((self.host, self.port), self)
        self._thread = threading.Thread(
            target=self._httpd.serve_forever,
            kwargs={"poll_interval": 0.05},
            name="fake-openai",
            daemon=True,
        )
        self._thread.start()
        return self

    def stop(self) -> None:
        httpd, self._httpd = self._httpd, None
        if httpd is None:
            return
        self._stopping.set()
        httpd.shutdown()
        self._close_connections()  # keep-alive handler threads would otherwise idle on
        httpd.server_close()
        if self._thread is not None:
            self._thread.join(timeout=5)

    def __enter__(self) -> FakeOpenAI:
        return self.start()

    def __exit__(self, *exc_info: object) -> None:
        self.stop()

    def _track_connection(self, connection: socket.socket) -> None:
        with self._connections_lock:
            self._connections.add(connection)

    def _untrack_connection(self, connection: socket.socket) -> None:
        with self._connections_lock:
            self._connections.discard(connection)

    def _close_connections(self) -> None:
        with self._connections_lock:
            connections = list(self._connections)
        for connection in connections:
            with contextlib.suppress(OSError):  # already closed by the client
                connection.shutdown(socket.SHUT_RDWR)

    # -- recording ---------------------------------------------------------------------------

    @property
    def requests(self) -> list[RecordedRequest]:
        """A copy of every recorded request, oldest first."""
        return self._recorder.records()

    def chat_requests(self) -> list[RecordedRequest]:
        return [r for r in self.requests if r.kind == "chat"]

    def summarize_requests(self) -> list[RecordedRequest]:
        return [r for r in self.requests if r.kind == "summarize"]

    def counters(self) -> dict[str, Any]:
        """``total``, ``chat``, ``summarize``, ``faults`` (name -> count), ``in_flight``,
        ``max_in_flight`` (the most requests being answered at once)."""
        return self._recorder.counters()

    def reset(self) -> None:
        """Forget recorded requests and counters (reply numbers restart at #1). Faults stay
        configured; see clear_faults()."""
        self._recorder.reset()

    def wait_for(self, predicate: Callable[..., Any], timeout: float = 5.0) -> bool:
        """Poll ``predicate()`` (or ``predicate(server)``) until it is truthy or ``timeout``
        seconds pass; returns whether it became truthy."""
        arguments = () if _takes_no_arguments(predicate) else (self,)
        deadline = time.monotonic() + timeout
        while True:
            if predicate(*arguments):
                return True
            if time.monotonic() >= deadline:
                return False
            time.sleep(0.01)

    # -- faults ------------------------------------------------------------------------------

    def set_faults(
        self,
        kind: str = "any",
        rate: float = 0.3,
        faults: Iterable[str] = ("429", "500"),
        seed: int | None = 1,
    ) -> None:
        """Give each request of ``kind`` a ``rate`` chance of one of ``faults`` (seeded)."""
        self._faults.set(kind, rate, faults, seed)

    def queue_faults(self, kind: str, faults: Iterable[str]) -> None:
        """The next len(faults) requests of ``kind`` get these faults, in order."""
        self._faults.queue(kind, faults)

    def clear_faults(self, kind: str | None = None) -> None:
        self._faults.clear(kind)

    def refuse_summaries_containing(self, *markers: str) -> None:
        """Every summarize request whose text holds one of ``markers`` is answered 400 (the
        ``content_filter`` fault), as a provider's content filter refuses a message, for as long
        as the markers stay (``clear_faults()`` drops them)."""
        self._faults.refuse(markers)

    def too_large_summaries_containing(
        self, *markers: str, fault: str = "context_length_exceeded"
    ) -> None:
        """Every summarize request whose new turns hold one of ``markers`` is over the model's
        window: answered with ``fault``, OpenAI's 400 ``context_length_exceeded`` or llama.cpp's
        ``context_exceeded`` (400, type ``exceed_context_size_error``), for as long as the
        markers stay (``clear_faults()`` drops them)."""
        self._faults.too_large(markers, fault)

    # -- answering ---------------------------------------------------------------------------

    def _serve_model_request(self, handler: _Handler, path: str, body: dict[str, Any]) -> None:
        kind = classify(body)
        headers = {name.lower(): value for name, value in handler.headers.items()}
        if not handler._authorized():
            self._recorder.record(kind, path, body, headers, "unauthorized")
            handler._send_unauthorized()
            return
        fault = self._faults.draw(kind, body)
        record = self._recorder.record(kind, path, body, headers, fault)
        self._recorder.enter()
        try:
            self._answer(handler, path, body, record, fault)
        finally:
            self._recorder.leave()

    def _answer(
        self,
        handler: _Handler,
        path: str,
        body: dict[str, Any],
        record: RecordedRequest,
        fault: str | None,
    ) -> None:
        delay = self.summarize_latency if record.kind == "summarize" else self.latency
        if fault == "timeout":
            delay += self.timeout_sleep
        if self._stopping.wait(delay):
            handler._hang_up()
            return
        if fault in HTTP_FAULTS:
            self._send_http_fault(handler, fault)
            return
        refused = sorted(key for key in self.refused_params if key in body)
        if refused:  # as OpenAI answers a parameter it does not know
            message = f"Unrecognized request argument supplied: {', '.join(refused)}"
            handler._send_error(400, "invalid_request_error", message, None)
            return
        if refuses_both_limits(body, self.limit_mode):
            handler._send_error(400, "invalid_request_error", BOTH_LIMITS_MESSAGE, None)
            return
        if self._over_window(handler, body, record, fault == "context_exceeded"):
            return
        reply = apply_answer_fault(self._reply(body, record), fault)
        reply = apply_limit_mode(reply, body, self.limit_mode, self.runaway_tokens)
        model = str(body.get("model") or self.models[0])
        if path == "/responses":
            self._send_response(handler, body, model, reply, record, fault)
        elif body.get("stream"):
            self._stream_chat(handler, body, model, reply, record, fault)
        else:
            completion = chat_completion_body(
                f"chatcmpl-fake-{record.number}", body, model, reply, self.cache.cached_tokens(body)
            )
            if fault == "stream_cut":
                handler._send_cut_json(completion)
            else:
                handler._send_json(200, completion)

    def _over_window(
        self, handler: _Handler, body: dict[str, Any], record: RecordedRequest, forced: bool
    ) -> bool:
        """Refuse a chat prompt that does not fit ``context_window`` as llama.cpp's server does
        (its check: prompt tokens >= n_ctx); ``forced``: refuse it whatever its size."""
        counted = self.prompt_counter is not None and self.context_window is not None
        if not forced and not (counted and record.kind == "chat"):
            return False
        counter = self.prompt_counter or approx_tokens
        tokens = chatml_prompt_tokens(body, counter)
        window = self.context_window or tokens
        if counted:
            self.prompt_sizes.append(tokens)
        if tokens < window and not forced:
            return False
        error = {
            "code": 400,
            "message": LLAMA_CPP_CONTEXT_ERROR,
            "type": "exceed_context_size_error",
            "n_prompt_tokens": tokens,
            "n_ctx": window,
        }
        if body.get("stream"):
            handler._start_sse()
            handler._send_sse(json.dumps({"error": error}))
            handler.wfile.write(b"0\r\n\r\n")
        else:
            handler._send_json(400, {"error": error})
        return True

    def _reply(self, body: dict[str, Any], record: RecordedRequest) -> Reply:
        if record.kind == "summarize":
            if self.summary_fn is not None:
                return Reply(text=self.summary_fn(body))
            return Reply(text=summary_text(body, self.summary_cap_words, self.summary_habits))
        tool = requested_tool(body)
        if tool is not None:
            return Reply(
                text=None,
                finish_reason="tool_calls",
                tool_call=(self._recorder.next_tool_call_id(), tool),
            )
        if self.reply_fn is not None:
            return Reply(text=self.reply_fn(body))
        return Reply(text=chat_reply_text(record.number, body, self.reply_words))

    def _send_http_fault(self, handler: _Handler, fault: str) -> None:
        status, error_type, code, message = HTTP_FAULTS[fault]
        headers = {}
        if status == 429:
            # retry-after-ms wins in the SDK and keeps retry tests fast; retry-after: 0 alone
            # would make it fall back to its 0.5 s+ exponential backoff.
            headers = {"retry-after": "0", "retry-after-ms": "10"}
        handler._send_error(status, error_type, message, code, headers)

    def _send_response(
        self,
        handler: _Handler,
        body: dict[str, Any],
        model: str,
        reply: Reply,
        record: RecordedRequest,
        fault: str | None,
    ) -> None:
        if body.get("stream"):
            handler._send_error(
                400, "invalid_request_error", "The fake does not stream /v1/responses.", None
            )
            return
        payload = responses_body(f"resp_fake_{record.number}", body, model, reply)
        if fault == "stream_cut":
            handler._send_cut_json(payload)
        else:
            handler._send_json(200, payload)

    def _stream_chat(
        self,
        handler: _Handler,
        body: dict[str, Any],
        model: str,
        reply: Reply,
        record: RecordedRequest,
        fault: str | None,
    ) -> None:
        completion_id = f"chatcmpl-fake-{record.number}"
        include_usage = bool((body.get("stream_options") or {}).get("include_usage"))

        def send(delta: dict[str, Any], finish_reason: str | None = None) -> None:
            chunk = chunk_body(completion_id, model, delta, finish_reason, include_usage)
            handler._send_sse(json.dumps(chunk))

        handler._start_sse()
        send({"role": "assistant", "content": "" if reply.text is not None else None})
        for index, delta in enumerate(stream_deltas(reply)):
            if fault == "stream_cut" and index == 2:
                handler._hang_up()  # no terminating chunk: the SDK's iteration raises
                return
            if self._stopping.wait(self.chunk_delay):
                handler._hang_up()
                return
            send(delta)
        if fault == "stream_cut":
            handler._hang_up()
            return
        send({}, reply.finish_reason)
        if include_usage:
            usage_chunk = chunk_body(completion_id, model, {}, None, True)
            usage_chunk["choices"] = []
            usage_chunk["usage"] = usage_body(body, reply, self.cache.cached_tokens(body))
            handler._send_sse(json.dumps(usage_chunk))
        handler._end_sse()


def _takes_no_arguments(function: Callable[..., Any]) -> bool:
    try:
        return not inspect.signature(function).parameters
    except (TypeError, ValueError):
        return True  # builtins without a signature: call them plainly


# --------------------------------------------------------------------------------------------
# Command line
# --------------------------------------------------------------------------------------------


def parse_args(argv: list[str] | None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(
        prog="python -m tests.support.fake_openai", description="Fake OpenAI-compatible server."
    )
    parser.add_argument("--host", default="127.0.0.1")
    parser.add_argument("--port", type=int, default=8999, help="0 picks a free port")
    parser.add_argument("--latency", type=float, default=0.0, help="seconds per chat request")
    parser.add_argument("--summarize-latency", type=float, default=0.0)
    parser.add_argument("--fault-rate", type=float, default=0.0)
    parser.add_argument("--faults", default="", help=f"comma-separated, of {','.join(FAULT_NAMES)}")
    parser.add_argument("--fault-kind", choices=KINDS, default="any")
    parser.add_argument("--seed", type=int, default=1)
    parser.add_argument("--api-key", default=None, help="require 'Authorization: Bearer KEY'")
    parser.add_argument("--reply-words", type=int, default=None)
    parser.add_argument("--summary-cap-words", type=int, default=300)
    parser.add_argument(
        "--summary-habits", default="", help=f"comma-separated, of {','.join(SUMMARY_HABITS)}"
    )
    parser.add_argument("--timeout-sleep", type=float, default=2.0)
    parser.add_argument(
        "--chunk-delay", type=float, default=0.0, help="seconds between streamed chunks"
    )
    return parser.parse_args(argv)


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    faults = [name for name in args.faults.split(",") if name]
    if args.fault_rate and not faults:
        faults = ["429", "500"]
    try:
        validate_faults(args.fault_kind, faults)
    except ValueError as error:
        sys.exit(f"error: {error}")
    server = FakeOpenAI(
        args.host,
        args.port,
        latency=args.latency,
        summarize_latency=args.summarize_latency,
        api_key=args.api_key,
        reply_words=args.reply_words,
        summary_cap_words=args.summary_cap_words,
        summary_habits=[name for name in args.summary_habits.split(",") if name],
        timeout_sleep=args.timeout_sleep,
        chunk_delay=args.chunk_delay,
        fault_rate=args.fault_rate,
        faults=faults,
        fault_kind=args.fault_kind,
        seed=args.seed,
    )
    stop = threading.Event()
    for signum in (signal.SIGTERM, signal.SIGINT):
        signal.signal(signum, lambda *_: stop.set())
    with server:
        print(f"listening on {server.base_url}", flush=True)
        while not stop.wait(0.5):
            pass
    print(f"stopped; counters: {json.dumps(server.counters())}", flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
