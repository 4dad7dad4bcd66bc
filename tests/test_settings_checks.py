"""Settings that would pass start-up and then fail every turn or fold, or quietly switch
consolidation off, are refused at start-up with the variable's name (chatmem.E006, E007), and
the processes that run the checks stop on them.

With DEBUG off, a known or short SECRET_KEY (the development default in the source, the
.env.example placeholder) lets anyone forge the admin's sessions: every server refuses to start
with it (chatmem.E008). A checkout with nothing configured (the tests, CI's `manage.py check`,
benchmarks) and README's command 1 (DEBUG=true) still run.

With DEBUG off and no model configured a server refuses to start, saying what to set
(chatmem.E009); a real gunicorn given only OPENAI_BASE_URL (no key, as Ollama or vLLM need none)
sends turns to that server."""

from __future__ import annotations

import http.client
import json
import logging
import os
import secrets
import subprocess
import sys
from pathlib import Path
from typing import Any

import pytest
from django.contrib.auth import get_user_model
from django.core.exceptions import ImproperlyConfigured
from rest_framework.authtoken.models import Token

from chatmem_project import boot
from chatmem_project.boot import check_model_configured, check_secret_key
from conversations.checks import check_web_settings
from conversations.services.chats import create_chat
from memory_worker.checks import check_memory_settings
from tests.support.fake_openai import FakeOpenAI
from tests.support.http_turns import send_turn, serving_gunicorn
from tests.support.workers import worker_env
from tests.test_gevent_server import url_of_the_test_database

ROOT = Path(__file__).resolve().parent.parent
DEADLINE = 60
PLACEHOLDER = "change-me-to-a-long-random-string"
DEV_DEFAULT = "django-insecure-chatmem-local-only-set-SECRET_KEY"
# What a gunicorn worker does: load the application, then gunicorn.conf.py's post_worker_init.
GUNICORN_WORKER_BOOT = (
    "import runpy, chatmem_project.wsgi;"
    "runpy.run_path('gunicorn.conf.py')['post_worker_init'](None)"
)


def messages(errors: list[Any], code: str) -> str:
    assert errors and {error.id for error in errors} == {code}, errors
    return " ".join(error.msg for error in errors)


def test_the_defaults_pass() -> None:
    assert check_memory_settings() == []
    assert check_web_settings() == []


@pytest.mark.parametrize(
    ("name", "value", "says"),
    [
        ("MEMORY_DISPATCH", "celary", 'MEMORY_DISPATCH "celary"'),
        ("MEMORY_DISPATCH", "celery", "REDIS_URL is not set"),
        ("MEMORY_SUMMARIZER_BACKEND", "responce", 'MEMORY_SUMMARIZER_BACKEND "responce"'),
        ("MEMORY_SWEEP_INTERVAL_SECONDS", 0.0, "MEMORY_SWEEP_INTERVAL_SECONDS must be greater"),
        ("MEMORY_LLM_TIMEOUT_SECONDS", -1.0, "MEMORY_LLM_TIMEOUT_SECONDS must be greater"),
        ("MEMORY_SWEEP_BATCH", 0, "MEMORY_SWEEP_BATCH must be greater"),
        ("MEMORY_ENQUEUE_DEDUP_SECONDS", -5.0, "must not be negative"),
        ("MEMORY_SUMMARIZER_FALLBACK", "ofline", 'MEMORY_SUMMARIZER_FALLBACK "ofline"'),
        ("MEMORY_INVALID_OUTPUT_RETRY_SECONDS", -1.0, "must not be negative"),
    ],
)
def test_memory_settings_are_checked(settings: Any, name: str, value: Any, says: str) -> None:
    setattr(settings, name, value)  # the unit tests' REDIS_URL is empty
    assert says in messages(check_memory_settings(), "chatmem.E006")


@pytest.mark.parametrize(
    ("name", "value", "says"),
    [
        ("CHAT_BACKEND", "opnai", 'CHAT_BACKEND "opnai"'),
        ("AGENT_SUMMARY_BACKEND", "LLM", 'AGENT_SUMMARY_BACKEND "LLM"'),
        ("MODEL_VARIANTS", '{"fast":"gpt-4o"}', "must look like name=model"),
        ("MODEL_VARIANTS", "fast=gpt-4o:abc", "positive number of tokens"),
        ("MODEL_VARIANTS", "fast=gpt-4o:0", "positive number of tokens"),
        ("TURN_RATE_LIMIT", "120", 'TURN_RATE_LIMIT "120" must look like 120/min'),
        ("TURN_RATE_LIMIT", "120/x", "must look like"),
        ("TURN_RATE_LIMIT", "120 / min", "must look like"),
        ("TURN_RATE_LIMIT", "0/min", "at least 1 turn"),
        ("DB_POOL_MAX_SIZE", -1, "DB_POOL_MAX_SIZE must not be negative"),
        ("LLM_TIMEOUT_SECONDS", 0.0, "LLM_TIMEOUT_SECONDS must be greater"),
        ("CHATMEM_MAX_MESSAGE_CHARS", 0, "CHATMEM_MAX_MESSAGE_CHARS must be greater"),
        ("MODEL_TOKENIZERS", "smollm2", "must look like model=encoding_or_tokenizer.json"),
        ("MODEL_TOKENIZERS", "smollm2=/nowhere/tokenizer.json", "smollm2's tokenizer"),
        ("MODEL_TOKENIZERS", "smollm2=p50k_nonesuch", "smollm2's tokenizer"),
        ("TOKEN_COUNT_MARGIN", 0.8, "TOKEN_COUNT_MARGIN 0.8 must be at least 1"),
        ("UNKNOWN_MODEL_NON_LATIN_MARGIN", 0.5, "UNKNOWN_MODEL_NON_LATIN_MARGIN 0.5 must be"),
    ],
)
def test_web_settings_are_checked(settings: Any, name: str, value: Any, says: str) -> None:
    setattr(settings, name, value)
    assert says in messages(check_web_settings(), "chatmem.E007")


@pytest.mark.parametrize("rate", ["120/min", "5/s", "1000/hour", "3/d", ""])
def test_rates_drf_reads_pass(settings: Any, rate: str) -> None:
    from conversations.throttling import TurnRateThrottle

    settings.TURN_RATE_LIMIT = rate
    assert check_web_settings() == []
    TurnRateThrottle()  # DRF parses the rate here: it would raise on a bad one


# --- how the environment is read: a separate interpreter per case -----------------------------


def settings_in(env: dict[str, str], *names: str) -> Any:
    code = (
        "import json, django; from django.conf import settings; django.setup(); "
        f"print(json.dumps({{n: getattr(settings, n) for n in {list(names)!r}}}, default=str))"
    )
    clean = {k: v for k, v in os.environ.items() if k not in env and k != "DATABASE_URL"}
    result = subprocess.run(
        [sys.executable, "-c", code],
        cwd=ROOT,
        env={**clean, "DJANGO_SETTINGS_MODULE": "chatmem_project.settings", **env},
        capture_output=True,
        text=True,
        timeout=DEADLINE,
    )
    if result.returncode:
        return result.stderr
    return json.loads(result.stdout.strip().splitlines()[-1])


def test_an_empty_dispatch_mode_means_the_default() -> None:
    """.env.example leaves MEMORY_DISPATCH empty: that switched dispatch off."""
    found = settings_in(
        {"MEMORY_DISPATCH": "", "REDIS_URL": "redis://127.0.0.1:6379/15"}, "MEMORY_DISPATCH"
    )
    assert found == {"MEMORY_DISPATCH": "celery"}
    assert settings_in({"MEMORY_DISPATCH": ""}, "MEMORY_DISPATCH") == {"MEMORY_DISPATCH": "inline"}


def test_numbers_are_read_as_written_or_refused_by_name() -> None:
    # An integer is read the same way: a whole number however written (int("1e3") refused it).
    written = {
        "LLM_TIMEOUT_SECONDS": "1e3",
        "MEMORY_SWEEP_BATCH": " 250 ",
        "MEMORY_TASK_TIME_LIMIT": "60.0",
        "DB_POOL_MAX_SIZE": "1e1",
    }
    found = settings_in(written, *written)
    assert found == {
        "LLM_TIMEOUT_SECONDS": 1000.0,  # was 13.0
        "MEMORY_SWEEP_BATCH": 250,
        "MEMORY_TASK_TIME_LIMIT": 60,
        "DB_POOL_MAX_SIZE": 10,
    }
    error = settings_in({"MEMORY_TASK_TIME_LIMIT": "60.5"}, "MEMORY_TASK_TIME_LIMIT")
    assert "MEMORY_TASK_TIME_LIMIT must be an integer, got '60.5'" in error
    error = settings_in({"LLM_TIMEOUT_SECONDS": "3,600"}, "LLM_TIMEOUT_SECONDS")
    assert "LLM_TIMEOUT_SECONDS must be a finite number, got '3,600'" in error  # was 3.6
    error = settings_in({"MEMORY_SWEEP_MIN_COOLDOWN_SECONDS": "nan"}, "DEBUG")
    assert "MEMORY_SWEEP_MIN_COOLDOWN_SECONDS must be a finite number, got 'nan'" in error


def test_an_empty_setting_means_its_default() -> None:
    """An empty setting is its default: django-environ alone would read an empty boolean as
    false and an empty string as itself (a chat model named "", a preset named "" that stops
    every process, default-on settings off). Where empty means something, it still does
    (TURN_RATE_LIMIT: no limit)."""
    empty = ("CHAT_DIRECT_HTTP", "CHAT_MODEL", "MEMORY_POLICY", "LOG_LEVEL", "ALLOWED_HOSTS")
    env = {name: "" for name in (*empty, "TURN_RATE_LIMIT")} | {"MEMORY_DAILY_NOTES": "false"}
    found = settings_in(env, *empty, "TURN_RATE_LIMIT", "MEMORY_DAILY_NOTES")
    assert found == {
        "CHAT_DIRECT_HTTP": True,
        "CHAT_MODEL": "gpt-4o-mini",
        "MEMORY_POLICY": "sliding-window",
        "LOG_LEVEL": "INFO",
        "ALLOWED_HOSTS": ["127.0.0.1", "localhost"],
        "TURN_RATE_LIMIT": "",
        "MEMORY_DAILY_NOTES": False,
    }


def test_an_empty_database_url_means_the_embedded_database() -> None:
    found = settings_in({"DATABASE_URL": ""}, "DATABASES")
    assert found["DATABASES"]["default"]["ENGINE"] == "django.db.backends.sqlite3"


def test_cache_url_alone_gives_a_shared_cache() -> None:
    """docs/operations.md: the turn limit holds across processes with REDIS_URL or CACHE_URL."""
    found = settings_in({"CACHE_URL": "redis://127.0.0.1:6379/14", "REDIS_URL": ""}, "CACHES")
    cache = found["CACHES"]["default"]
    assert cache["BACKEND"] == "django.core.cache.backends.redis.RedisCache"
    assert cache["LOCATION"] == "redis://127.0.0.1:6379/14"


# --- the processes that run the checks stop on them --------------------------------------------


def test_start_up_logs_check_warnings_and_still_refuses_errors(
    settings: Any, caplog: pytest.LogCaptureFixture, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setattr(boot, "check_secret_key", list)  # not what this test is about
    settings.CHAT_MODEL_CONTEXT_TOKENS = 600  # the defaults leave a new chat no room
    with caplog.at_level(logging.WARNING, logger="chatmem.boot"):
        boot.refuse_misconfigured_start()  # a warning: the process starts
    warnings = [r for r in caplog.records if r.levelno == logging.WARNING]
    assert any("chatmem.W001" in record.getMessage() for record in warnings), caplog.text

    settings.MEMORY_POLICY = "no-such-preset"
    with pytest.raises(ImproperlyConfigured, match=r"chatmem\.E003"):
        boot.refuse_misconfigured_start()


@pytest.mark.parametrize("command", ["worker", "beat"])
def test_celery_refuses_to_start_misconfigured(
    redis_url: str, tmp_path: Path, command: str
) -> None:
    """Celery catches what a signal receiver raises and only logs it: the worker must exit
    rather than run on with misordered deadlines."""
    extra = (
        ["-Q", "memory", "--pool", "solo"]
        if command == "worker"
        else ["--schedule", str(tmp_path / "schedule")]
    )
    process = subprocess.run(
        [
            sys.executable,
            "-m",
            "celery",
            "-A",
            "chatmem_project",
            command,
            "--loglevel",
            "INFO",
            *extra,
        ],
        cwd=ROOT,
        # The lock's last expiry (300 + 4000 s) after the visibility timeout (3600 s).
        env=worker_env(redis_url, MEMORY_LOCK_TTL_SECONDS="4000"),
        capture_output=True,
        text=True,
        timeout=DEADLINE,
    )
    assert process.returncode == 78, process.stdout + process.stderr
    assert "chatmem.E001" in process.stderr and "MEMORY_LOCK_TTL_SECONDS" in process.stderr


def test_postgresql_connections_give_up_after_a_connect_timeout() -> None:
    """libpq waits without limit: an unreachable database hung requests and /readyz."""
    found = settings_in({"DATABASE_URL": "postgres://u@10.255.255.1:5432/x"}, "DATABASES")
    assert found["DATABASES"]["default"]["OPTIONS"]["connect_timeout"] == 10
    found = settings_in(
        {"DATABASE_URL": "postgres://u@10.255.255.1:5432/x", "DB_CONNECT_TIMEOUT": "3"},
        "DATABASES",
    )
    assert found["DATABASES"]["default"]["OPTIONS"]["connect_timeout"] == 3


# --- SECRET_KEY: a known or short one stops every server (chatmem.E008) ---------------------------


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
    for name in ("DEBUG", "SECRET_KEY"):
        monkeypatch.delenv(name, raising=False)
    for name, value in given.items():
        monkeypatch.setenv(name, value)
    settings.DEBUG = given.get("DEBUG", "false") == "true"
    settings.SECRET_KEY = given.get("SECRET_KEY") or DEV_DEFAULT
    settings.UNCONFIGURED_CHECKOUT = not (given.get("DEBUG") or given.get("SECRET_KEY"))
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
    good = gunicorn_worker_boots(
        tmp_path, DEBUG="false", SECRET_KEY=secrets.token_urlsafe(50), **A_LOCAL_SERVER
    )
    assert good.returncode == 0, good.stderr[-2000:]


# --- no model: a deployment refuses to serve the offline echo unless told (chatmem.E009) -----

A_LOCAL_SERVER = {"OPENAI_BASE_URL": "http://127.0.0.1:11434/v1", "OPENAI_API_KEY": ""}
NO_MODEL = {"OPENAI_BASE_URL": "", "OPENAI_API_KEY": "", "CHAT_BACKEND": ""}


@pytest.mark.parametrize(
    ("given", "refused"),
    [
        ({}, True),
        (A_LOCAL_SERVER, False),  # a base URL alone: Ollama, vLLM, llama.cpp
        ({"OPENAI_API_KEY": "sk-test"}, False),
        ({"CHAT_BACKEND": "offline"}, False),  # the echo model is meant
        ({"DEBUG": "true"}, False),  # development
    ],
    ids=["nothing", "base-url-only", "key-only", "offline-meant", "debug"],
)
def test_a_deployment_without_a_model_is_refused_unless_offline_is_meant(
    monkeypatch: pytest.MonkeyPatch, settings: Any, given: dict, refused: bool
) -> None:
    settings.UNCONFIGURED_CHECKOUT = False  # SECRET_KEY given: a deployment, not a checkout
    settings.DEBUG = given.get("DEBUG") == "true"
    settings.OPENAI_BASE_URL = given.get("OPENAI_BASE_URL") or None
    settings.OPENAI_API_KEY = given.get("OPENAI_API_KEY", "")
    settings.CHAT_BACKEND = given.get("CHAT_BACKEND", "")
    problems = [str(error) for error in check_model_configured()]
    if refused:
        [problem] = problems
        assert "chatmem.E009" in problem and "OPENAI_BASE_URL" in problem
        assert "CHAT_BACKEND=offline" in problem  # says how to mean it
    else:
        assert problems == []


def test_a_gunicorn_worker_stops_when_no_model_is_configured(tmp_path: Path) -> None:
    key = secrets.token_urlsafe(50)
    refused = gunicorn_worker_boots(tmp_path, DEBUG="false", SECRET_KEY=key, **NO_MODEL)
    assert refused.returncode != 0, refused.stdout + refused.stderr
    assert "chatmem.E009" in refused.stderr, refused.stderr[-2000:]
    # What to set, in the message the operator sees: a model endpoint, or the echo model meant.
    assert "OPENAI_BASE_URL" in refused.stderr and "CHAT_BACKEND=offline" in refused.stderr
    meant = gunicorn_worker_boots(
        tmp_path, DEBUG="false", SECRET_KEY=key, **{**NO_MODEL, "CHAT_BACKEND": "offline"}
    )
    assert meant.returncode == 0, meant.stderr[-2000:]
    assert "serving with the offline echo model" in meant.stderr


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


def test_a_server_started_with_only_a_base_url_sends_turns_to_it(
    require_postgres: None, fake_openai: FakeOpenAI
) -> None:
    """A real gunicorn, started as a self-hoster starts one for Ollama or vLLM: DEBUG off, a
    SECRET_KEY, OPENAI_BASE_URL and no OPENAI_API_KEY (nor CHAT_BACKEND): it starts, and a turn
    is answered by that server, not the offline echo model."""
    owner = get_user_model().objects.create_user(username="self-hoster")
    token = Token.objects.create(user=owner).key
    chat = create_chat(owner, title="first hour")
    env = {
        key: value
        for key, value in os.environ.items()
        if key not in ("DEBUG", "CHAT_BACKEND", "MEMORY_SUMMARIZER_BACKEND", "OPENAI_API_KEY")
    }
    env.update(
        DJANGO_SETTINGS_MODULE="chatmem_project.settings",
        DATABASE_URL=url_of_the_test_database(),
        REDIS_URL="",
        DEBUG="false",
        SECRET_KEY=secrets.token_urlsafe(50),
        OPENAI_BASE_URL=fake_openai.base_url,
        CHAT_MODEL="fake-chat",
        TURN_RATE_LIMIT="",
        CHATMEM_HTTPS="proxy",  # plain HTTP here, as behind a TLS-terminating proxy
    )
    with serving_gunicorn(env, "gthread", 2, DEADLINE) as port:
        connection = http.client.HTTPConnection("127.0.0.1", port, timeout=DEADLINE)
        send_turn(connection, token, chat.pk, {"content": "Hello"}, "application/json")
        response = connection.getresponse()
        body = json.loads(response.read())
    assert response.status == 201, body
    [request] = fake_openai.chat_requests()
    assert request.body["messages"][-1]["content"] == "Hello"
    assert body["assistant_message"]["content"].startswith("fake reply #1"), body
