"""The base of chatmem's Celery tasks."""

from typing import Any

from celery import Task


class WorkerDeadlinesTask(Task):  # type: ignore[misc]
    """A task whose time limits are the worker's own.

    Celery writes the publishing process's time limits into every message, and a worker obeys the
    message's over its own. So a web process (or beat) with other deadlines than the workers' set
    the limits of every fold it queued, while the lock TTL they must nest within (docs/design.md,
    the fold; checked at the worker's start-up) is the worker's. Published with no limits, a message
    runs under the worker's MEMORY_TASK_SOFT_TIME_LIMIT and MEMORY_TASK_TIME_LIMIT.
    """

    def apply_async(self, args: Any = None, kwargs: Any = None, *extra: Any, **options: Any) -> Any:
        options.setdefault("time_limit", None)
        options.setdefault("soft_time_limit", None)
        return super().apply_async(args, kwargs, *extra, **options)
