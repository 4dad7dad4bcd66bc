"""For tests only: on PYTHONPATH with CHATMEM_TEST_CLOCK_OFFSET_SECONDS set, this process's
clock (time.time and Django's timezone.now) runs that many seconds off, like a host whose
clock is skewed. Python imports ``sitecustomize`` at start-up, before any of the project."""

import os
import time

_offset = float(os.environ.get("CHATMEM_TEST_CLOCK_OFFSET_SECONDS", "0") or 0)
if _offset:
    from datetime import timedelta

    from django.utils import timezone

    _time, _now = time.time, timezone.now
    time.time = lambda: _time() + _offset
    timezone.now = lambda: _now() + timedelta(seconds=_offset)
