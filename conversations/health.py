"""Liveness and readiness probes (no authentication)."""

from django.conf import settings
from django.db import connection
from django.http import HttpRequest, JsonResponse


def healthz(request: HttpRequest) -> JsonResponse:
    return JsonResponse({"status": "ok"})


def readyz(request: HttpRequest) -> JsonResponse:
    checks: dict[str, str] = {}
    try:
        with connection.cursor() as cursor:
            cursor.execute("SELECT 1")
        checks["database"] = "ok"
    except Exception as error:
        checks["database"] = f"error: {error.__class__.__name__}"
    if settings.REDIS_URL:
        from memory_worker.runtime import redis_client

        try:
            redis_client(settings.REDIS_URL).ping()
            checks["broker"] = "ok"
        except Exception as error:
            checks["broker"] = f"error: {error.__class__.__name__}"
    else:
        checks["broker"] = "inline (embedded mode, no broker)"
    ready = all(not value.startswith("error") for value in checks.values())
    return JsonResponse(
        {"status": "ready" if ready else "not ready", **checks}, status=200 if ready else 503
    )
