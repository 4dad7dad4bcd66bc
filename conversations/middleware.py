"""Request body size limit: a body larger than CHATMEM_MAX_BODY_BYTES is refused with a JSON 413
before anything reads it (Django's own limit would answer a bare 400). The health probes and
Prometheus' scrape. Static files."""

import os
from collections.abc import Callable
from typing import Any

from django.conf import settings
from django.http import HttpRequest, HttpResponse, JsonResponse
from whitenoise.middleware import WhiteNoiseMiddleware

from conversations.health import healthz, readyz
from conversations.metrics import metrics_view


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
    "/metrics": metrics_view,  # still asks for METRICS_TOKEN when one is set
}


class ProbeMiddleware:
    """``/healthz``, ``/readyz`` (served only here, not routed) and ``/metrics``, answered first,
    whatever the Host header and over plain HTTP: a probe calls the container by its own address
    (compose's healthcheck: 127.0.0.1), Prometheus by its service name (web:8000), which a
    production ALLOWED_HOSTS rightly leaves out, so CommonMiddleware's host check answered them
    400 (and SECURE_SSL_REDIRECT a 301 to an https:// the container does not serve): the
    container was never healthy, nothing was scraped. Nothing else skips those."""

    def __init__(self, get_response: Callable[[HttpRequest], HttpResponse]) -> None:
        self.get_response = get_response

    def __call__(self, request: HttpRequest) -> HttpResponse:
        probe = PROBES.get(request.path)
        return probe(request) if probe is not None else self.get_response(request)


class StaticFilesMiddleware(WhiteNoiseMiddleware):
    """WhiteNoise: gunicorn serves no static files of its own, so Swagger UI (/api/v1/docs/) was a
    blank page and the admin unstyled. Files come from STATIC_ROOT once collectstatic has filled
    it (the image), else from the installed apps (settings.WHITENOISE_USE_FINDERS)."""

    def add_files(self, root: str, prefix: Any = None) -> None:
        # A checkout has collected nothing: the finders serve the apps' files, and WhiteNoise's
        # warning about the missing directory would only be noise in every process.
        if getattr(self, "use_finders", False) and not os.path.isdir(root):
            return
        super().add_files(root, prefix)
