"""Request body size limit: a body larger than CHATMEM_MAX_BODY_BYTES is refused with a JSON 413
before anything reads it (Django's own limit would answer a bare 400). A chunked body under
WSGI read, or refused with a JSON 411. A NUL in the URL: a JSON 400. The health probes and
Prometheus' scrape. Static files."""

import io
import json
import os
from collections.abc import Callable
from typing import Any

from django.conf import settings
from django.http import HttpRequest, HttpResponse, JsonResponse
from whitenoise.middleware import WhiteNoiseMiddleware

from conversations.health import healthz, readyz
from conversations.metrics_endpoint import metrics_view


def error_body(message: str, code: str, path: str) -> dict[str, Any]:
    """In the error shape of the API the path is under (the OpenAI SDKs read /v1's)."""
    if path.startswith("/v1/"):
        error = {"message": message, "type": "invalid_request_error", "param": None}
        return {"error": {**error, "code": code}}
    return {"detail": message, "code": code}


def too_large_body(length: int, limit: int, path: str, *, at_least: bool = False) -> dict[str, Any]:
    size = f"over {limit}" if at_least else str(length)
    message = f"The request body is {size} bytes; the limit is {limit} bytes."
    return error_body(message, "request_too_large", path)


def refusal(error: dict[str, Any], status: int) -> JsonResponse:
    """A request refused for what it is: sent again unchanged it gets the same answer, so the
    clients that honour x-should-retry (the OpenAI SDKs) do not resend it."""
    response = JsonResponse(error, status=status)
    response["x-should-retry"] = "false"
    return response


class NulInUrlMiddleware:
    """PostgreSQL refuses NUL in text: a query value reaching a filter (the admin's list filters,
    an API's) was a 500. No URL of chatmem's has a use for one."""

    def __init__(self, get_response: Callable[[HttpRequest], HttpResponse]) -> None:
        self.get_response = get_response

    def __call__(self, request: HttpRequest) -> HttpResponse:
        raw = request.META.get("QUERY_STRING", "")
        if "\x00" in request.path or "\x00" in raw or "%00" in raw:
            message = "The URL contains a NUL character (%00), which no parameter accepts."
            return refusal(error_body(message, "nul_in_url", request.path), 400)
        return self.get_response(request)


class BodySizeLimitMiddleware:
    def __init__(self, get_response: Callable[[HttpRequest], HttpResponse]) -> None:
        self.get_response = get_response

    def __call__(self, request: HttpRequest) -> HttpResponse:
        limit = settings.CHATMEM_MAX_BODY_BYTES
        try:
            length = int(request.META.get("CONTENT_LENGTH") or 0)
        except ValueError:
            length = 0
        if length > limit:
            return refusal(too_large_body(length, limit, request.path), 413)
        return self.get_response(request)


class WsgiChunkedBody:
    """A chunked request body (Transfer-Encoding: chunked, no Content-Length) under WSGI: Django
    reads only Content-Length bytes, so it took such a body for an empty one ("content
    required"). A server that ends wsgi.input at the body's end (gunicorn says so with
    wsgi.input_terminated) has the body read here, up to CHATMEM_MAX_BODY_BYTES (past it a
    413), and handed on with its length; a server that does not (wsgiref: runserver,
    serve_demo) has the request refused with a 411 asking for a Content-Length."""

    def __init__(self, app: Any) -> None:
        self.app = app

    def __call__(self, environ: dict[str, Any], start_response: Any) -> Any:
        chunked = "chunked" in environ.get("HTTP_TRANSFER_ENCODING", "").lower()
        if not chunked or environ.get("CONTENT_LENGTH"):
            return self.app(environ, start_response)
        path = environ.get("PATH_INFO", "")
        if not environ.get("wsgi.input_terminated"):
            message = "This server reads no chunked request body: send a Content-Length."
            return wsgi_refusal(start_response, 411, error_body(message, "length_required", path))
        limit = settings.CHATMEM_MAX_BODY_BYTES
        body = environ["wsgi.input"].read(limit + 1)
        if len(body) > limit:
            error = too_large_body(len(body), limit, path, at_least=True)
            return wsgi_refusal(start_response, 413, error)
        environ["wsgi.input"] = io.BytesIO(body)
        environ["CONTENT_LENGTH"] = str(len(body))
        return self.app(environ, start_response)


def wsgi_refusal(start_response: Any, status: int, error: dict[str, Any]) -> list[bytes]:
    body = json.dumps(error).encode()
    reason = {411: "Length Required", 413: "Content Too Large"}[status]
    headers = [
        ("Content-Type", "application/json"),
        ("Content-Length", str(len(body))),
        ("x-should-retry", "false"),
    ]
    start_response(f"{status} {reason}", headers)
    return [body]


class _BodyOverLimit(Exception):
    pass


class AsgiBodySizeLimit:
    """The body limit for ASGI servers (uvicorn), where the middleware above comes too late:
    Django's ASGIHandler reads a whole body, into memory and then a temporary file, before any
    middleware runs, so a client with no token could send gigabytes (a chunked body has no
    Content-Length to refuse it by) and only then get its 401 or 413. Here a declared length
    over the limit is refused before anything is read, and a body is counted as it arrives and
    refused once it passes the limit. Under WSGI Django reads only Content-Length bytes, and
    only when asked: the middleware is enough there."""

    def __init__(self, app: Any) -> None:
        self.app = app

    async def __call__(self, scope: dict[str, Any], receive: Any, send: Any) -> None:
        if scope["type"] != "http":
            await self.app(scope, receive, send)
            return
        limit = settings.CHATMEM_MAX_BODY_BYTES
        declared = declared_length(scope)
        if declared > limit:
            await send_too_large(send, too_large_body(declared, limit, scope["path"]))
            return
        received = 0

        async def counted() -> dict[str, Any]:
            nonlocal received
            message: dict[str, Any] = await receive()
            if message["type"] == "http.request":
                received += len(message.get("body", b""))
                if received > limit:
                    raise _BodyOverLimit
            return message

        try:
            await self.app(scope, counted, send)
        except _BodyOverLimit:
            # Raised while Django read the body: no response has started yet.
            await send_too_large(send, too_large_body(received, limit, scope["path"]))


def declared_length(scope: dict[str, Any]) -> int:
    for name, value in scope.get("headers", []):
        if name == b"content-length":
            try:
                return int(value)
            except ValueError:
                return 0
    return 0


async def send_too_large(send: Any, error: dict[str, Any]) -> None:
    body = json.dumps(error).encode()
    headers = [
        (b"content-type", b"application/json"),
        (b"content-length", str(len(body)).encode()),
        (b"x-should-retry", b"false"),
    ]
    await send({"type": "http.response.start", "status": 413, "headers": headers})
    await send({"type": "http.response.body", "body": body})


PROBES: dict[str, Callable[[HttpRequest], HttpResponse]] = {
    "/healthz": healthz,
    "/readyz": readyz,
    "/metrics": metrics_view,  # still asks for METRICS_TOKEN when one is set
}


class ProbeMiddleware:
    """``/healthz``, ``/readyz`` (served only here, not routed) and ``/metrics``, answered first,
    whatever the Host header and over plain HTTP: a probe calls the container by its own address
    (compose's healthcheck: 127.0.0.1), Prometheus by its service name (web:8000), which a
    production ALLOWED_HOSTS rightly leaves out, so CommonMiddleware's host check would answer
    them 400 (and SECURE_SSL_REDIRECT a 301 to an https:// the container does not serve): the
    container would never be healthy, nothing scraped. Nothing else skips those."""

    def __init__(self, get_response: Callable[[HttpRequest], HttpResponse]) -> None:
        self.get_response = get_response

    def __call__(self, request: HttpRequest) -> HttpResponse:
        probe = PROBES.get(request.path)
        return probe(request) if probe is not None else self.get_response(request)


class StaticFilesMiddleware(WhiteNoiseMiddleware):
    """WhiteNoise: gunicorn serves no static files of its own; without this Swagger UI
    (/api/v1/docs/) is a blank page and the admin unstyled. Files come from STATIC_ROOT once
    collectstatic has filled it (the image), else from the installed apps
    (settings.WHITENOISE_USE_FINDERS)."""

    def add_files(self, root: str, prefix: Any = None) -> None:
        # A checkout has collected nothing: the finders serve the apps' files, and WhiteNoise's
        # warning about the missing directory would only be noise in every process.
        if getattr(self, "use_finders", False) and not os.path.isdir(root):
            return
        super().add_files(root, prefix)
