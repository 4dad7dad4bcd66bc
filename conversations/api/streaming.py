"""Server-sent events for streamed turns (``POST /api/v1/chats/{id}/turns/`` with ``"stream":
true`` or ``Accept: text/event-stream``).

Events, in order: ``accepted`` (once), ``delta`` (each piece of the reply as the model produces
it), then exactly one of ``done`` (the stored user and assistant messages, as in the JSON turn)
or ``error`` (``code``, ``detail``, ``status``: the JSON turn's error, and ``retry``: false when
sending the same turn again cannot help, as the JSON turn's ``x-should-retry: false``; nothing
was stored).
Comment lines (``: keep-alive``) are sent while nothing else is, so idle proxies keep the
connection open. The turn itself runs on its own thread (services.turns.start_streamed_turn):
this module only formats its events, and a client that disconnects only stops the formatting.
"""

import json
import logging
from collections.abc import AsyncIterator, Iterable, Iterator
from typing import Any

from django.conf import settings
from django.core.handlers.asgi import ASGIRequest
from django.http import StreamingHttpResponse
from rest_framework.exceptions import NotAcceptable
from rest_framework.negotiation import DefaultContentNegotiation
from rest_framework.renderers import BaseRenderer, JSONRenderer
from rest_framework.request import Request
from rest_framework.utils.encoders import JSONEncoder

from chatmem_project.request_id import current_request_id
from conversations.api import errors
from conversations.api.serializers import turn_response_body
from conversations.services.turn_stream import StreamedTurn, TurnDelta, TurnDone, TurnEvent

log = logging.getLogger("chatmem.turn")

EVENT_STREAM = "text/event-stream"
KEEP_ALIVE = b": keep-alive\n\n"


def accepts_event_stream(request: Request) -> bool:
    return EVENT_STREAM in request.META.get("HTTP_ACCEPT", "")


def wants_stream(request: Request, validated: dict[str, Any]) -> bool:
    """An explicit ``stream`` in the body wins; otherwise the Accept header decides."""
    if "stream" in validated:
        return bool(validated["stream"])
    return accepts_event_stream(request)


class TurnContentNegotiation(DefaultContentNegotiation):
    """``Accept: text/event-stream`` asks for a stream, which is a StreamingHttpResponse and
    needs no renderer. Everything the turn answers through DRF (the JSON turn, 4xx before the
    stream starts) is JSON, so such a client gets JSON errors instead of a 406."""

    def select_renderer(
        self, request: Request, renderers: Iterable[BaseRenderer], format_suffix: str | None = None
    ) -> tuple[BaseRenderer, str]:
        renderers = list(renderers)
        try:
            return super().select_renderer(request, renderers, format_suffix)
        except NotAcceptable:
            if not accepts_event_stream(request):
                raise
            json_renderer = next(r for r in renderers if isinstance(r, JSONRenderer))
            return json_renderer, json_renderer.media_type


def sse(event: str, data: object) -> bytes:
    # json.dumps escapes newlines, so each event's data is exactly one `data:` line.
    payload = json.dumps(data, cls=JSONEncoder, ensure_ascii=False, separators=(",", ":"))
    return f"event: {event}\ndata: {payload}\n\n".encode()


def accepted_event(turn: StreamedTurn) -> bytes:
    request = turn.request
    return sse(
        "accepted",
        {
            "chat_id": request.chat.pk,
            "model_variant": request.variant.name,
            # seq is allocated when the turn is stored, so the message is still pending here.
            "user_message": {
                "seq": None,
                "role": "user",
                "content": request.content,
                "token_count": request.user_tokens,
                "pending": True,
            },
        },
    )


def turn_event(event: TurnEvent | None) -> bytes:
    if event is None:
        return KEEP_ALIVE
    if isinstance(event, TurnDelta):
        return sse("delta", {"content": event.content})
    if isinstance(event, TurnDone):
        result = event.result
        return sse("done", turn_response_body(result.user_message, result.assistant_message))
    exc = errors.turn_error(event.error)
    retry = getattr(exc, "should_retry", True)  # the JSON turn's x-should-retry
    body = {"code": exc.default_code, "detail": exc.detail, "status": exc.status_code}
    return sse("error", {**body, "retry": retry})


def heartbeat_seconds() -> float:
    return float(settings.TURN_STREAM_HEARTBEAT_SECONDS)


def event_stream(turn: StreamedTurn, request_id: str | None = None) -> Iterator[bytes]:
    """For WSGI servers: a generator the server iterates on its request thread."""
    written = 0
    finished = False
    try:
        yield accepted_event(turn)
        written += 1
        for event in turn.events.iter_events(heartbeat_seconds()):
            yield turn_event(event)
            written += 1
        finished = True
    finally:
        # GeneratorExit (the server closed us: the client went away) lands at a yield above.
        # The turn's own thread is not affected: it finishes, stores and frees the slot.
        if not finished:
            log_disconnect(turn, written, request_id)


async def async_event_stream(
    turn: StreamedTurn, request_id: str | None = None
) -> AsyncIterator[bytes]:
    """For ASGI servers: waits on the event loop, holding no thread per open stream."""
    written = 0
    finished = False
    try:
        yield accepted_event(turn)
        written += 1
        async for event in turn.events.aiter_events(heartbeat_seconds()):
            yield turn_event(event)
            written += 1
        finished = True
    finally:
        if not finished:  # cancelled on http.disconnect
            log_disconnect(turn, written, request_id)


def log_disconnect(turn: StreamedTurn, written: int, request_id: str | None) -> None:
    """The request's id is passed in: the stream is read after the response left the
    middleware, which has reset the id of the context by then."""
    extra: dict[str, object] = {
        "event": "stream_disconnect",
        "chat_id": turn.request.chat.pk,
        "events_written": written,
    }
    if request_id:
        extra["request_id"] = request_id
    log.info("client disconnected mid-stream; the turn continues and will be stored", extra=extra)


def streaming_response(request: Request, turn: StreamedTurn) -> StreamingHttpResponse:
    # Under ASGI a synchronous iterator would be consumed whole before the first byte is sent.
    is_asgi = isinstance(request._request, ASGIRequest)
    request_id = current_request_id.get()
    content = async_event_stream(turn, request_id) if is_asgi else event_stream(turn, request_id)
    response = StreamingHttpResponse(content, content_type=f"{EVENT_STREAM}; charset=utf-8")
    response["Cache-Control"] = "no-cache"
    response["X-Accel-Buffering"] = "no"  # nginx: pass each event on at once
    return response
