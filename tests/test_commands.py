"""Management commands that scripts rely on; issue_token checks a new user name as the user
model does."""

import io

import pytest
from django.contrib.auth import get_user_model
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


@pytest.mark.parametrize("name", ["", "x" * 200, "a b/c", "nul\x00", "caf\udce9"])
def test_issue_token_refuses_a_name_the_user_model_refuses(name: str) -> None:
    """Unchecked, an empty name is a ValueError traceback, 200 characters a DataError on
    PostgreSQL, "a b/c" a user the admin could not have created."""
    with pytest.raises(CommandError, match="invalid username"):
        call_command("issue_token", name, "--create-user", stdout=io.StringIO())
    # Looked up, not created: only what the database cannot compare is refused outright.
    with pytest.raises(CommandError, match=r"invalid username|No user"):
        call_command("issue_token", name, stdout=io.StringIO())
    assert not get_user_model().objects.exists()


def test_an_existing_user_with_a_name_checks_would_refuse_stays_reachable() -> None:
    """A user stored under a name the check would refuse (an importer's, say) must keep its
    tokens revocable: the full check is for new names only."""
    user = get_user_model().objects.create(username="a b/c")
    Token.objects.create(user=user)
    call_command("issue_token", "a b/c", "--revoke", stdout=io.StringIO())
    assert not Token.objects.filter(user=user).exists()


def test_deadline_order_is_checked_at_start_up(settings) -> None:  # type: ignore[no-untyped-def]
    from memory_worker.checks import check_deadlines

    assert check_deadlines() == []
    settings.BROKER_VISIBILITY_TIMEOUT = 310  # below the lock's last expiry (300 + 20)
    errors = check_deadlines()
    assert [error.id for error in errors] == ["chatmem.E001"]
    assert "MEMORY_TASK_TIME_LIMIT + MEMORY_LOCK_TTL_SECONDS" in errors[0].msg


def test_unknown_default_policy_is_refused_at_start_up(settings) -> None:  # type: ignore[no-untyped-def]
    from memory_worker.checks import check_default_policy

    assert check_default_policy() == []
    settings.MEMORY_POLICY = "slidingwindow"
    assert [error.id for error in check_default_policy()] == ["chatmem.E003"]


def test_brief_works_while_redis_is_down(api, settings) -> None:  # type: ignore[no-untyped-def]
    from memory_worker.coordination.runtime import _lock

    chat_id = api.post("/api/v1/chats/", {}, format="json").json()["id"]
    settings.REDIS_URL = "redis://127.0.0.1:1/0"
    _lock.cache_clear()
    try:
        response = api.get(f"/api/v1/chats/{chat_id}/brief/")
    finally:
        _lock.cache_clear()
    assert response.status_code == 200
    assert response.json()["pending"] is False


def test_serve_demo_refuses_a_real_database(monkeypatch) -> None:  # type: ignore[no-untyped-def]
    """It creates a superuser with a password it prints: on a production DATABASE_URL (read from
    .env) that was a known-password admin."""
    from django.db import connection

    from conversations.management.commands import serve_demo

    served: list[str] = []
    monkeypatch.setattr(serve_demo, "call_command", lambda name, *a, **k: served.append(name))
    if connection.vendor == "sqlite":
        pytest.skip("the refusal is for other databases")
    with pytest.raises(CommandError, match="embedded SQLite database only"):
        call_command("serve_demo", stdout=io.StringIO())
    assert served == [] and not get_user_model().objects.filter(username="demo").exists()


def test_serve_demo_prints_an_address_and_login_that_work(user) -> None:  # type: ignore[no-untyped-def]
    from conversations.management.commands.serve_demo import Command, admin_login

    command = Command(stdout=io.StringIO())
    # Host "0.0.0.0" is refused by ALLOWED_HOSTS: print where the server can be reached.
    assert command.reachable("0.0.0.0:8000") == "127.0.0.1:8000"
    assert command.reachable("8001") == "127.0.0.1:8001"
    assert command.reachable("localhost:9000") == "localhost:9000"
    assert admin_login(user, created=True).endswith("password demo-password")
    assert "not staff" in admin_login(user, created=False)


def test_serve_demo_second_run_tells_whether_the_printed_password_still_works(user) -> None:  # type: ignore[no-untyped-def]
    """A second run said "its own password" of a demo user still on the printed one."""
    from conversations.management.commands.serve_demo import DEMO_PASSWORD, admin_login

    user.is_staff = True
    user.set_password(DEMO_PASSWORD)
    user.save()
    assert admin_login(user, created=False) == (
        f"user {user.get_username()}, password {DEMO_PASSWORD} (unchanged since the first run)"
    )
    user.set_password("something-else-entirely")
    user.save()
    login = admin_login(user, created=False)
    assert "a password of its own" in login and "something-else" not in login
