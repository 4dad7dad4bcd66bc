"""A host whose clock is wrong, for a test's subprocess (tests/test_host_clocks.py): with this
directory first on PYTHONPATH and CHATMEM_CLOCK_OFFSET_SECONDS set, the whole process's wall
clock is that many seconds off. Python imports ``sitecustomize`` while starting, before any
application import, so every later ``from datetime import datetime`` (Django's timezone.now,
Celery, kombu, logging) gets the skewed clock. Monotonic clocks are left alone: a host's wrong
wall clock does not change how fast its time passes."""

import datetime
import os
import time

OFFSET = float(os.environ.get("CHATMEM_CLOCK_OFFSET_SECONDS") or 0)

if OFFSET:
    real_time, real_time_ns = time.time, time.time_ns
    time.time = lambda: real_time() + OFFSET
    time.time_ns = lambda: real_time_ns() + int(OFFSET * 1e9)

    class SkewedDatetime(datetime.datetime):
        # No __dict__: C extensions check datetime's size when they load.
        __slots__ = ()

        # now() reads the system clock in C, not through time.time: it needs its own patch.
        # fromtimestamp() and date.today() go through time.time and follow it.
        @classmethod
        def now(cls, tz=None):  # type: ignore[no-untyped-def]
            return super().now(tz) + datetime.timedelta(seconds=OFFSET)

        @classmethod
        def utcnow(cls):  # type: ignore[no-untyped-def]
            return cls.now(datetime.UTC).replace(tzinfo=None)

    # Named as the class it replaces, so pickles and reprs of its instances name datetime.datetime.
    SkewedDatetime.__name__ = SkewedDatetime.__qualname__ = "datetime"
    SkewedDatetime.__module__ = "datetime"
    datetime.datetime = SkewedDatetime  # type: ignore[misc]
