"""The response bodies as the OpenAI API sends them: completions, chunks, Responses, usage with
the prefix cache's cached tokens."""

from __future__ import annotations

import threading
import time
from collections import deque
from collections.abc import Iterator
from typing import Any

from tests.support.fake_openai.replies import Reply, split_for_stream
from tests.support.fake_openai.wire import approx_tokens, content_text, prompt_tokens

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
