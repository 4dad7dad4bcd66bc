"""The fake server's side of the wire: what a request says (its kind, texts, prompt size, the
fold input's markers) and the constants both sides share."""

from __future__ import annotations

import re
from collections.abc import Callable
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


def is_fold_input(text: str) -> bool:
    """A summarizer's input: a text that opens with the summary's section and ends with the new
    turns' (a chat message that merely quotes a marker is a chat message)."""
    lines = text.strip().splitlines()
    return bool(lines) and lines[0] == SUMMARY_MARKER and lines[-1] == END_NEW_TURNS_MARKER
