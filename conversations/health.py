"""Liveness and readiness probes (no authentication).

Ready means turns can be served: the database answers and has every migration applied. The broker is
reported but does not decide: turns never wait on memory work (promise 5, docs/design.md), a publish
that fails is logged and the sweep catches up, so a Redis outage must not take every web replica out
of service."""

import logging
import threading

from django.conf import settings
from django.db import connection
from django.db.migrations.executor import MigrationExecutor
from django.http import HttpRequest, JsonResponse

from memory_worker.memory import redis_client

log = logging.getLogger("chatmem.health")

# Set once this process has seen an empty migration plan: migrations are not unapplied while it
# runs, so a probe does not rebuild the migration graph (every file read) each time.
_migrations_applied = threading.Event()


def healthz(request: HttpRequest) -> JsonResponse:
    return JsonResponse({"status": "ok"})


def unapplied_migrations() -> int:
    """How many migrations the database still lacks (0 once seen, without asking again)."""
    if _migrations_applied.is_set():
        return 0
    executor = MigrationExecutor(connection)
    plan = executor.migration_plan(executor.loader.graph.leaf_nodes())
    if not plan:
        _migrations_applied.set()
    return len(plan)


def database_state() -> str:
    try:
        with connection.cursor() as cursor:
            cursor.execute("SELECT 1")
        missing = unapplied_migrations()
    except Exception as error:
        return f"error: {error.__class__.__name__}"
    if missing:
        # Every request would fail on a missing table or column: run `manage.py migrate`.
        return f"error: {missing} migration(s) not applied"
    return "ok"


def broker_state() -> str:
    if not settings.REDIS_URL:
        return "inline (embedded mode, no broker)"
    try:
        redis_client(settings.REDIS_URL).ping()
    except Exception as error:
        # Reported, but the process stays ready (the module's docstring).
        return f"error: {error.__class__.__name__}"
    return "ok"


def readyz(request: HttpRequest) -> JsonResponse:
    database = database_state()
    ready = database == "ok"
    broker = broker_state()
    response = JsonResponse(
        {"status": "ready" if ready else "not ready", "database": database, "broker": broker},
        status=200 if ready else 503,
    )
    if not ready:
        # A not-ready answer is the probe doing its job, not a server error: one WARNING with
        # the reason, instead of django.request's ERROR "Service Unavailable: /readyz" (every
        # probe, every replica, for as long as the database is down). Django logs no response
        # marked as logged already.
        log.warning(
            "not ready: database %s",
            database,
            extra={"event": "not_ready", "database": database, "broker": broker},
        )
        response._has_been_logged = True  # type: ignore[attr-defined]
    return response
