"""How memory work is handed on, as MEMORY_DISPATCH says: a Celery task published by name
(celery), the in-process runner (inline), or not at all (off); and the queued marker that keeps
one consolidation task per chat in the broker. Never raises: a broker that is down is logged,
and the beat sweep finds the chat later (docs/design.md, the turn, step 7)."""

import contextvars
import logging
import threading
from collections.abc import Callable
from concurrent.futures import ThreadPoolExecutor
from enum import StrEnum
from typing import Any

from celery import current_app
from django.conf import settings
from django.db import close_old_connections, connection

from memory_worker.coordination.request_redis import (
    breaker_open,
    request_redis_client,
    trip_if_timeout,
)
from memory_worker.coordination.runtime import redis_client

log = logging.getLogger("chatmem.dispatch")

_inline_executor: ThreadPoolExecutor | None = None
_inline_guard = threading.Lock()
# Tasks submitted and not finished. A task that queues another (a fold its flush hooks) submits
# it before it finishes, so the count reaches 0 only when the runner has nothing left to do.
_inline_pending = 0
_inline_idle = threading.Condition()

MEMORY_QUEUE = "memory"


class RequestReason(StrEnum):
    """Why a consolidation task was asked for (its ``trigger`` argument and log field). The fold
    it runs names its own reason in the ledger (policy.Trigger)."""

    TURN = "turn"  # a turn committed and found a fold due
    MANUAL = "manual"  # the API or the admin
    RERUN = "rerun"  # a run left the chat pending (a request during it, or more due)
    RETRY = "retry"  # a failed fold's fast retry
    SWEEP = "sweep"  # the beat sweep found the chat behind


class TaskByName:
    """A memory task published by its registered name: the modules that queue it need not import
    memory_worker.tasks, which imports them. The message is the one the task object would send
    (its queue, the app's serializer and result setting) with no time limits, so it runs under
    the worker's own (WorkerDeadlinesTask)."""

    def __init__(self, name: str, queue: str = MEMORY_QUEUE) -> None:
        self.name = name
        self.queue = queue

    def apply_async(
        self, args: tuple[Any, ...], kwargs: dict[str, Any] | None = None, **options: Any
    ) -> None:
        options.setdefault("time_limit", None)
        options.setdefault("soft_time_limit", None)
        options.setdefault("serializer", current_app.conf.task_serializer)
        options.setdefault("ignore_result", current_app.conf.task_ignore_result)
        current_app.send_task(
            self.name, args=args, kwargs=kwargs or {}, queue=self.queue, **options
        )


def hand_off(
    what: str,
    context: dict[str, object],
    publish: Callable[[], None],
    run_inline: Callable[..., None],
    *args: object,
) -> bool:
    """Memory work handed on as MEMORY_DISPATCH says: ``publish`` (celery), ``run_inline(*args)``
    on the in-process runner (inline), or not at all (off). Returns whether it was handed on;
    never raises: the turn that asked is already stored, so a broker that refuses is logged
    (``enqueue_failed``, with ``context``) for the sweep or the next turn to make up. While a
    broker timeout holds the breaker open (request_redis), nothing is published
    (``enqueue_skipped``): the sweep finds the chats whose fold is due."""
    mode = settings.MEMORY_DISPATCH
    try:
        if mode == "celery":
            if breaker_open():
                log.info(
                    f"skipped queuing {what}: Redis timed out recently",
                    extra={"event": "enqueue_skipped", **context},
                )
                return False
            publish()
        elif mode == "inline":
            submit_inline(run_inline, *args)
        else:
            return False
    except Exception as error:
        trip_if_timeout(error)
        log.exception(f"could not queue {what}", extra={"event": "enqueue_failed", **context})
        return False
    return True


# One queued task per chat is enough. A task reads the chat's state when it starts, so while one is
# queued and not started, a turn that finds a fold due adds nothing by queuing another: without this
# marker every turn of a chat whose fold stays due (workers behind, or down) would queue one more
# task, a pile in the broker and a broker write on every turn. Ordering: a turn commits, then takes
# the marker (SET NX); the task takes the chat's lock (or marks the holder pending), then deletes
# the marker, before it reads anything (runs.fold_with_lock). A turn that finds the marker taken
# committed before the task's read, so the task sees it; a turn after the delete queues a new task;
# a turn over its bound always sees the fold queued or in flight
# (scheduling.before_turn.acquire_or_wait). Only turn triggers are deduplicated: manual runs skip
# the failure backoff and the sweep and reruns are rare. The marker's TTL bounds how long a lost
# task message could keep turns from queuing (the sweep finds such a chat anyway).
QUEUED_KEY = "chatmem:queued:{}"


def mark_queued(chat_id: int) -> bool:
    """Take the chat's queued marker; False if a queued task already holds it."""
    return take_marker(QUEUED_KEY.format(chat_id))


def take_marker(key: str) -> bool:
    ttl = settings.MEMORY_ENQUEUE_DEDUP_SECONDS
    if ttl <= 0 or not settings.REDIS_URL:
        return True
    return bool(request_redis_client(settings.REDIS_URL).set(key, "1", nx=True, px=int(ttl * 1000)))


def fold_queued(chat_id: int) -> bool:
    """Whether a task queued for this chat has not started yet (its marker is taken)."""
    if not settings.REDIS_URL:
        return False
    return bool(request_redis_client(settings.REDIS_URL).exists(QUEUED_KEY.format(chat_id)))


def clear_queued(chat_id: int) -> None:
    if settings.REDIS_URL:
        redis_client(settings.REDIS_URL).delete(QUEUED_KEY.format(chat_id))


# One queued manual fold per chat, the same way: the API and the admin take this marker before
# they queue one (a request finding it taken is told one is queued), and the task clears it before
# it reads anything, so a request after that queues one that sees what came since.
MANUAL_QUEUED_KEY = "chatmem:manual-queued:{}"


def mark_manual_queued(chat_id: int) -> bool:
    """Take the chat's queued-manual-fold marker; False if a queued manual fold holds it."""
    return take_marker(MANUAL_QUEUED_KEY.format(chat_id))


def clear_manual_queued(chat_id: int) -> None:
    if settings.REDIS_URL:
        redis_client(settings.REDIS_URL).delete(MANUAL_QUEUED_KEY.format(chat_id))


def _executor() -> ThreadPoolExecutor:
    global _inline_executor
    with _inline_guard:
        if _inline_executor is None:
            # One thread: the embedded mode folds one chat at a time, like one worker.
            _inline_executor = ThreadPoolExecutor(max_workers=1, thread_name_prefix="chatmem-fold")
        return _inline_executor


def submit_inline(function: Callable[..., None], *args: object) -> None:
    """Run ``function`` on the in-process runner, after what is already queued."""
    global _inline_pending
    with _inline_idle:
        _inline_pending += 1
    try:
        # The copied context carries the request id into the runner's log lines.
        _executor().submit(contextvars.copy_context().run, _closing_connection, function, *args)
    except BaseException:
        _finished_one()
        raise


def _closing_connection(function: Callable[..., None], *args: object) -> None:
    # The executor thread lives on: its connection is not left open between tasks.
    close_old_connections()
    try:
        function(*args)
    except Exception:
        log.exception("in-process task failed", extra={"task": getattr(function, "__name__", "")})
    finally:
        connection.close()
        _finished_one()


def _finished_one() -> None:
    global _inline_pending
    with _inline_idle:
        _inline_pending -= 1
        _inline_idle.notify_all()


def drain_inline(timeout: float = 30.0) -> None:
    """Wait until the in-process runner is idle: what was queued before this call and what
    that queued in turn (a fold's flush hooks, a rerun). For graceful shutdown and tests."""
    with _inline_idle:
        if not _inline_idle.wait_for(lambda: _inline_pending == 0, timeout=timeout):
            raise TimeoutError(f"the in-process runner was still busy after {timeout} s")
