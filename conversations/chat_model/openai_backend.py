"""The chat model of an OpenAI-compatible Chat Completions endpoint, and its failures as the
API answers them. Plain Python, no Django.

Failures are ``ModelError`` with the HTTP status the API answers with (502 for an upstream error
or an unusable reply, 504 for a timeout) and a message safe to show the client: it names the
upstream status and error code, and echoes the provider's own message only when the provider
refused the request itself (HTTP 400, 404, 413, 422: what to change is in it), with anything
key-like redacted; an authentication or quota message stays in the log. A refused request is
marked not retryable (``retryable``): sent again unchanged it is refused again.
"""

import logging
import re
import time
from collections.abc import Generator, Mapping
from dataclasses import dataclass, field
from typing import Any

import openai

from conversations.chat_model.contract import (
    PROMPT_CACHE_KEY,
    UPSTREAM_TIMEOUT,
    ChatCompletion,
    CompletionStream,
    ModelError,
    ModelMessages,
    ToolOptions,
    cache_usage,
    count_messages,
    require_reply,
)
from conversations.chat_model.http import (
    DirectChatCompletions,
    DirectConnectionError,
    DirectInvalidResponse,
    DirectStatusError,
    DirectTimeout,
    direct_client,
)
from conversations.chat_model.text import storable
from conversations.chat_model.tokens import count_tokens
from conversations.chat_model.transport import (
    REFUSED_REQUEST_STATUSES,
    TokenLimitField,
    body_message,
    chat_completion_json,
    error_detail,
    error_kind,
    redact,
    status_kind,
    stream_chat_completion,
    with_token_limit,
)

log = logging.getLogger(__name__)


class OpenAIChatModel:
    """``direct``: send the non-streamed request over the thread's own connection
    (conversations.chat_model.http) unless a proxy applies; otherwise the SDK sends it.
    ``token_limit_field``: where the output limit of ``tools`` (``max_completion_tokens`` or
    ``max_tokens``) goes, the field the endpoint honours (openai_transport.token_limit_field)."""

    def __init__(
        self,
        client: openai.OpenAI,
        timeout: float,
        direct: bool = True,
        token_limit_field: TokenLimitField = "max_completion_tokens",
    ) -> None:
        self.client = client
        self.timeout = timeout
        self.direct = direct_client(client, timeout) if direct else None
        self.token_limit_field = token_limit_field
        # Models whose endpoint refused prompt_cache_key (an unknown parameter to vLLM, an older
        # gateway) and then took the same request without it: never sent it again from here.
        self.keyless_models: set[str] = set()

    def complete(
        self, messages: ModelMessages, model: str, tools: ToolOptions | None = None
    ) -> ChatCompletion:
        body = {"model": model, "messages": list(messages), **self._options(tools, model)}
        try:
            data = self._post(body, model)
        except CacheKeyRefused:
            data = self._post(without_cache_key(body), model)
            self._drop_cache_key(model)
        return completion_from_json(data, messages, model)

    def _post(self, body: dict[str, Any], model: str) -> Any:
        direct = self.direct
        return self._post_direct(direct, body, model) if direct else self._post_sdk(body, model)

    def _options(self, tools: ToolOptions | None, model: str) -> dict[str, Any]:
        options = with_token_limit(tool_kwargs(tools), self.token_limit_field)
        return without_cache_key(options) if model in self.keyless_models else options

    def _check_cache_key(self, body: Mapping[str, Any], status: int | None, text: str) -> None:
        """CacheKeyRefused when the endpoint may have refused ``body``'s prompt_cache_key: a
        400 (OpenAI, vLLM) or 422 (FastAPI's validation) whose whole error body names it.
        Only the same request taken without it proves it (``_drop_cache_key``): an error that
        merely echoes the request's parameters fails again and keeps the key."""
        if PROMPT_CACHE_KEY in body and status in (400, 422) and PROMPT_CACHE_KEY in text:
            raise CacheKeyRefused

    def _drop_cache_key(self, model: str) -> None:
        self.keyless_models.add(model)
        log.warning(
            "the model endpoint refused prompt_cache_key; not sending it again",
            extra={"event": "prompt_cache_key_refused", "model": model},
        )

    def _post_direct(
        self, direct: DirectChatCompletions, body: Mapping[str, Any], model: str
    ) -> Any:
        try:
            return direct.create(body)
        except DirectTimeout as error:
            raise self._failed(error, model, timeout_error(self.timeout)) from error
        except DirectConnectionError as error:
            raise self._failed(error, model, connection_error()) from error
        except DirectStatusError as error:
            self._check_cache_key(body, error.status, error.body)
            refusal = status_error(error.status, error.code, error.message)
            raise self._failed(error, model, refusal) from error
        except DirectInvalidResponse as error:
            raise self._failed(error, model, invalid_response_error()) from error

    def _post_sdk(self, body: Mapping[str, Any], model: str) -> Any:
        try:
            return chat_completion_json(self.client, body, self.timeout)
        except openai.OpenAIError as error:
            raise self._sdk_failure(error, body, model) from error
        except ValueError as error:  # a JSON content type with a body that is not JSON
            raise self._failed(error, model, invalid_response_error()) from error

    def _failed(self, error: Exception, model: str, model_error: ModelError) -> ModelError:
        log.warning("model call failed: %s", redact(str(error)), extra={"model": model})
        return model_error

    def stream(
        self, messages: ModelMessages, model: str, tools: ToolOptions | None = None
    ) -> CompletionStream:
        # From before the request: waiting for the first byte is part of the reply's time (a
        # deadline taken after the headers let a slow first token double it).
        deadline = time.monotonic() + self.timeout
        body = {
            "model": model,
            "messages": list(messages),
            "stream_options": {"include_usage": True},
            **self._options(tools, model),
        }
        try:
            chunks = self._open_stream(body, model)
        except CacheKeyRefused:
            chunks = self._open_stream(without_cache_key(body), model)
            self._drop_cache_key(model)
        return CompletionStream(
            self._deltas(chunks, messages, model, deadline), release=chunks.close
        )

    def _open_stream(self, body: dict[str, Any], model: str) -> Any:
        try:
            return stream_chat_completion(self.client, body, self.timeout)
        except openai.OpenAIError as error:
            raise self._sdk_failure(error, body, model) from error

    def _sdk_failure(
        self, error: openai.OpenAIError, body: Mapping[str, Any], model: str
    ) -> ModelError:
        """The SDK's error as the turn's (CacheKeyRefused when it refused the cache key)."""
        if isinstance(error, openai.APIStatusError):
            self._check_cache_key(body, error.status_code, error.response.text)
        return self._model_error(error, model)

    def _deltas(
        self, chunks: Any, messages: ModelMessages, model: str, deadline: float
    ) -> Generator[str, None, ChatCompletion]:
        """The timeout bounds each read, not the whole reply: a model that keeps trickling (or
        thinking, in chunks with no content) could hold the turn's slot past
        TURN_SLOT_STALE_SECONDS, so the whole reply gets the deadline too, checked at every
        chunk and at the stream's end. A reply that ends past it is a timeout, never a reply:
        by then the slot may have gone stale and the chat's next turn started, and storing this
        one after it would put into the history a turn the next one's model never saw. Every
        streamed turn comes through here: REST and /v1."""
        state = StreamState(model=model)
        try:
            for chunk in chunks:
                self._check_deadline(deadline)
                delta = state.absorb(chunk)
                if delta:
                    yield delta
            self._check_deadline(deadline)  # a stall before the end of the stream
        except openai.OpenAIError as error:
            raise self._model_error(error, model, mid_stream=True) from error
        except ModelError:
            raise  # the deadline's
        except Exception as error:
            # A malformed chunk must still end the turn as a clean 502, not a 500.
            log.warning("model stream failed", extra={"model": model}, exc_info=True)
            raise ModelError("The model's reply stream was malformed.") from error
        finally:
            chunks.close()
        return state.completion(messages)

    def _check_deadline(self, deadline: float) -> None:
        if time.monotonic() > deadline:
            raise ModelError(
                f"The model did not finish its reply within {self.timeout:g} seconds.",
                UPSTREAM_TIMEOUT,
            )

    def _model_error(
        self, error: openai.OpenAIError, model: str, mid_stream: bool = False
    ) -> ModelError:
        # The SDK's text repeats the provider's body, which may echo the key or the endpoint.
        log.warning("model call failed: %s", redact(str(error)), extra={"model": model})
        return model_error_from(error, self.timeout, mid_stream)


@dataclass
class StreamState:
    """What the chunks of a streamed reply have said so far."""

    model: str
    content: str = ""
    finish_reason: str | None = None
    prompt_tokens: int | None = None
    completion_tokens: int | None = None
    cache: dict[str, int] = field(default_factory=dict)
    # Tool calls arrive in pieces keyed by index: the id and name first, then argument text.
    tool_calls: dict[int, dict[str, Any]] = field(default_factory=dict)

    @property
    def has_tool_calls(self) -> bool:
        return bool(self.tool_calls)

    def absorb(self, chunk: Any) -> str:
        """Record one chunk; return its content delta ("" when it has none)."""
        self.model = storable(chunk.model or "") or self.model
        if chunk.usage:  # the last chunk, with include_usage, has usage and no choices
            self.prompt_tokens = chunk.usage.prompt_tokens
            self.completion_tokens = chunk.usage.completion_tokens
            self.cache = cache_usage(chunk.usage.model_dump())
        if not chunk.choices:
            return ""
        choice = chunk.choices[0]
        self.finish_reason = choice.finish_reason or self.finish_reason
        for piece in choice.delta.tool_calls or ():
            self.absorb_tool_call(piece)
        delta = storable(choice.delta.content or getattr(choice.delta, "refusal", None) or "")
        self.content += delta
        return delta

    def absorb_tool_call(self, piece: Any) -> None:
        call = self.tool_calls.setdefault(
            piece.index, {"id": "", "type": "function", "function": {"name": "", "arguments": ""}}
        )
        call["id"] = storable(piece.id or "") or call["id"]
        if piece.function is not None:
            call["function"]["name"] += storable(piece.function.name or "")
            call["function"]["arguments"] += storable(piece.function.arguments or "")

    def completion(self, messages: ModelMessages) -> ChatCompletion:
        if self.finish_reason is None:
            # The connection closed without the end of the reply: never store a cut reply.
            raise ModelError(STREAM_ENDED_EARLY)
        require_reply(self.content, self.has_tool_calls, self.finish_reason)
        return ChatCompletion(
            content=self.content,
            finish_reason=self.finish_reason,
            prompt_tokens=(
                self.prompt_tokens
                if self.prompt_tokens is not None
                else count_messages(messages, self.model)
            ),
            completion_tokens=(
                self.completion_tokens
                if self.completion_tokens is not None
                else count_tokens(self.content, self.model)
            ),
            model=self.model,
            cache=self.cache,
            tool_calls=tuple(self.tool_calls[index] for index in sorted(self.tool_calls)),
        )


class CacheKeyRefused(Exception):
    """The endpoint refused the request's prompt_cache_key: send it again without."""


def without_cache_key(options: Mapping[str, Any]) -> dict[str, Any]:
    return {key: value for key, value in options.items() if key != PROMPT_CACHE_KEY}


def tool_kwargs(tools: ToolOptions | None) -> dict[str, Any]:
    """``tools`` / ``tool_choice`` / ``parallel_tool_calls`` only when the client sent them: an
    absent key and an explicit null mean different things to some providers."""
    return dict(tools or {})


def reply_text(content: str | None, refusal: str | None) -> str:
    # A refusal is still an answer the user should see ("I can't help with that").
    return content or refusal or ""


def model_error_from(
    error: openai.OpenAIError, timeout: float, mid_stream: bool = False
) -> ModelError:
    # A status first: a 408 is the endpoint's own timeout, and says so.
    if isinstance(error, openai.APIStatusError):
        return status_error(error.status_code, error.code, body_message(error))
    kind = error_kind(error)
    if kind == "timeout":
        return timeout_error(timeout)
    if kind == "connection":
        return connection_error(mid_stream)
    if isinstance(error, openai.APIError) and not isinstance(
        error, openai.APIResponseValidationError
    ):
        # An error event in a streamed reply: the server says why it stopped.
        said = storable(error_detail(body_message(error) or error.message or ""))
        if exceeds_context(said, error.code, getattr(error, "type", None)):
            return context_exceeded_error(said)
        code = f" ({error.code})" if error.code else ""
        because = f" It said: {said}" if said else ""
        return ModelError(f"The model endpoint stopped the reply with an error{code}.{because}")
    return invalid_response_error()


# How servers say a prompt is longer than the model's context: llama.cpp
# (exceed_context_size_error, "exceeds the available context size"), OpenAI and vLLM
# (context_length_exceeded, "maximum context length"), Ollama and others ("context length",
# "context window").
CONTEXT_EXCEEDED = re.compile(
    r"exceed_context_size|context_length_exceeded|maximum context length"
    r"|exceeds? (the )?(available )?context|context (size|length|window)",
    re.IGNORECASE,
)


def exceeds_context(*said: object) -> bool:
    return any(isinstance(text, str) and CONTEXT_EXCEEDED.search(text) for text in said)


def context_exceeded_error(said: str) -> ModelError:
    """The model refused the prompt as longer than its window: the same turn is refused again.
    chatmem's bound was counted with another tokenizer than the model's, or for a larger
    window (MODEL_TOKENIZERS, the variant's context tokens; docs/operations.md)."""
    because = f" It said: {said}" if said else ""
    return ModelError(
        "The model refused the prompt as longer than its context window; sending it again "
        f"cannot help (the chat's model needs its tokenizer or window configured).{because}",
        retryable=False,
    )


def timeout_error(timeout: float) -> ModelError:
    return ModelError(f"The model did not answer within {timeout:g} seconds.", UPSTREAM_TIMEOUT)


# The server answered 200 and ended the stream cleanly, with no finish reason and no error event:
# the model (or the server) stopped; a network failure is connection_error's.
STREAM_ENDED_EARLY = (
    "The model endpoint ended its reply stream before the reply was complete, without saying "
    "why (the connection itself held)."
)


def connection_error(mid_stream: bool = False) -> ModelError:
    if mid_stream:
        return ModelError(
            "The connection to the model endpoint broke during the reply (a network failure, "
            "or the server went away)."
        )
    return ModelError("Could not connect to the model endpoint.")


# The provider refused the request itself: sending it again unchanged cannot help (the OpenAI SDKs
# retry a 502 twice unless told not to). 408, 409, 429 and 5xx are transient; 401 and 403 are the
# operator's key, not the request, and their text stays in the log.
NOT_RETRYABLE = REFUSED_REQUEST_STATUSES | {401, 403}


def status_error(status: int, code: object, provider_message: object = None) -> ModelError:
    detail = f", {code}" if code else ""
    if status_kind(status) == "timeout":
        return ModelError(f"The model endpoint timed out (HTTP 408{detail}).", UPSTREAM_TIMEOUT)
    said = ""
    refused = status in REFUSED_REQUEST_STATUSES
    if refused and isinstance(provider_message, str) and provider_message:
        said = storable(error_detail(provider_message))
        if exceeds_context(said, code):
            return context_exceeded_error(said)
        said = f" It said: {said}"
    return ModelError(
        f"The model endpoint returned an error (HTTP {status}{detail}).{said}",
        retryable=status not in NOT_RETRYABLE,
    )


def invalid_response_error() -> ModelError:
    return ModelError("The model endpoint returned an invalid response.")


def completion_from_json(data: Any, messages: ModelMessages, model: str) -> ChatCompletion:
    """The ChatCompletion of a Chat Completions answer, as JSON. A body of any other shape is
    an invalid response (502), never an exception the view did not expect."""
    if not isinstance(data, dict):
        raise invalid_response_error()
    choices = data.get("choices")
    if not choices:
        raise ModelError("The model returned no reply.")
    choice = choices[0] if isinstance(choices, list) else None
    if not isinstance(choice, dict) or not isinstance(choice.get("message"), dict):
        raise invalid_response_error()
    message = choice["message"]
    content, refusal = message.get("content"), message.get("refusal")
    tool_calls = message.get("tool_calls") or []
    if not (
        isinstance(content, str | None)
        and isinstance(refusal, str | None)
        and isinstance(tool_calls, list)
        and all(isinstance(call, dict) for call in tool_calls)
    ):
        raise invalid_response_error()
    finish_reason = text_or_none(choice.get("finish_reason"))
    reply = storable(reply_text(content, refusal))
    require_reply(reply, bool(tool_calls), finish_reason)
    usage = data.get("usage")
    if not isinstance(usage, dict):
        usage = {}
    prompt_tokens, completion_tokens = usage.get("prompt_tokens"), usage.get("completion_tokens")
    return ChatCompletion(
        content=reply,
        finish_reason=finish_reason or "stop",
        prompt_tokens=(
            prompt_tokens if isinstance(prompt_tokens, int) else count_messages(messages, model)
        ),
        completion_tokens=(
            completion_tokens if isinstance(completion_tokens, int) else count_tokens(reply, model)
        ),
        model=storable(text_or_none(data.get("model")) or model),
        tool_calls=tuple(storable_json(without_none(call)) for call in tool_calls),
        cache=cache_usage(usage),
    )


def text_or_none(value: object) -> str | None:
    return value if isinstance(value, str) else None


def without_none(value: Any) -> Any:
    """What the SDK's ``model_dump(exclude_none=True)`` stored: no null fields, at any depth."""
    if isinstance(value, dict):
        return {key: without_none(item) for key, item in value.items() if item is not None}
    if isinstance(value, list):
        return [without_none(item) for item in value]
    return value


def storable_json(value: Any) -> Any:
    """``value`` with every string storable (jsonb refuses NUL too)."""
    if isinstance(value, str):
        return storable(value)
    if isinstance(value, dict):
        return {storable_json(key): storable_json(item) for key, item in value.items()}
    if isinstance(value, list):
        return [storable_json(item) for item in value]
    return value
