"""Request body size limit: a body larger than CHATMEM_MAX_BODY_BYTES is refused with a JSON 413
before anything reads it (Django's own limit would answer a bare 400)."""

from collections.abc import Callable

from django.conf import settings
from django.http import HttpRequest, HttpResponse, JsonResponse


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
            return JsonResponse(
                {
                    "detail": f"The request body is {length} bytes; the limit is {limit} bytes.",
                    "code": "request_too_large",
                },
                status=413,
            )
        return self.get_response(request)


class ProbeMiddleware:
    """``/healthz`` and ``/readyz`` answered first, whatever the Host header: a probe calls the
    container by its own address (compose's healthcheck: 127.0.0.1), which a production
    ALLOWED_HOSTS rightly leaves out, so CommonMiddleware's host check answered it 400 and the
    container was never healthy. Nothing else skips that check."""

    def __init__(self, get_response: Callable[[HttpRequest], HttpResponse]) -> None:
        self.get_response = get_response

    def __call__(self, request: HttpRequest) -> HttpResponse:
        from conversations.health import healthz, readyz

        if request.path == "/healthz":
            return healthz(request)
        if request.path == "/readyz":
            return readyz(request)
        return self.get_response(request)
