"""The probes (conversations.health's /healthz and /readyz, and /metrics) as an orchestrator and
Prometheus reach them: inside the compose network, by the container's address or service name,
over plain HTTP, whatever the Host header. Readiness is decided by the database; the broker is
reported."""

from __future__ import annotations

from collections.abc import Iterator
from typing import Any

import pytest
from django.db import connection
from django.db.migrations.recorder import MigrationRecorder
from django.test.utils import CaptureQueriesContext

from conversations import health

pytestmark = pytest.mark.django_db


@pytest.fixture(autouse=True)
def _migration_state_forgotten() -> Iterator[None]:
    """Readiness remembers, per process, that the migrations were all applied."""
    remembered = getattr(health, "_migrations_applied", None)
    if remembered is not None:
        remembered.clear()
    yield
    if remembered is not None:
        remembered.clear()


# --- /healthz and /readyz: answered whatever the Host header -----------------------------------


def test_probes_answer_whatever_the_host_header(client, settings) -> None:  # type: ignore[no-untyped-def]
    """docker-compose's healthcheck calls http://127.0.0.1:8000/readyz; a production
    ALLOWED_HOSTS leaves that address out, and a 400 there would mean never healthy."""
    settings.ALLOWED_HOSTS = ["chat.example.com"]
    for path in ("/healthz", "/readyz"):
        response = client.get(path, HTTP_HOST="127.0.0.1:8000")
        assert response.status_code == 200, (path, response.content)
    # Everything else still checks the host.
    assert client.get("/api/v1/policies/", HTTP_HOST="127.0.0.1:8000").status_code == 400
    assert client.get("/api/v1/policies/", HTTP_HOST="chat.example.com").status_code == 401


# --- /metrics: host check and HTTPS redirect, like the probes ----------------------------------


@pytest.fixture
def production(settings: Any) -> Any:
    settings.ALLOWED_HOSTS = ["chat.example.com"]
    settings.SECURE_SSL_REDIRECT = True
    return settings


def test_prometheus_scrapes_the_web_service_by_its_compose_name(
    client: Any, production: Any
) -> None:
    """Host web:8000 is not in ALLOWED_HOSTS and the scrape is plain HTTP: answered all the same,
    neither a 400 nor a 301 to https://."""
    response = client.get("/metrics", HTTP_HOST="web:8000")
    assert response.status_code == 200, response.content[:200]
    assert b"chatmem_turn_seconds" in response.content
    production.ALLOWED_HOSTS = ["chat.example.com", "web"]
    assert client.get("/metrics", HTTP_HOST="web:8000").status_code == 200  # no redirect


def test_the_metrics_token_is_still_required(client: Any, production: Any) -> None:
    production.METRICS_TOKEN = "s3cret"
    assert client.get("/metrics", HTTP_HOST="web:8000").status_code == 401
    authorized = client.get("/metrics", HTTP_HOST="web:8000", HTTP_AUTHORIZATION="Bearer s3cret")
    assert authorized.status_code == 200


def test_everything_else_still_checks_the_host_and_redirects(client: Any, production: Any) -> None:
    assert client.get("/api/v1/policies/", HTTP_HOST="web:8000").status_code == 400
    assert client.get("/api/v1/policies/", HTTP_HOST="chat.example.com").status_code == 301


# --- /readyz: the database decides, the broker is reported -------------------------------------


def test_a_dead_broker_is_reported_but_the_web_stays_ready(client: Any, settings: Any) -> None:
    """Turns never wait on Redis: a 503 would take every web replica out of service for nothing."""
    settings.REDIS_URL = "redis://127.0.0.1:1/0"
    response = client.get("/readyz")
    assert response.status_code == 200
    body = response.json()
    assert body["status"] == "ready" and body["database"] == "ok"
    assert body["broker"].startswith("error")


def test_readyz_reports_a_dead_broker(client, settings) -> None:  # type: ignore[no-untyped-def]
    """Reported, but ready: turns do not need the broker (promise 5, docs/design.md)."""
    settings.REDIS_URL = "redis://127.0.0.1:1/0"
    response = client.get("/readyz")
    assert response.status_code == 200
    body = response.json()
    assert body["database"] == "ok" and body["broker"].startswith("error")


def test_a_database_missing_migrations_is_not_ready(client: Any) -> None:
    """SELECT 1 alone would say ready on a database migrate never ran on, where every request
    fails."""
    recorder = MigrationRecorder(connection)
    latest = recorder.migration_qs.filter(app="conversations").order_by("-id").first()
    assert latest is not None
    recorder.record_unapplied(latest.app, latest.name)  # rolled back with the test
    response = client.get("/readyz")
    assert response.status_code == 503
    body = response.json()
    assert body["status"] == "not ready"
    assert body["database"] == "error: 1 migration(s) not applied"
    recorder.record_applied(latest.app, latest.name)
    assert client.get("/readyz").status_code == 200


def test_a_ready_process_does_not_read_the_migrations_again(client: Any) -> None:
    assert client.get("/readyz").status_code == 200
    with CaptureQueriesContext(connection) as queries:
        assert client.get("/readyz").status_code == 200
    assert [query["sql"] for query in queries] == ["SELECT 1"]
