"""The turn throttle's sliding-window counter (conversations.throttling), on a clock the test
moves: how many requests it lets through, when it lets them through again, and that what it
stores stays one small integer per window whatever the limit. Each test runs on both paths:
the cache API (a local-memory cache, as in embedded mode) and the Lua script on real Redis."""

import threading
import uuid
from collections.abc import Callable
from types import SimpleNamespace
from typing import Any

import pytest
import redis
from django.core.cache import caches
from django.core.cache.backends.locmem import LocMemCache

from conversations.throttling import TurnRateThrottle
from tests.conftest import TEST_REDIS_URL, require


class Clock:
    def __init__(self, now: float) -> None:
        self.now = now

    def __call__(self) -> float:
        return self.now


def request_of(user_id: int) -> Any:
    return SimpleNamespace(user=SimpleNamespace(pk=user_id, is_authenticated=True))


# What a test reads back: every stored counter's value.
StoredValues = Callable[[], list[int]]


@pytest.fixture(params=["cache-api", "redis-script"])
def throttle_at(request: Any, settings: Any) -> Any:
    """A factory of throttles sharing one fresh store and one clock, as the web processes of
    one deployment share Redis: (rate, start time) -> (make_throttle, clock, stored values)."""
    local: LocMemCache | None = None  # the cache-API path's store; None: the script's Redis
    if request.param == "redis-script":
        if not TEST_REDIS_URL:
            require("Redis", "TEST_REDIS_URL is not set")
        prefix = f"throttle-test-{uuid.uuid4().hex}"
        settings.CACHES = {
            "default": {
                "BACKEND": "django.core.cache.backends.redis.RedisCache",
                "LOCATION": TEST_REDIS_URL,
                "KEY_PREFIX": prefix,
            }
        }
        client = redis.Redis.from_url(TEST_REDIS_URL)

        def stored() -> list[int]:
            return [int(client.get(key) or 0) for key in client.keys(f"{prefix}:*")]

        request.addfinalizer(lambda: caches["default"].clear())
    else:
        memory = local = LocMemCache(f"throttle-{uuid.uuid4().hex}", {})

        def stored() -> list[int]:
            keys = list(memory._cache)  # type: ignore[attr-defined]  # no public key listing
            return [memory.get(key.split(":", 2)[-1]) for key in keys]

    def make(rate: str, start: float = 6_000_000.0) -> tuple[Any, Clock, StoredValues]:
        settings.TURN_RATE_LIMIT = rate
        clock = Clock(start)

        def throttle() -> TurnRateThrottle:
            made = TurnRateThrottle()
            if local is not None:
                made.cache = local
            made.timer = clock  # type: ignore[assignment]
            return made

        return throttle, clock, stored

    return make


def allowed(throttle: TurnRateThrottle, user_id: int = 1) -> bool:
    return throttle.allow_request(request_of(user_id), None)  # type: ignore[arg-type]


def test_the_limit_holds_within_a_window(throttle_at: Any) -> None:
    make, clock, _ = throttle_at("3/min")
    results = []
    for _ in range(5):
        results.append(allowed(make()))
        clock.now += 1
    assert results == [True, True, True, False, False]
    assert allowed(make(), user_id=2)  # another user has a budget of their own


def test_a_full_window_carries_into_the_next_one(throttle_at: Any) -> None:
    """Three turns at the end of one window: the next window opens with the previous count still
    weighing almost fully, so the limit is not doubled across the boundary."""
    make, clock, _ = throttle_at("3/min", start=6_000_000.0 - 3)  # 3 s before a boundary
    assert [allowed(make()) for _ in range(3)] == [True, True, True]
    clock.now += 4  # 1 s into the next window: 3 x 59/60 + 0 + 1 > 3
    assert not allowed(make())
    clock.now += 19  # 20 s in: 3 x 2/3 + 0 + 1 = 3, allowed again
    assert allowed(make())
    assert not allowed(make())


def test_retry_after_is_when_a_request_is_allowed_again(throttle_at: Any) -> None:
    make, clock, _ = throttle_at("3/min", start=6_000_000.0 + 10)
    for _ in range(3):
        assert allowed(make())
    refused = make()
    assert not allowed(refused)
    wait = refused.wait()
    assert wait is not None and 1 <= wait <= 120
    clock.now += wait - 1.5
    assert not allowed(make()), "allowed before Retry-After"
    clock.now += 1.5
    assert allowed(make()), "still refused at Retry-After"


def test_an_even_rate_under_the_limit_is_never_refused(throttle_at: Any) -> None:
    make, clock, _ = throttle_at("60/min", start=6_000_000.0 + 0.5)
    results = []
    for _ in range(300):  # about five windows, 90 % of the limit
        results.append(allowed(make()))
        clock.now += 60 / 54
    assert all(results)


def test_twice_the_rate_gets_about_the_limit_through(throttle_at: Any) -> None:
    make, clock, _ = throttle_at("60/min", start=6_000_000.0 + 0.25)
    passed = 0
    for _ in range(1200):  # ten windows, two requests a second
        passed += allowed(make())
        clock.now += 0.5
    # 600 allowed at most in ten windows, and the counter is not so strict that it starves
    assert 560 <= passed <= 610


def test_what_is_stored_does_not_grow_with_the_limit(throttle_at: Any) -> None:
    """DRF's own throttle stores every request's timestamp (a list as long as the limit); this
    one stores a count per window."""
    make, clock, stored = throttle_at("100000/min")
    for _ in range(2000):
        assert allowed(make())
        clock.now += 0.001
    assert stored() == [2000]


# Only the Redis script is atomic; the cache API path (embedded mode, one process) checks, then
# counts.
@pytest.mark.parametrize("throttle_at", ["redis-script"], indirect=True)
def test_concurrent_requests_cannot_share_a_stale_count(throttle_at: Any) -> None:
    """Twenty requests of one user at the same instant, five allowed: the Redis script checks
    and counts in one step, so exactly five pass (reading, then counting, let more through)."""
    make, _, stored = throttle_at("5/min", start=6_000_000.0 + 1)
    start = threading.Barrier(20)
    results: list[bool] = []

    def one() -> None:
        throttle = make()
        start.wait()
        results.append(allowed(throttle))

    threads = [threading.Thread(target=one) for _ in range(20)]
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join()
    assert results.count(True) == 5
    assert stored() == [5]
