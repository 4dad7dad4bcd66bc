"""Per-user throttling of turns (REST turns and /v1/chat/completions), counted in the shared cache
so the limit holds across web processes. The rate is the TURN_RATE_LIMIT setting ("120/min";
empty turns throttling off), read per request so it can change without a restart of the class.

Counted with a sliding-window counter: one integer per user and fixed window, the previous
window's count weighted by how much of it still overlaps the sliding window. DRF's own throttle
keeps a list of every request's timestamp and reads and rewrites the whole list on every request,
so its cost grows with the limit (at 6,000/min, 50 KB each way per turn); this one moves a few
bytes whatever the limit. A request is allowed while

    previous * (1 - elapsed share of the current window) + current + 1 <= limit

(an estimate of the requests in the last window-long span, exact at each window boundary, that
assumes the previous window's requests were evenly spread). A full window carries into the next
one, so a burst at a boundary cannot double the limit.

With Redis as the cache (production), the check and the count are one Lua script: one round trip
instead of three (a read, then Django's incr is EXISTS + INCRBY, each on a new client object), and
atomic, so concurrent requests of one user cannot all pass on the same stale count. The keys and
values are the cache's own (``make_key``, plain integers), so either path reads the other's.

Fail-open: turns never need Redis to answer, so when the cache cannot be reached the request goes
through (and a warning is logged, ``throttle_skipped``) rather than failing. A cache that times out
(a stalled Redis) opens the request path's breaker (memory_worker.coordination.request_redis): for
REDIS_BREAKER_SECONDS turns are let through without asking it, each one counted."""

import functools
import logging
import math
import re
from typing import Any

import redis
from django.conf import settings
from django.core.cache import cache as default_cache
from rest_framework.request import Request
from rest_framework.throttling import UserRateThrottle

from memory_worker.memory import breaker_open, trip_if_timeout

log = logging.getLogger("chatmem.throttle")
# The weighted estimate is a float: 3 x (1 - 20/60) is 2.0000000000000004, not 2.
EPSILON = 1e-9
REDIS_CACHE = "django.core.cache.backends.redis.RedisCache"

# KEYS: previous window's counter, current window's. ARGV: the previous count's weight (the share
# of its window still inside the sliding one), the limit (+ EPSILON), the counter's TTL in seconds.
# Returns {allowed, previous count, current count before this request}.
COUNT_SCRIPT = """
local previous = tonumber(redis.call('GET', KEYS[1]) or '0')
local current = tonumber(redis.call('GET', KEYS[2]) or '0')
if previous * tonumber(ARGV[1]) + current + 1 > tonumber(ARGV[2]) then
    return {0, previous, current}
end
if redis.call('INCR', KEYS[2]) == 1 then
    redis.call('EXPIRE', KEYS[2], ARGV[3])
end
return {1, previous, current}
"""


@functools.lru_cache(maxsize=4)
def count_script(
    location: str, connect_timeout: float | None, timeout: float | None
) -> Any:  # redis.commands.core.Script
    """The script on a client kept for the process: Django's cache builds a new client object
    (with its table of ~170 response callbacks) for every operation."""
    client = redis.Redis.from_url(
        location, socket_connect_timeout=connect_timeout, socket_timeout=timeout
    )
    return client.register_script(COUNT_SCRIPT)


def redis_count_script() -> Any | None:
    """The counting script when the default cache is Redis, else None (the cache API is used)."""
    config: dict[str, Any] = settings.CACHES["default"]
    if config["BACKEND"] != REDIS_CACHE:
        return None
    options: dict[str, Any] = config.get("OPTIONS", {})
    location = config["LOCATION"]
    # Django's RedisCache writes to the first of several servers; so does this.
    primary = location[0] if isinstance(location, list | tuple) else location.split(",")[0]
    return count_script(
        primary, options.get("socket_connect_timeout"), options.get("socket_timeout")
    )


RATE = re.compile(r"^(?P<count>[0-9]+)/(?P<period>[smhd])[a-z]*$")  # as DRF's parse_rate reads it


def rate_problem(rate: str) -> str | None:
    """What is wrong with a TURN_RATE_LIMIT value ("120/min"; empty: no limit), or None. DRF
    reads it at every request (the first character of the period: s, m, h or d), so a bad one
    would fail every turn."""
    if not rate:
        return None
    found = RATE.match(rate)
    if found is None:
        return f'TURN_RATE_LIMIT "{rate}" must look like 120/min: a count, then s, m, h or d.'
    if int(found["count"]) < 1:
        return f'TURN_RATE_LIMIT "{rate}" must allow at least 1 turn (empty: no limit).'
    return None


class TurnRateThrottle(UserRateThrottle):
    scope = "turns"
    # Set by DRF's __init__ from the rate (parse_rate); declared for the type checker.
    num_requests: int
    duration: int

    def get_rate(self) -> str | None:
        return settings.TURN_RATE_LIMIT or None  # None: DRF lets every request through

    def allow_request(self, request: Request, view: Any) -> bool:
        if self.rate is None:
            return True
        if self.cache is default_cache and redis_count_script() is not None and breaker_open():
            log.info(
                "turn throttle skipped: Redis timed out recently",
                extra={"event": "throttle_skipped"},
            )
            return True
        try:
            return self.counted_request(request, view)
        except Exception as error:
            trip_if_timeout(error)
            log.warning(
                "turn throttle skipped: the cache is unreachable",
                exc_info=True,
                extra={"event": "throttle_skipped"},
            )
            return True

    def counted_request(self, request: Request, view: Any) -> bool:
        if self.rate is None:
            return True
        key = self.get_cache_key(request, view)
        if key is None:
            return True
        now = self.timer()
        window = int(now // self.duration)
        self.elapsed_share = (now - window * self.duration) / self.duration
        previous_key, current_key = f"{key}:{window - 1}", f"{key}:{window}"
        script = redis_count_script() if self.cache is default_cache else None
        if script is not None:
            return self.counted_in_redis(script, previous_key, current_key)
        counts = self.cache.get_many([previous_key, current_key])
        self.previous = int(counts.get(previous_key, 0))
        self.current = int(counts.get(current_key, 0))
        estimate = self.previous * (1 - self.elapsed_share) + self.current + 1
        if estimate > self.num_requests + EPSILON:
            return False
        self.count(current_key)
        return True

    def counted_in_redis(self, script: Any, previous_key: str, current_key: str) -> bool:
        allowed, self.previous, self.current = script(
            keys=[self.cache.make_key(previous_key), self.cache.make_key(current_key)],
            args=[
                repr(1 - self.elapsed_share),
                repr(self.num_requests + EPSILON),
                self.counter_ttl,
            ],
        )
        return bool(allowed)

    @property
    def counter_ttl(self) -> int:
        # A window's counter lives for two windows: it is the "previous" one in the next.
        return 2 * self.duration + 1

    def count(self, current_key: str) -> None:
        timeout = self.counter_ttl
        if self.current and self.incremented(current_key):
            return
        if not self.cache.add(current_key, 1, timeout) and not self.incremented(current_key):
            self.cache.set(current_key, 1, timeout)  # expired between add and incr

    def incremented(self, current_key: str) -> bool:
        try:
            self.cache.incr(current_key)
        except ValueError:  # not there (expired, or another process's add has not landed)
            return False
        return True

    def wait(self) -> float | None:
        """Seconds until a request would be allowed, if none is sent meanwhile."""
        limit, previous, current = self.num_requests, self.previous, self.current
        into = self.elapsed_share * self.duration
        if current + 1 <= limit and previous:
            # Within this window, as the previous window's weight slides down.
            return max(self.duration * (1 - (limit - current - 1) / previous) - into, 1.0)
        # In the next window this one is the previous: wait until its weight has slid enough.
        later = self.duration * (1 - (limit - 1) / current) if current > limit - 1 else 0.0
        return max(math.ceil(self.duration - into + later), 1.0)


class ManualFoldRateThrottle(TurnRateThrottle):
    """Manual folds per user (``POST .../consolidate/`` and nothing else), as turns are counted:
    each one may be a summarizer call. The rate is MEMORY_MANUAL_FOLD_RATE_LIMIT ("12/min";
    empty: no limit)."""

    scope = "manual_folds"

    def get_rate(self) -> str | None:
        return settings.MEMORY_MANUAL_FOLD_RATE_LIMIT or None
