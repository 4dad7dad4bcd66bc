"""What answers a user's turn (docs/design.md, the turn, step 5): the ``ChatModel`` contract, its
reply and its failure. Plain Python, no Django.

Two implementations: ``OpenAIChatModel`` (conversations.chat_model.openai_backend), any
OpenAI-compatible Chat Completions endpoint, and ``OfflineChatModel``
(conversations.chat_model.offline_backend), deterministic and clearly marked, no network (the
embedded default).

Streaming: ``stream()`` sends the request at once, so an upstream error raises from the call
itself, before anything has been sent to the client. It returns a ``CompletionStream``: iterate
it for content deltas; once it is exhausted, ``.result`` holds the ``ChatCompletion`` (content,
finish reason, usage). A failure while iterating also raises ``ModelError``.
"""

from collections.abc import Callable, Generator, Iterator, Mapping, Sequence
from dataclasses import dataclass, field, replace
from typing import Any, Protocol, Self

from conversations.chat_model.tokens import count_tokens

UPSTREAM_ERROR = 502
UPSTREAM_TIMEOUT = 504

# What a context's messages look like: {"role": ..., "content": ...}, plus tool fields.
ModelMessages = Sequence[Mapping[str, object]]


# Tools offered to the model and how it may use them, passed through as the client sent them,
# and the reply's output limit (``max_completion_tokens``: the turn's, services.turn_model).
ToolOptions = Mapping[str, object]


@dataclass(frozen=True)
class ChatCompletion:
    content: str
    finish_reason: str
    prompt_tokens: int
    completion_tokens: int
    model: str
    # Tool calls in Chat Completions shape: {"id", "type": "function", "function": {...}}.
    tool_calls: tuple[dict[str, Any], ...] = ()
    # The reply was cut at this many characters, the message cap (CappedChatModel).
    capped_at_chars: int | None = None
    # What the server reported of its prompt cache, under the names it used (CACHE_USAGE_KEYS):
    # empty when it reported nothing.
    cache: Mapping[str, int] = field(default_factory=dict)


# OpenAI's routing hint for its prompt cache, sent in a turn's options (services.turn_model).
PROMPT_CACHE_KEY = "prompt_cache_key"

# OpenAI's count of prompt tokens served from its cache (in usage.prompt_tokens_details), and
# the cache read and write counts Anthropic's API reports (in usage, as OpenAI-compatible
# gateways pass them on).
CACHED_TOKENS = "cached_tokens"
CACHE_USAGE_KEYS = (CACHED_TOKENS, "cache_read_input_tokens", "cache_creation_input_tokens")


def cache_usage(usage: Mapping[str, Any]) -> dict[str, int]:
    """The prompt cache's counts in a Chat Completions ``usage`` object, those it holds."""
    details = usage.get("prompt_tokens_details")
    found = {**usage, **(details if isinstance(details, Mapping) else {})}
    return {
        key: found[key]
        for key in CACHE_USAGE_KEYS
        if isinstance(found.get(key), int) and not isinstance(found.get(key), bool)
    }


def cached_prompt_tokens(cache: Mapping[str, int]) -> int:
    """How many prompt tokens the cache served, by whichever name the server said it."""
    return cache.get(CACHED_TOKENS, cache.get("cache_read_input_tokens", 0))


class ModelError(Exception):
    """The model produced no usable reply. ``str(error)`` is safe to show the client."""

    def __init__(self, message: str, status: int = UPSTREAM_ERROR, retryable: bool = True) -> None:
        super().__init__(message)
        self.status = status
        self.retryable = retryable


class CompletionStream(Iterator[str]):
    """Content deltas of a streamed reply; ``result`` is set once the stream is exhausted."""

    def __init__(
        self,
        deltas: Generator[str, None, ChatCompletion],
        release: Callable[[], object] | None = None,
    ) -> None:
        self._deltas = deltas
        self._release = release
        self.result: ChatCompletion | None = None

    def __iter__(self) -> Self:
        return self

    def __next__(self) -> str:
        try:
            return next(self._deltas)
        except StopIteration as done:
            self.result = done.value
            raise

    def close(self) -> None:
        """Stop early and release the upstream connection (also when never iterated, where the
        generator's own cleanup would not run)."""
        self._deltas.close()
        if self._release is not None:
            self._release()


class ChatModel(Protocol):
    def complete(
        self, messages: ModelMessages, model: str, tools: ToolOptions | None = None
    ) -> ChatCompletion: ...

    def stream(
        self, messages: ModelMessages, model: str, tools: ToolOptions | None = None
    ) -> CompletionStream: ...


class CappedChatModel:
    """A model whose replies are at most ``cap`` characters (CHATMEM_MAX_MESSAGE_CHARS, the cap on
    every stored message): a longer one is cut there and marked, finish_reason "length" as when
    the model's own token limit cuts it, and ``capped_at_chars`` set. Cut rather than refused:
    the call is paid for, and a resend would most likely run as long. A stream emits nothing
    past the cap and reads the rest of the reply (its usage and tool calls) unsent."""

    def __init__(self, model: ChatModel, cap: int) -> None:
        self.model = model
        self.cap = cap

    def complete(
        self, messages: ModelMessages, model: str, tools: ToolOptions | None = None
    ) -> ChatCompletion:
        return self._capped(self.model.complete(messages, model, tools))

    def stream(
        self, messages: ModelMessages, model: str, tools: ToolOptions | None = None
    ) -> CompletionStream:
        inner = self.model.stream(messages, model, tools)
        return CompletionStream(self._capped_deltas(inner), release=inner.close)

    def _capped_deltas(self, inner: CompletionStream) -> Generator[str, None, ChatCompletion]:
        room = self.cap
        for delta in inner:
            part = delta[: max(room, 0)]
            room -= len(delta)
            if part:
                yield part
        if inner.result is None:  # an exhausted stream has one
            raise ModelError("The model's reply stream ended before the reply was complete.")
        return self._capped(inner.result)

    def _capped(self, completion: ChatCompletion) -> ChatCompletion:
        if len(completion.content) <= self.cap:
            return completion
        return replace(
            completion,
            content=completion.content[: self.cap],
            finish_reason="length",
            capped_at_chars=self.cap,
        )


def require_reply(content: str, has_tool_calls: bool, finish_reason: str | None) -> None:
    """An empty reply is a failure; a reply cut by the length limit is still a reply. A reply
    the content filter stopped is a failure even with text: what came before the cut is not
    the model's answer, and once stored it would be in every later context and the summary."""
    if finish_reason == "content_filter":
        raise ModelError("The model's reply was stopped by its content filter; nothing was stored.")
    if content.strip() or has_tool_calls:
        return
    raise ModelError("The model returned an empty reply.")


def count_messages(messages: ModelMessages, model: str) -> int:
    return sum(count_tokens(message_content(message), model) for message in messages)


def message_content(message: Mapping[str, object]) -> str:
    content = message.get("content")
    return content if isinstance(content, str) else ""
