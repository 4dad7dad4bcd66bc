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

Fail-open: turns never need Redis to answer, so when the cache cannot be reached the request
goes through (and a warning is logged) rather than failing."""

import logging
import math
from typing import Any

from django.conf import settings
from rest_framework.request import Request
from rest_framework.throttling import UserRateThrottle

log = logging.getLogger("chatmem.throttle")
# The weighted estimate is a float: 3 x (1 - 20/60) is 2.0000000000000004, not 2.
EPSILON = 1e-9


class TurnRateThrottle(UserRateThrottle):
    scope = "turns"
    # Set by DRF's __init__ from the rate (parse_rate); declared for the type checker.
    num_requests: int
    duration: int

    def get_rate(self) -> str | None:
        return settings.TURN_RATE_LIMIT or None  # None: DRF lets every request through

    def allow_request(self, request: Request, view: Any) -> bool:
        try:
            return self.counted_request(request, view)
        except Exception:
            log.warning("turn throttle skipped: the cache is unreachable", exc_info=True)
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
        counts = self.cache.get_many([previous_key, current_key])
        self.previous = int(counts.get(previous_key, 0))
        self.current = int(counts.get(current_key, 0))
        estimate = self.previous * (1 - self.elapsed_share) + self.current + 1
        if estimate > self.num_requests + EPSILON:
            return False
        self.count(current_key)
        return True

    def count(self, current_key: str) -> None:
        # A window's counter lives for two windows: it is the "previous" one in the next.
        timeout = 2 * self.duration + 1
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
