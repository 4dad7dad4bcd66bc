"""Request body size limit: a body larger than CHATMEM_MAX_BODY_BYTES is refused with a JSON 413
before anything reads it (Django's own limit would answer a bare 400). The health probes."""

from collections.abc import Callable

from django.conf import settings
from django.http import HttpRequest, HttpResponse, JsonResponse

from conversations.health import healthz, readyz


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


PROBES: dict[str, Callable[[HttpRequest], HttpResponse]] = {
    "/healthz": healthz,
    "/readyz": readyz,
}


class ProbeMiddleware:
    """``/healthz`` and ``/readyz`` (served only here, not routed), answered first, whatever the
    Host header: a probe calls the container by its own address (compose's healthcheck:
    127.0.0.1), which a production ALLOWED_HOSTS rightly leaves out, so CommonMiddleware's host
    check answered it 400 and the container was never healthy. Nothing else skips that check."""

    def __init__(self, get_response: Callable[[HttpRequest], HttpResponse]) -> None:
        self.get_response = get_response

    def __call__(self, request: HttpRequest) -> HttpResponse:
        probe = PROBES.get(request.path)
        return probe(request) if probe is not None else self.get_response(request)
