"""Asking for a consolidation. Called after a turn commits (``transaction.on_commit``), by the
sweep, the API and the admin. It never raises: a broker that is down is logged, and the beat
sweep finds the chat later (DESIGN §3 step 7)."""

import contextlib
import contextvars
import logging
import threading
from collections.abc import Callable
from concurrent.futures import ThreadPoolExecutor
from datetime import datetime

from django.conf import settings
from django.db import close_old_connections, connection

from memory_worker.runtime import redis_client

log = logging.getLogger("chatmem.dispatch")

_inline_executor: ThreadPoolExecutor | None = None
_inline_guard = threading.Lock()


def request_consolidation(chat_id: int, trigger: str, due_at: datetime | None = None) -> bool:
    """Returns whether the request was handed on (queued or started). ``due_at``: when a turn
    found a fold due, carried to the fold's ledger row (consolidation lag)."""
    return hand_off(
        "consolidation; the sweep will pick the chat up",
        {"chat_id": chat_id, "trigger": trigger},
        lambda: _publish(chat_id, trigger, due_at),
        _run_inline,
        chat_id,
        trigger,
        due_at,
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
    (``enqueue_failed``, with ``context``) for the sweep or the next turn to make up."""
    mode = settings.MEMORY_DISPATCH
    try:
        if mode == "celery":
            publish()
        elif mode == "inline":
            submit_inline(run_inline, *args)
        else:
            return False
    except Exception:
        log.exception(f"could not queue {what}", extra={"event": "enqueue_failed", **context})
        return False
    return True


def _publish(chat_id: int, trigger: str, due_at: datetime | None) -> None:
    from memory_worker.tasks import consolidate_chat

    if trigger == "turn" and not mark_queued(chat_id):
        return  # a task queued for this chat has not started: it will see this turn (below)
    # An optional keyword, so messages queued before it existed still run.
    kwargs = {"due_at": due_at.timestamp()} if due_at is not None else {}
    try:
        # retry=False: a dead broker must fail fast instead of holding the request.
        consolidate_chat.apply_async(args=(chat_id, trigger), kwargs=kwargs, retry=False)
    except Exception:
        if trigger == "turn":
            with contextlib.suppress(Exception):  # else the marker expires on its own
                clear_queued(chat_id)
        raise


# One queued task per chat is enough. A task reads the chat's state when it starts, so while one
# is queued and not started, a turn that finds a fold due adds nothing by queuing another:
# without this marker every turn of a chat whose fold stays due (workers behind, or down)
# queued one more task, a pile in the broker (DESIGN §1.3) and a broker write on every turn.
# Ordering: a turn commits, then takes the marker (SET NX); the task deletes the marker before
# it reads anything (tasks.consolidate_chat). A turn that finds the marker taken committed
# before the task's read, so the task sees it; a turn after the delete queues a new task. Only
# turn triggers are deduplicated: manual runs skip the failure backoff and the sweep and reruns
# are rare. The marker's TTL bounds how long a lost task message could keep turns from queuing
# (the sweep finds such a chat anyway).
QUEUED_KEY = "chatmem:queued:{}"


def mark_queued(chat_id: int) -> bool:
    """Take the chat's queued marker; False if a queued task already holds it."""
    ttl = settings.MEMORY_ENQUEUE_DEDUP_SECONDS
    if ttl <= 0 or not settings.REDIS_URL:
        return True
    key = QUEUED_KEY.format(chat_id)
    return bool(redis_client(settings.REDIS_URL).set(key, "1", nx=True, px=int(ttl * 1000)))


def fold_queued(chat_id: int) -> bool:
    """Whether a task queued for this chat has not started yet (its marker is taken)."""
    if not settings.REDIS_URL:
        return False
    return bool(redis_client(settings.REDIS_URL).exists(QUEUED_KEY.format(chat_id)))


def clear_queued(chat_id: int) -> None:
    if settings.REDIS_URL:
        redis_client(settings.REDIS_URL).delete(QUEUED_KEY.format(chat_id))


def _executor() -> ThreadPoolExecutor:
    global _inline_executor
    with _inline_guard:
        if _inline_executor is None:
            # One thread: the embedded mode folds one chat at a time, like one worker.
            _inline_executor = ThreadPoolExecutor(max_workers=1, thread_name_prefix="chatmem-fold")
        return _inline_executor


def submit_inline(function: Callable[..., None], *args: object) -> None:
    """Run ``function`` on the in-process runner, after what is already queued."""
    # The copied context carries the request id into the runner's log lines.
    _executor().submit(contextvars.copy_context().run, _closing_connection, function, *args)


def _closing_connection(function: Callable[..., None], *args: object) -> None:
    # The executor thread lives on: its connection is not left open between tasks.
    close_old_connections()
    try:
        function(*args)
    except Exception:
        log.exception("in-process task failed", extra={"task": getattr(function, "__name__", "")})
    finally:
        connection.close()


def _run_inline(chat_id: int, trigger: str, due_at: datetime | None = None) -> None:
    from memory_worker.consolidation import consolidate_with_lock
    from memory_worker.runtime import chat_lock

    consolidate_with_lock(chat_id, trigger, chat_lock(), due_at=due_at)


def drain_inline(timeout: float = 30.0) -> None:
    """Wait until the in-process runner has finished what was queued before this call (one
    thread, first in first out). For graceful shutdown and tests."""
    if _inline_executor is not None:
        _inline_executor.submit(lambda: None).result(timeout=timeout)
