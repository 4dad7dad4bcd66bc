"""Shared fixtures. Tests that need PostgreSQL, Redis or a Celery worker skip loudly on a laptop
without them, and fail under CI=true (they must run in CI)."""

import os
import warnings
from collections.abc import Iterator

import pytest

from memory_worker.coordination.request_redis import reset_breaker
from tests.support.fake_openai import FakeOpenAI
from tests.support.workers import point_celery_at

IN_CI = os.environ.get("CI", "").lower() in {"1", "true", "yes"}


# scripts/test.sh gives each of its processes a Redis db of its own (the tests flush theirs).
TEST_REDIS_URL = os.environ.get("TEST_REDIS_URL", "")


def require(what: str, reason: str) -> None:
    message = f"{what} is required but not available: {reason}"
    if IN_CI:
        pytest.fail(f"CI=true: {message}", pytrace=False)
    warnings.warn(f"SKIPPING: {message}", stacklevel=2)
    pytest.skip(f"LOUD SKIP: {message}")


@pytest.fixture
def require_postgres(transactional_db: None) -> None:
    from django.db import connection

    if connection.vendor != "postgresql":
        require("PostgreSQL", f"DATABASE_URL points at {connection.vendor}; set it to postgres://")


@pytest.fixture(scope="session")
def redis_url() -> str:
    if not TEST_REDIS_URL:
        require("Redis", "TEST_REDIS_URL is not set (scripts/test.sh sets it when 6379 answers)")
    import redis

    try:
        redis.Redis.from_url(TEST_REDIS_URL, socket_connect_timeout=1).ping()
    except redis.RedisError as error:
        require("Redis", f"{TEST_REDIS_URL} does not answer: {error}")
    return TEST_REDIS_URL


@pytest.fixture
def clean_redis(redis_url: str) -> Iterator[str]:
    import redis

    client = redis.Redis.from_url(redis_url)
    client.flushdb()
    yield redis_url
    client.flushdb()


@pytest.fixture(autouse=True)
def _no_background_dispatch(settings) -> None:  # type: ignore[no-untyped-def]
    # Unit tests call the consolidation service directly (like a worker's consume function);
    # tests of the real path start real workers and opt back in.
    settings.MEMORY_DISPATCH = "off"
    settings.REDIS_URL = ""
    # Long conversations from one user are what many tests are about; tests/test_limits.py
    # turns the per-user turn limit back on.
    settings.TURN_RATE_LIMIT = ""
    settings.CHAT_BACKEND = "offline"
    settings.MEMORY_SUMMARIZER_BACKEND = "offline"
    # memory_worker.coordination.runtime._lock is lru_cached: one LocalChatLock would otherwise
    # outlive the test, and a test that failed mid-run would leave a held lock or a pending flag
    # behind.
    from memory_worker.coordination.runtime import _lock

    _lock.cache_clear()
    # The request path's Redis breaker is per process: one test's timeout (a stalled Redis, or
    # a loaded CI machine past the 0.25 s default) must not skip the next tests' enqueues.
    # Tests of the stall set the short timeout themselves.
    settings.REDIS_REQUEST_TIMEOUT_SECONDS = 2.0
    reset_breaker()


@pytest.fixture
def fake_openai() -> Iterator[FakeOpenAI]:
    with FakeOpenAI() as server:
        yield server


@pytest.fixture
def use_fake_openai(settings, fake_openai: FakeOpenAI) -> FakeOpenAI:  # type: ignore[no-untyped-def]
    """Point the chat model and the summarizer at the fake OpenAI-compatible server."""
    settings.OPENAI_BASE_URL = fake_openai.base_url
    settings.OPENAI_API_KEY = "test-key"
    settings.CHAT_BACKEND = "openai"
    settings.MEMORY_SUMMARIZER_BACKEND = "chat"
    settings.CHAT_MODEL = "fake-chat"
    settings.MEMORY_SUMMARIZER_MODEL = "fake-summarizer"
    settings.LLM_TIMEOUT_SECONDS = 5.0
    settings.MEMORY_LLM_TIMEOUT_SECONDS = 5.0
    return fake_openai


@pytest.fixture(autouse=True, scope="session")
def fast_password_hashing(django_test_environment: None) -> None:
    """A cheap hash for the test users' passwords: PBKDF2's production cost, paid per user and
    per login, is most of a test's setup. Servers a test starts in their own process keep the
    real hasher (none logs in by password)."""
    from django.test.utils import override_settings

    # override_settings, not an assignment: Django caches its hashers until the setting_changed
    # signal says otherwise.
    override_settings(PASSWORD_HASHERS=["django.contrib.auth.hashers.MD5PasswordHasher"]).enable()


@pytest.fixture
def user(db):  # type: ignore[no-untyped-def]
    from django.contrib.auth import get_user_model

    return get_user_model().objects.create_user(username="alice", password="pw-alice-123")


@pytest.fixture
def other_user(db):  # type: ignore[no-untyped-def]
    from django.contrib.auth import get_user_model

    return get_user_model().objects.create_user(username="bob", password="pw-bob-123")


def client_for(user):  # type: ignore[no-untyped-def]
    from rest_framework.authtoken.models import Token
    from rest_framework.test import APIClient

    token, _ = Token.objects.get_or_create(user=user)
    client = APIClient()
    client.credentials(HTTP_AUTHORIZATION=f"Token {token.key}")
    return client


def contract_chat_after_turns(api, turns: int) -> int:  # type: ignore[no-untyped-def]
    """A new ``contract`` chat (K = 6, B = 4) after ``turns`` turns ("fact 0", "fact 1", ...),
    each answered 201."""
    chat_id = api.post("/api/v1/chats/", {"policy": "contract"}, format="json").json()["id"]
    for number in range(turns):
        response = api.post(
            f"/api/v1/chats/{chat_id}/turns/", {"content": f"fact {number}"}, format="json"
        )
        assert response.status_code == 201, response.content
    return int(chat_id)


@pytest.fixture
def api(user):  # type: ignore[no-untyped-def]
    return client_for(user)


@pytest.fixture
def other_api(other_user):  # type: ignore[no-untyped-def]
    return client_for(other_user)


@pytest.fixture
def broker(settings, clean_redis):  # type: ignore[no-untyped-def]
    """The test Redis as broker and lock store, as the web process has it, with a lock TTL
    short enough for a test to outlast."""
    from memory_worker.coordination.runtime import _lock

    previous = point_celery_at(clean_redis)
    settings.REDIS_URL = clean_redis
    settings.MEMORY_DISPATCH = "celery"
    settings.MEMORY_LOCK_TTL_SECONDS = 3  # as the workers' (tests.support.workers.FAST_DEADLINES)
    _lock.cache_clear()
    yield clean_redis
    point_celery_at(previous)
    _lock.cache_clear()
