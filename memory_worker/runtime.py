"""Process-wide handles: the Redis client and the chat lock of the configured mode."""

from functools import lru_cache

import redis
from django.conf import settings

from memory_worker.locks import ChatLock, LocalChatLock, RedisChatLock


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
