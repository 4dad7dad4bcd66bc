"""Production settings pass Django's deployment checklist (`check --deploy`), warnings included:
with DEBUG off the HTTPS settings default on (CHATMEM_HTTPS), so SECRET_KEY and ALLOWED_HOSTS
alone pass, and a deployment behind a TLS-terminating proxy (CHATMEM_HTTPS=proxy) passes too.
The embedded defaults (DEBUG on, plain HTTP) do not, so the check is real."""

from __future__ import annotations

import json
import os
import secrets
import subprocess
import sys
from pathlib import Path
from typing import Any

import pytest

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
# What a deployment gives, and nothing else: no DATABASE_URL, no model, no HTTPS setting.
MINIMAL = {"DEBUG": "false", "ALLOWED_HOSTS": "chat.example.com"}


def clean_env(tmp_path: Path, extra: dict[str, str]) -> dict[str, str]:
    """Only what a shell needs, the interpreter's path and ``extra``: nothing of the test run's
    own environment (DATABASE_URL, REDIS_URL, CHATMEM_*) leaks in. The working directory has no
    .env (settings would read it)."""
    keep = ("PATH", "HOME", "LANG", "PYTHONPATH", "VIRTUAL_ENV")
    env = {key: os.environ[key] for key in keep if key in os.environ}
    env["STATIC_ROOT"] = str(tmp_path / "static")  # none: whitenoise's finders, as in a checkout
    return {**env, **extra}


def deploy_check(tmp_path: Path, extra: dict[str, str]) -> subprocess.CompletedProcess[str]:
    command = [sys.executable, "manage.py", "check", "--deploy", "--fail-level", "WARNING"]
    return subprocess.run(
        command,
        cwd=ROOT,
        env=clean_env(tmp_path, extra),
        capture_output=True,
        text=True,
        timeout=120,
    )


def test_secret_key_and_allowed_hosts_alone_pass_check_deploy(tmp_path: Path) -> None:
    result = deploy_check(tmp_path, {**MINIMAL, "SECRET_KEY": secrets.token_urlsafe(50)})
    assert result.returncode == 0, result.stderr + result.stdout
    assert "no issues" in result.stdout


def test_behind_a_tls_proxy_one_setting_passes_check_deploy(tmp_path: Path) -> None:
    proxy = {**MINIMAL, "SECRET_KEY": secrets.token_urlsafe(50), "CHATMEM_HTTPS": "proxy"}
    result = deploy_check(tmp_path, proxy)
    assert result.returncode == 0, result.stderr + result.stdout


def test_explicit_production_settings_pass_check_deploy(tmp_path: Path) -> None:
    result = deploy_check(tmp_path, {**PRODUCTION, "SECRET_KEY": secrets.token_urlsafe(50)})
    assert result.returncode == 0, result.stderr + result.stdout


def test_embedded_defaults_are_flagged(tmp_path: Path) -> None:
    result = deploy_check(tmp_path, {"DEBUG": "true", "SECRET_KEY": "django-insecure-x"})
    assert result.returncode != 0
    for warning in ("W004", "W008", "W009", "W012", "W016", "W018"):
        assert f"security.{warning}" in result.stderr, warning


def test_plain_http_with_debug_off_is_flagged(tmp_path: Path) -> None:
    off = {**MINIMAL, "SECRET_KEY": secrets.token_urlsafe(50), "CHATMEM_HTTPS": "off"}
    result = deploy_check(tmp_path, off)
    assert result.returncode != 0
    assert "security.W008" in result.stderr and "security.W012" in result.stderr


def https_settings(tmp_path: Path, extra: dict[str, str]) -> Any:
    names = [
        "CHATMEM_HTTPS",
        "SECURE_SSL_REDIRECT",
        "SECURE_HSTS_SECONDS",
        "SESSION_COOKIE_SECURE",
        "CSRF_COOKIE_SECURE",
        "SECURE_PROXY_SSL_HEADER",
    ]
    code = (
        "import json, django; from django.conf import settings; django.setup(); "
        f"print(json.dumps({{n: getattr(settings, n, None) for n in {names!r}}}))"
    )
    env = {**clean_env(tmp_path, extra), "DJANGO_SETTINGS_MODULE": "chatmem_project.settings"}
    result = subprocess.run(
        [sys.executable, "-c", code], cwd=ROOT, env=env, capture_output=True, text=True, timeout=60
    )
    if result.returncode:
        return result.stderr
    return json.loads(result.stdout.strip().splitlines()[-1])


@pytest.mark.parametrize(
    ("extra", "mode", "redirect", "secure_cookies"),
    [
        ({"DEBUG": "false", "SECRET_KEY": "k" * 50}, "on", True, True),
        ({"DEBUG": "false", "CHATMEM_HTTPS": "proxy"}, "proxy", False, True),
        # The quickstart (scripts/serve.sh sets DEBUG=true): plain HTTP on 127.0.0.1:8000.
        ({"DEBUG": "true"}, "off", False, False),
        # A checkout run as it is (the tests, benchmarks): plain HTTP too.
        ({}, "off", False, False),
        # A setting of its own wins over the mode.
        ({"DEBUG": "false", "SECURE_SSL_REDIRECT": "false"}, "on", False, True),
    ],
)
def test_who_serves_https(
    tmp_path: Path, extra: dict[str, str], mode: str, redirect: bool, secure_cookies: bool
) -> None:
    found = https_settings(tmp_path, extra)
    assert isinstance(found, dict), found
    assert found["CHATMEM_HTTPS"] == mode
    assert found["SECURE_SSL_REDIRECT"] is redirect
    assert found["SESSION_COOKIE_SECURE"] is found["CSRF_COOKIE_SECURE"] is secure_cookies
    assert (found["SECURE_HSTS_SECONDS"] > 0) is secure_cookies
    assert (found["SECURE_PROXY_SSL_HEADER"] is not None) is (mode == "proxy")


def test_an_unknown_https_mode_stops_start_up(tmp_path: Path) -> None:
    found = https_settings(tmp_path, {"DEBUG": "false", "CHATMEM_HTTPS": "yes"})
    assert 'CHATMEM_HTTPS "yes" is not one of on, proxy, off' in found


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
