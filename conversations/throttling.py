"""Per-user throttling of turns (REST turns and /v1/chat/completions), counted in the shared cache
so the limit holds across web processes. The rate is the TURN_RATE_LIMIT setting ("120/min";
empty turns throttling off), read per request so it can change without a restart of the class.

Fail-open: turns never need Redis to answer, so when the cache cannot be reached the request
goes through (and a warning is logged) rather than failing."""

import logging
from typing import Any

from django.conf import settings
from rest_framework.request import Request
from rest_framework.throttling import UserRateThrottle

log = logging.getLogger("chatmem.throttle")


class TurnRateThrottle(UserRateThrottle):
    scope = "turns"

    def get_rate(self) -> str | None:
        return settings.TURN_RATE_LIMIT or None  # None: DRF lets every request through

    def allow_request(self, request: Request, view: Any) -> bool:
        try:
            return super().allow_request(request, view)
        except Exception:
            log.warning("turn throttle skipped: the cache is unreachable", exc_info=True)
            return True
