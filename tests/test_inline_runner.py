"""The embedded mode's in-process runner (memory_worker.coordination.dispatch,
MEMORY_DISPATCH=inline)."""

import threading
import time

from memory_worker.coordination.dispatch import drain_inline, submit_inline


def test_drain_waits_for_work_that_queued_work_queued() -> None:
    """A fold submits its flush hooks while it runs: draining only what was queued at the call
    returned before the last fold's hook ran (tests/test_daily_notes.py failed on it)."""
    ran: list[str] = []
    release = threading.Event()

    def hook() -> None:
        time.sleep(0.2)  # a hook that takes a moment: the drain must not return before it ends
        ran.append("hook")

    def fold() -> None:
        release.wait(timeout=10)
        ran.append("fold")
        submit_inline(hook)

    submit_inline(fold)
    release.set()
    drain_inline(timeout=10)
    assert ran == ["fold", "hook"]


def test_a_failing_task_does_not_keep_the_runner_busy() -> None:
    def boom() -> None:
        raise RuntimeError("a task that fails")

    submit_inline(boom)
    drain_inline(timeout=10)  # the failure is logged, and the count goes back to 0
