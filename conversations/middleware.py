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
