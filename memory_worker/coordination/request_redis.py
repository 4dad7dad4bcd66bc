"""The request path's Redis (the turn throttle and the post-commit enqueue): short timeouts and a
breaker. A Redis that accepts connections and never answers holds each call for its socket
timeout; after one such timeout the breaker skips the request path's Redis calls for
REDIS_BREAKER_SECONDS, so the turns of that span wait on nothing: the throttle lets them
through and the enqueue is left to the beat sweep, which takes the chats whose enqueue was
missed at its first tick after Redis answers again (runs.mark_enqueue_missed)."""

import socket
import threading
import time
from functools import lru_cache

import redis
from django.conf import settings

_guard = threading.Lock()
_open_until = 0.0  # time.monotonic() until which the breaker skips the calls


@lru_cache(maxsize=4)
def _client(url: str, timeout: float) -> "redis.Redis":
    return redis.Redis.from_url(url, socket_connect_timeout=timeout, socket_timeout=timeout)


def request_redis_client(url: str) -> "redis.Redis":
    """A client whose calls give up after REDIS_REQUEST_TIMEOUT_SECONDS."""
    return _client(url, settings.REDIS_REQUEST_TIMEOUT_SECONDS)


def breaker_open() -> bool:
    """Whether a recent timeout says to skip the request path's Redis calls."""
    return time.monotonic() < _open_until


def trip_if_timeout(error: BaseException) -> bool:
    """Opens the breaker when ``error`` is (or was caused by) a timeout; says whether it was. A
    refused connection fails at once and does not trip it."""
    global _open_until
    if not is_timeout(error):
        return False
    with _guard:
        _open_until = time.monotonic() + settings.REDIS_BREAKER_SECONDS
    return True


def reset_breaker() -> None:
    global _open_until
    with _guard:
        _open_until = 0.0


def is_timeout(error: BaseException | None) -> bool:
    # Kombu and Celery wrap the client's error (OperationalError, raise ... from): follow the chain.
    seen = 0
    while error is not None and seen < 10:
        if isinstance(error, redis.TimeoutError | socket.timeout | TimeoutError):
            return True
        error = error.__cause__ or error.__context__
        seen += 1
    return False
