"""Request limits: body size (413) and per-user turn throttling in the shared cache (429),
which lets turns through when the cache is down (turns never need Redis)."""

from __future__ import annotations

import json
from typing import Any

import pytest
from django.core.cache import caches

from conversations.models import Message
from tests.conftest import TEST_REDIS_URL, require

pytestmark = pytest.mark.django_db


def new_chat(api: Any) -> int:
    return int(api.post("/api/v1/chats/", {}, format="json").json()["id"])


def turn(api: Any, chat_id: int, content: str = "hello") -> Any:
    return api.post(f"/api/v1/chats/{chat_id}/turns/", {"content": content}, format="json")


def test_an_oversized_body_is_a_json_413_and_stores_nothing(api: Any, settings: Any) -> None:
    settings.CHATMEM_MAX_BODY_BYTES = 2000
    chat_id = new_chat(api)
    body = json.dumps({"content": "x" * 3000})
    response = api.generic(
        "POST", f"/api/v1/chats/{chat_id}/turns/", body, content_type="application/json"
    )
    assert response.status_code == 413
    assert response.json()["code"] == "request_too_large"
    assert not Message.objects.filter(chat_id=chat_id).exists()
    assert turn(api, chat_id, "small").status_code == 201


def use_cache(settings: Any, backend: dict[str, Any]) -> None:
    settings.CACHES = {"default": backend}  # Django's setting_changed resets the cache handlers


@pytest.fixture
def throttled(settings: Any) -> Any:
    settings.TURN_RATE_LIMIT = "3/min"
    return settings


def test_turns_are_throttled_per_user_in_redis(api: Any, other_api: Any, throttled: Any) -> None:
    if not TEST_REDIS_URL:
        require("Redis", "TEST_REDIS_URL is not set")
    import redis

    use_cache(
        throttled,
        {
            "BACKEND": "django.core.cache.backends.redis.RedisCache",
            "LOCATION": TEST_REDIS_URL,
            "KEY_PREFIX": "chatmem-test-throttle",
        },
    )
    caches["default"].clear()
    chat_id = new_chat(api)
    assert [turn(api, chat_id).status_code for _ in range(3)] == [201, 201, 201]
    refused = turn(api, chat_id)
    assert refused.status_code == 429
    assert "throttled" in refused.json()["detail"] and int(refused["Retry-After"]) > 0
    assert Message.objects.filter(chat_id=chat_id).count() == 6  # the refused turn stored nothing
    # The count lives in Redis, where every web process sees it.
    keys = redis.Redis.from_url(TEST_REDIS_URL).keys("chatmem-test-throttle:*throttle_turns_*")
    assert len(keys) == 1
    # Another user has a budget of their own.
    assert turn(other_api, new_chat(other_api)).status_code == 201
    caches["default"].clear()


def test_a_dead_cache_lets_turns_through(api: Any, throttled: Any) -> None:
    use_cache(
        throttled,
        {
            "BACKEND": "django.core.cache.backends.redis.RedisCache",
            "LOCATION": "redis://127.0.0.1:1/0",  # nothing listens on port 1
            "OPTIONS": {"socket_connect_timeout": 0.2, "socket_timeout": 0.2},
        },
    )
    chat_id = new_chat(api)
    assert [turn(api, chat_id).status_code for _ in range(4)] == [201] * 4
