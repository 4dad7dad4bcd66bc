"""An OpenAI-compatible API in front of the configured model, with chatmem's memory.

    client = OpenAI(base_url="http://chatmem:8000/v1", api_key=CHATMEM_TOKEN,
                    default_headers={"X-Chatmem-Chat-Id": "support-4711"})

``POST /v1/chat/completions`` (``stream`` true or false) and ``GET /v1/models``, authenticated
with ``Authorization: Bearer <chatmem token>``. Errors have OpenAI's shape:
``{"error": {"message", "type", "param", "code"}}``. The rules for naming the conversation and
for which of the request's messages are new are in docs/openai-compatible.md."""

from __future__ import annotations

import json
import time
import uuid
from collections.abc import AsyncIterator, Iterator, Mapping
from dataclasses import dataclass
from typing import Any

from asgiref.sync import sync_to_async
from django.core.handlers.asgi import ASGIRequest
from django.db import transaction
from django.http import StreamingHttpResponse
from rest_framework import exceptions
from rest_framework.permissions import IsAuthenticated
from rest_framework.request import Request
from rest_framework.response import Response
from rest_framework.views import APIView

from conversations.api import errors
from conversations.api.openai_controls import (
    Controls,
    apply_controls,
    apply_pin,
    check_settings_match,
    controls_of,
    conversation_gone,
    memory_of,
)
from conversations.api.openai_request import (
    OpenAIError,
    chat_name,
    check_unsupported,
    include_usage,
    passthrough_options,
    request_messages,
    variant_for,
)
from conversations.api.streaming import KEEP_ALIVE
from conversations.authentication import BearerTokenAuthentication
from conversations.chat_model.contract import CACHED_TOKENS
from conversations.services import chats as chat_service
from conversations.services import exchanges
from conversations.services.chat_backend import answering_model
from conversations.services.turn_model import release_db_connection
from conversations.throttling import TurnRateThrottle
from conversations.variants import ModelVariant, model_variants
from memory_worker.engine.presets import PolicyError


def error_type(status_code: int) -> str:
    if status_code == 401:
        return "authentication_error"
    if status_code == 429:
        return "rate_limit_error"
    if status_code >= 500:
        return "server_error"
    return "invalid_request_error"


def error_body(message: str, status_code: int, param: str | None, code: str | None) -> dict:
    return {
        "error": {
            "message": message,
            "type": error_type(status_code),
            "param": param,
            "code": code,
        }
    }


def openai_exception_handler(exc: Exception, context: dict[str, Any]) -> Response | None:
    """The project's error handling, re-shaped as OpenAI errors."""
    response = errors.exception_handler(exc, context)
    if response is None:
        return None
    param = getattr(exc, "param", None)
    # chatmem's own request errors carry their code, or none (as OpenAI's often do); DRF's
    # generic default_code ("error", "invalid") would only look like one.
    code = exc.error_code if isinstance(exc, OpenAIError) else getattr(exc, "default_code", None)
    if isinstance(exc, exceptions.AuthenticationFailed | exceptions.NotAuthenticated):
        code = "invalid_api_key"
    response.data = error_body(message_of(response.data), response.status_code, param, code)
    return response


def message_of(data: Any) -> str:
    if isinstance(data, Mapping):
        if "detail" in data:
            return str(data["detail"])
        return "; ".join(f"{key}: {message_of(value)}" for key, value in data.items())
    if isinstance(data, list):
        return " ".join(message_of(item) for item in data)
    return str(data)


class OpenAICompatView(APIView):
    authentication_classes = [BearerTokenAuthentication]
    permission_classes = [IsAuthenticated]

    def get_exception_handler(self) -> Any:
        return openai_exception_handler


class ModelListView(OpenAICompatView):
    def get(self, request: Request) -> Response:
        return Response(
            {
                "object": "list",
                "data": [
                    {"id": name, "object": "model", "created": 0, "owned_by": "chatmem"}
                    for name in sorted(model_variants())
                ],
            }
        )


class ChatCompletionsView(OpenAICompatView):
    throttle_classes = [TurnRateThrottle]

    def post(self, request: Request) -> Response | StreamingHttpResponse:
        body = request.data
        if not isinstance(body, Mapping):
            raise OpenAIError("The request body must be a JSON object.")
        variant = variant_for(body.get("model"))
        messages = request_messages(body)
        check_unsupported(body)
        stream = body.get("stream")
        if stream is None:
            stream = False  # null is the default, as OpenAI reads it
        if not isinstance(stream, bool):
            raise OpenAIError("stream must be a boolean.", param="stream")
        if body.get("stream_options") is not None and not stream:
            raise OpenAIError(
                "stream_options is only allowed when stream is true.", param="stream_options"
            )
        tools = passthrough_options(body)
        controls = controls_of(body)
        try:
            incoming = exchanges.new_messages(messages)
            system_prompt = exchanges.instructions_of(messages)
        except exchanges.BadExchange as error:
            raise OpenAIError(str(error), param=error.param) from error
        chat = self.chat(request, body, system_prompt, controls)
        if stream:
            return self.streamed(chat, incoming, variant, tools, include_usage(body), controls)
        with errors.turn_refusals():
            result = exchanges.run_exchange(
                chat, incoming, variant_name=variant.name, tools=tools or None
            )
        return Response(completion_body(result, variant, chat, memory_of(chat, controls)))

    def chat(
        self,
        request: Request,
        body: Mapping[str, Any],
        system_prompt: str | None,
        controls: Controls,
    ) -> Any:
        """The conversation the request names (created with the controls' policy on first
        use), with the controls applied."""
        with conversation_gone():
            # One transaction: a pin refused on a new conversation's first request leaves no
            # conversation behind, with settings a later plain request would run under.
            with transaction.atomic():
                chat = self.named_chat(request, body, system_prompt, controls)
                check_settings_match(chat, controls)
                apply_pin(chat, controls, request.user)
            return apply_controls(chat, controls)

    def named_chat(
        self,
        request: Request,
        body: Mapping[str, Any],
        system_prompt: str | None,
        controls: Controls,
    ) -> Any:
        try:
            return exchanges.chat_for(
                request.user,  # type: ignore[arg-type]
                chat_name(request, body),
                system_prompt,
                controls.policy,
                controls.policy_overrides,
            )
        except chat_service.NoRoomInWindow as error:  # a new conversation's system messages
            raise OpenAIError(str(error), param="messages") from error
        except PolicyError as error:
            param = "chatmem.policy_overrides" if controls.policy_overrides else "chatmem.policy"
            raise OpenAIError(str(error), param=param) from error

    def streamed(
        self,
        chat: Any,
        incoming: list[exchanges.Incoming],
        variant: ModelVariant,
        tools: dict[str, Any],
        usage: bool,
        controls: Controls,
    ) -> StreamingHttpResponse:
        with errors.turn_refusals():
            streamed = exchanges.start_streamed_exchange(
                chat, incoming, variant_name=variant.name, tools=tools or None
            )
        # The request's own connection is not needed while the stream is open.
        release_db_connection()
        # Under ASGI a synchronous iterator would be consumed whole before the first byte.
        is_asgi = isinstance(self.request._request, ASGIRequest)
        events = async_sse_events if is_asgi else sse_events
        response = StreamingHttpResponse(
            events(streamed, variant, chat, usage, controls), content_type="text/event-stream"
        )
        response["Cache-Control"] = "no-cache"
        response["X-Accel-Buffering"] = "no"  # nginx: pass each event through at once
        return response


# --- response ---------------------------------------------------------------------------------


def completion_id(chat: Any, seq: int | str) -> str:
    return f"chatcmpl-chatmem-{chat.pk}-{seq}"


def usage_of(result: exchanges.ExchangeResult) -> dict[str, Any]:
    """What the model really received and produced, as the upstream reported it (or counted),
    with what it said of its prompt cache, under the names it used."""
    completion = result.completion
    usage: dict[str, Any] = {
        "prompt_tokens": completion.prompt_tokens,
        "completion_tokens": completion.completion_tokens,
        "total_tokens": completion.prompt_tokens + completion.completion_tokens,
    }
    cache = dict(completion.cache)
    if CACHED_TOKENS in cache:
        usage["prompt_tokens_details"] = {CACHED_TOKENS: cache.pop(CACHED_TOKENS)}
    return {**usage, **cache}


def reply_message(result: exchanges.ExchangeResult) -> dict[str, Any]:
    message: dict[str, Any] = {"role": "assistant", "content": result.reply.content or None}
    if result.completion.tool_calls:
        message["tool_calls"] = list(result.completion.tool_calls)
    return message


def completion_body(
    result: exchanges.ExchangeResult, variant: ModelVariant, chat: Any, memory: dict[str, Any]
) -> dict:
    return {
        "id": completion_id(chat, result.reply.seq),
        "object": "chat.completion",
        "created": int(time.time()),
        "model": result.completion.model or variant.model,
        "choices": [
            {
                "index": 0,
                "message": reply_message(result),
                "logprobs": None,
                "finish_reason": result.completion.finish_reason,
            }
        ],
        "usage": usage_of(result),
        "chatmem": {"chat_id": chat.pk, "seqs": [m.seq for m in result.stored], **memory},
    }


def sse(data: dict[str, Any] | str) -> bytes:
    payload = data if isinstance(data, str) else json.dumps(data)
    return f"data: {payload}\n\n".encode()


@dataclass(frozen=True)
class ChunkStream:
    """What every chunk of one streamed completion shares, as OpenAI sends them: one id (unique
    per completion: the stored reply's seq is not known when the first chunk goes out), one
    ``created``, and with ``stream_options.include_usage`` a ``usage`` field, null on every
    chunk but the final usage one."""

    id: str
    model: str
    created: int
    include_usage: bool
    chat_id: int

    @classmethod
    def start(cls, chat: Any, model: str, include_usage: bool) -> ChunkStream:
        stream_id = completion_id(chat, uuid.uuid4().hex[:16])
        return cls(stream_id, model, int(time.time()), include_usage, chat.pk)

    def chunk(self, delta: dict[str, Any], finish_reason: str | None = None) -> dict[str, Any]:
        body: dict[str, Any] = {
            "id": self.id,
            "object": "chat.completion.chunk",
            "created": self.created,
            "model": self.model,
            "choices": [
                {"index": 0, "delta": delta, "logprobs": None, "finish_reason": finish_reason}
            ],
        }
        if self.include_usage:
            body["usage"] = None
        return body


# Sent before the reply's kind is known: "content": "" here would make a tool-call reply's
# accumulated content "" where the JSON completion says null.
FIRST_DELTA = {"role": "assistant"}


def sse_events(
    streamed: exchanges.StreamedExchange,
    variant: ModelVariant,
    chat: Any,
    usage: bool,
    controls: Controls,
) -> Iterator[bytes]:
    """The standard chunk stream. If the client goes away, this generator is closed, but the
    exchange thread goes on and stores the reply."""
    stream = ChunkStream.start(chat, answering_model(variant.model), usage)
    yield sse(stream.chunk(FIRST_DELTA))
    for delta in streamed.deltas():
        yield KEEP_ALIVE if delta is None else sse(stream.chunk({"content": delta}))
    yield from closing_events(streamed, stream, stream_memory(streamed, chat, controls))


async def async_sse_events(
    streamed: exchanges.StreamedExchange,
    variant: ModelVariant,
    chat: Any,
    usage: bool,
    controls: Controls,
) -> AsyncIterator[bytes]:
    """``sse_events`` for ASGI servers: waits on the event loop, holding no thread."""
    stream = ChunkStream.start(chat, answering_model(variant.model), usage)
    yield sse(stream.chunk(FIRST_DELTA))
    async for delta in streamed.adeltas():
        yield KEEP_ALIVE if delta is None else sse(stream.chunk({"content": delta}))
    memory = await sync_to_async(stream_memory)(streamed, chat, controls)
    for event in closing_events(streamed, stream, memory):
        yield event


def stream_memory(
    streamed: exchanges.StreamedExchange, chat: Any, controls: Controls
) -> dict[str, Any]:
    """The memory's state for the last chunk, read once the reply is stored (none on an error);
    the read's connection is closed again, as the stream held none."""
    if streamed.error is not None or streamed.result is None:
        return {}
    try:
        return memory_of(chat, controls)
    finally:
        release_db_connection()


def closing_events(
    streamed: exchanges.StreamedExchange, stream: ChunkStream, memory: dict[str, Any]
) -> Iterator[bytes]:
    """After the deltas: the tool calls, the finish reason (with the memory's state), usage if
    asked, then [DONE]; or an error event when the exchange failed (nothing stored)."""
    if streamed.error is not None or streamed.result is None:
        yield sse(stream_error(streamed.error))
        return
    result = streamed.result
    if result.completion.tool_calls:
        calls = [{"index": i, **call} for i, call in enumerate(result.completion.tool_calls)]
        yield sse(stream.chunk({"tool_calls": calls}))
    # What a JSON completion says in its body, on the chunk that ends the reply.
    stored = {"chat_id": stream.chat_id, "seqs": [m.seq for m in result.stored], **memory}
    yield sse({**stream.chunk({}, result.completion.finish_reason), "chatmem": stored})
    if stream.include_usage:
        yield sse({**stream.chunk({}), "choices": [], "usage": usage_of(result)})
    yield sse("[DONE]")


def stream_error(error: BaseException | None) -> dict[str, Any]:
    """An error event (the OpenAI SDKs raise it as an APIError); nothing was stored."""
    failure = error if isinstance(error, Exception) else RuntimeError("the stream ended early")
    api_error = errors.turn_error(failure)
    code = api_error.default_code if isinstance(api_error.default_code, str) else None
    return error_body(str(api_error.detail), api_error.status_code, None, code)
