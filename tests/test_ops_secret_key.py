"""With DEBUG off, a known or short SECRET_KEY (the development default in the source, the
.env.example placeholder) lets anyone forge the admin's sessions: every server refuses to start
with it (chatmem.E008). A checkout with nothing configured (the tests, CI's `manage.py check`,
benchmarks) and README's command 1 (DEBUG=true) still run."""

from __future__ import annotations

import os
import secrets
import subprocess
import sys
from pathlib import Path
from typing import Any

import pytest

from tests.workers import worker_env

ROOT = Path(__file__).resolve().parent.parent
PLACEHOLDER = "change-me-to-a-long-random-string"
DEV_DEFAULT = "django-insecure-chatmem-local-only-set-SECRET_KEY"
# What a gunicorn worker does: load the application, then gunicorn.conf.py's post_worker_init.
GUNICORN_WORKER_BOOT = (
    "import runpy, chatmem_project.wsgi;"
    "runpy.run_path('gunicorn.conf.py')['post_worker_init'](None)"
)


def environment(tmp_path: Path, **given: str) -> dict[str, str]:
    env = {key: value for key, value in os.environ.items() if key not in ("DEBUG", "SECRET_KEY")}
    env.update(
        DJANGO_SETTINGS_MODULE="chatmem_project.settings",
        DATABASE_URL=f"sqlite:///{tmp_path}/boot.sqlite3",
        REDIS_URL="",
        **given,
    )
    return env


def gunicorn_worker_boots(tmp_path: Path, **given: str) -> subprocess.CompletedProcess[str]:
    return subprocess.run(
        [sys.executable, "-c", GUNICORN_WORKER_BOOT],
        cwd=ROOT,
        env=environment(tmp_path, **given),
        capture_output=True,
        text=True,
        timeout=60,
    )


def problems_with(monkeypatch: pytest.MonkeyPatch, settings: Any, **given: str) -> list[str]:
    """chatmem.E008's verdict in process, as a server would reach it with ``given`` in its
    environment (DEBUG and SECRET_KEY as the settings read them)."""
    from chatmem_project.boot import check_secret_key

    for name in ("DEBUG", "SECRET_KEY"):
        monkeypatch.delenv(name, raising=False)
    for name, value in given.items():
        monkeypatch.setenv(name, value)
    settings.DEBUG = given.get("DEBUG", "false") == "true"
    settings.SECRET_KEY = given.get("SECRET_KEY") or DEV_DEFAULT
    return [str(error) for error in check_secret_key()]


@pytest.mark.parametrize(
    ("given", "says"),
    [
        ({"DEBUG": "false", "SECRET_KEY": PLACEHOLDER}, "placeholder from .env.example"),
        ({"DEBUG": "false"}, "development default"),
        ({"SECRET_KEY": DEV_DEFAULT}, "development default"),
        ({"DEBUG": "false", "SECRET_KEY": "x" * 31}, "has 31 characters"),
        ({"SECRET_KEY": "short-but-set"}, "has 13 characters"),
    ],
    ids=["placeholder", "debug-off-no-key", "dev-default-given", "31-chars", "short-no-debug"],
)
def test_a_weak_key_is_refused(
    monkeypatch: pytest.MonkeyPatch, settings: Any, given: dict, says: str
) -> None:
    [problem] = problems_with(monkeypatch, settings, **given)
    assert "chatmem.E008" in problem and says in problem
    assert "token_urlsafe(50)" in problem  # says how to make one


@pytest.mark.parametrize(
    "given",
    [
        {"DEBUG": "false", "SECRET_KEY": secrets.token_urlsafe(50)},
        {"DEBUG": "false", "SECRET_KEY": "y" * 32},
        # openssl rand -base64 32: 256 random bits in 44 characters
        {"DEBUG": "false", "SECRET_KEY": "Zm9vYmFyYmF6cXV4cXV1eGNvcmdlZ3JhdWx0Z2FycGw="},
        {"DEBUG": "true", "SECRET_KEY": PLACEHOLDER},  # local development
        {"DEBUG": "true"},  # README's command 1: scripts/serve.sh sets DEBUG=true
        {},  # a checkout with nothing configured: the test suite's servers, benchmarks
    ],
    ids=[
        "random",
        "32-chars",
        "openssl-base64-32",
        "debug-placeholder",
        "debug-no-key",
        "unconfigured",
    ],
)
def test_a_good_key_or_debug_is_accepted(
    monkeypatch: pytest.MonkeyPatch, settings: Any, given: dict
) -> None:
    assert problems_with(monkeypatch, settings, **given) == []


def test_a_gunicorn_worker_stops_on_a_weak_key_and_boots_with_a_good_one(tmp_path: Path) -> None:
    """The check is wired into what a gunicorn worker runs before it serves."""
    refused = gunicorn_worker_boots(tmp_path, DEBUG="false", SECRET_KEY=PLACEHOLDER)
    assert refused.returncode != 0, refused.stdout + refused.stderr
    assert "chatmem.E008" in refused.stderr, refused.stderr[-2000:]
    good = gunicorn_worker_boots(tmp_path, DEBUG="false", SECRET_KEY=secrets.token_urlsafe(50))
    assert good.returncode == 0, good.stderr[-2000:]


def test_an_unconfigured_checkout_is_warned(tmp_path: Path) -> None:
    result = gunicorn_worker_boots(tmp_path)
    assert result.returncode == 0, result.stderr[-2000:]
    assert "serving with the development SECRET_KEY" in result.stderr


def test_manage_py_check_passes_on_a_bare_checkout(tmp_path: Path) -> None:
    """.ci/run runs `manage.py check` with neither DEBUG nor SECRET_KEY set."""
    result = subprocess.run(
        [sys.executable, "manage.py", "check"],
        cwd=ROOT,
        env=environment(tmp_path),
        capture_output=True,
        text=True,
        timeout=60,
    )
    assert result.returncode == 0, result.stderr


def test_a_celery_worker_refuses_the_placeholder(redis_url: str, tmp_path: Path) -> None:
    env = worker_env(redis_url, DEBUG="false", SECRET_KEY=PLACEHOLDER)
    process = subprocess.run(
        [sys.executable, "-m", "celery", "-A", "chatmem_project", "worker", "--pool", "solo"],
        cwd=ROOT,
        env={**env, "DATABASE_URL": f"sqlite:///{tmp_path}/boot.sqlite3"},
        capture_output=True,
        text=True,
        timeout=60,
    )
    assert process.returncode == 78, process.stdout + process.stderr
    assert "chatmem.E008" in process.stderr
