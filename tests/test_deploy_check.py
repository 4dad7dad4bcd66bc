"""Production settings pass Django's deployment checklist (`check --deploy`), warnings included;
the embedded defaults (plain HTTP, local secret) do not, so the check is real."""

from __future__ import annotations

import os
import secrets
import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent

PRODUCTION = {
    "DEBUG": "false",
    "ALLOWED_HOSTS": "chat.example.com",
    "SECURE_SSL_REDIRECT": "true",
    "SECURE_HSTS_SECONDS": "31536000",
    "SECURE_HSTS_INCLUDE_SUBDOMAINS": "true",
    "SECURE_HSTS_PRELOAD": "true",
    "SESSION_COOKIE_SECURE": "true",
    "CSRF_COOKIE_SECURE": "true",
}


def deploy_check(tmp_path: Path, extra: dict[str, str]) -> subprocess.CompletedProcess[str]:
    env = {
        key: value
        for key, value in os.environ.items()
        if not key.startswith(("SECURE_", "SESSION_", "CSRF_", "DJANGO_SETTINGS"))
    }
    env.update(
        DATABASE_URL=f"sqlite:///{tmp_path}/deploy.sqlite3",
        REDIS_URL="",
        **extra,
    )
    command = [sys.executable, "manage.py", "check", "--deploy", "--fail-level", "WARNING"]
    return subprocess.run(command, cwd=ROOT, env=env, capture_output=True, text=True, timeout=120)


def test_production_settings_pass_check_deploy(tmp_path: Path) -> None:
    result = deploy_check(tmp_path, {**PRODUCTION, "SECRET_KEY": secrets.token_urlsafe(50)})
    assert result.returncode == 0, result.stderr + result.stdout


def test_embedded_defaults_are_flagged(tmp_path: Path) -> None:
    result = deploy_check(tmp_path, {"SECRET_KEY": "django-insecure-x"})
    assert result.returncode != 0
    assert "security.W008" in result.stderr and "security.W009" in result.stderr


def test_a_bounded_connection_pool_can_replace_persistent_connections() -> None:
    env = {
        **os.environ,
        "DATABASE_URL": "postgres://postgres@127.0.0.1:5432/chatmem",
        "DB_POOL_MAX_SIZE": "40",
    }
    script = (
        "import django, json; django.setup(); from django.conf import settings;"
        "db = settings.DATABASES['default'];"
        "print(json.dumps([db['CONN_MAX_AGE'], db['OPTIONS']['pool']['max_size']]))"
    )
    out = subprocess.run(
        [sys.executable, "-c", script],
        cwd=ROOT,
        env={**env, "DJANGO_SETTINGS_MODULE": "chatmem_project.settings"},
        capture_output=True,
        text=True,
        timeout=60,
        check=True,
    )
    assert out.stdout.strip().splitlines()[-1] == "[0, 40]"
