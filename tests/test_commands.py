"""Management commands and probes that scripts rely on."""

import io

import pytest
from django.core.management import CommandError, call_command
from rest_framework.authtoken.models import Token

pytestmark = pytest.mark.django_db


def run(*args: str) -> str:
    out = io.StringIO()
    call_command("issue_token", *args, stdout=out)
    return out.getvalue()


def test_issue_token_prints_only_the_key_and_is_stable() -> None:
    key = run("carol", "--create-user").strip()
    assert len(key) == 40 and key == Token.objects.get(user__username="carol").key
    assert run("carol").strip() == key  # the same key again: scripts can call it twice
    rotated = run("carol", "--rotate").strip()
    assert rotated != key and not Token.objects.filter(key=key).exists()
    run("carol", "--revoke")
    assert not Token.objects.filter(user__username="carol").exists()


def test_issue_token_refuses_unknown_user_without_create() -> None:
    with pytest.raises(CommandError, match="--create-user"):
        run("nobody")


def test_issued_token_authenticates(client) -> None:  # type: ignore[no-untyped-def]
    key = run("dave", "--create-user").strip()
    assert client.get("/api/v1/chats/", HTTP_AUTHORIZATION=f"Token {key}").status_code == 200


def test_probes_answer_whatever_the_host_header(client, settings) -> None:  # type: ignore[no-untyped-def]
    """docker-compose's healthcheck calls http://127.0.0.1:8000/readyz; a production
    ALLOWED_HOSTS leaves that address out, and the probe was a 400: never healthy."""
    settings.ALLOWED_HOSTS = ["chat.example.com"]
    for path in ("/healthz", "/readyz"):
        response = client.get(path, HTTP_HOST="127.0.0.1:8000")
        assert response.status_code == 200, (path, response.content)
    # Everything else still checks the host.
    assert client.get("/api/v1/policies/", HTTP_HOST="127.0.0.1:8000").status_code == 400
    assert client.get("/api/v1/policies/", HTTP_HOST="chat.example.com").status_code == 401


def test_readyz_reports_a_dead_broker(client, settings) -> None:  # type: ignore[no-untyped-def]
    settings.REDIS_URL = "redis://127.0.0.1:1/0"
    response = client.get("/readyz")
    assert response.status_code == 503
    body = response.json()
    assert body["database"] == "ok" and body["broker"].startswith("error")


def test_deadline_order_is_checked_at_start_up(settings) -> None:  # type: ignore[no-untyped-def]
    from memory_worker.checks import check_deadlines

    assert check_deadlines() == []
    settings.MEMORY_LOCK_TTL_SECONDS = 100  # below the hard time limit
    errors = check_deadlines()
    assert [error.id for error in errors] == ["chatmem.E001"]
    assert "MEMORY_TASK_TIME_LIMIT" in errors[0].msg


def test_unknown_default_policy_is_refused_at_start_up(settings) -> None:  # type: ignore[no-untyped-def]
    from memory_worker.checks import check_default_policy

    assert check_default_policy() == []
    settings.MEMORY_POLICY = "slidingwindow"
    assert [error.id for error in check_default_policy()] == ["chatmem.E003"]


def test_brief_works_while_redis_is_down(api, settings) -> None:  # type: ignore[no-untyped-def]
    from memory_worker.runtime import _lock

    chat_id = api.post("/api/v1/chats/", {}, format="json").json()["id"]
    settings.REDIS_URL = "redis://127.0.0.1:1/0"
    _lock.cache_clear()
    try:
        response = api.get(f"/api/v1/chats/{chat_id}/brief/")
    finally:
        _lock.cache_clear()
    assert response.status_code == 200
    assert response.json()["pending"] is False
