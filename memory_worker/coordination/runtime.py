"""Process-wide handles: the Redis client and the chat lock of the configured mode."""

from functools import lru_cache

import redis
from django.conf import settings

from memory_worker.coordination.locks import ChatLock, LocalChatLock, RedisChatLock
from memory_worker.coordination.request_redis import request_redis_client


@lru_cache(maxsize=2)
def redis_client(url: str) -> "redis.Redis":
    return redis.Redis.from_url(url, socket_connect_timeout=2, socket_timeout=5)


@lru_cache(maxsize=4)
def _lock(url: str, ttl: float) -> ChatLock:
    if url:
        return RedisChatLock(redis_client(url), ttl)
    return LocalChatLock(ttl)


def chat_lock() -> ChatLock:
    return _lock(settings.REDIS_URL, settings.MEMORY_LOCK_TTL_SECONDS)


@lru_cache(maxsize=4)
def _request_lock(url: str, ttl: float, timeout: float) -> ChatLock:
    return RedisChatLock(request_redis_client(url), ttl)


def request_chat_lock() -> ChatLock:
    """The chat lock as the request path uses it: each call gives up after
    REDIS_REQUEST_TIMEOUT_SECONDS (memory_worker.coordination.request_redis), as a turn must not
    wait on a stalled Redis for the workers' longer timeout."""
    if not settings.REDIS_URL:
        return chat_lock()
    return _request_lock(
        settings.REDIS_URL, settings.MEMORY_LOCK_TTL_SECONDS, settings.REDIS_REQUEST_TIMEOUT_SECONDS
    )
