"""Asking for a consolidation. Called after a turn commits (``transaction.on_commit``), by the
sweep, the API and the admin. It never raises: a broker that is down is logged, and the beat
sweep finds the chat later (DESIGN §3 step 7)."""

import contextvars
import logging
import threading
from collections.abc import Callable
from concurrent.futures import ThreadPoolExecutor
from datetime import datetime

from django.conf import settings
from django.db import close_old_connections, connection

log = logging.getLogger("chatmem.dispatch")

_inline_executor: ThreadPoolExecutor | None = None
_inline_guard = threading.Lock()


def request_consolidation(chat_id: int, trigger: str, due_at: datetime | None = None) -> bool:
    """Returns whether the request was handed on (queued or started). ``due_at``: when a turn
    found a fold due, carried to the fold's ledger row (consolidation lag)."""
    mode = settings.MEMORY_DISPATCH
    try:
        if mode == "celery":
            _publish(chat_id, trigger, due_at)
        elif mode == "inline":
            _executor().submit(_run_inline, chat_id, trigger, due_at)
        else:
            return False
    except Exception:
        log.exception(
            "could not queue consolidation; the sweep will pick the chat up",
            extra={"event": "enqueue_failed", "chat_id": chat_id, "trigger": trigger},
        )
        return False
    return True


def _publish(chat_id: int, trigger: str, due_at: datetime | None) -> None:
    from memory_worker.tasks import consolidate_chat

    # An optional keyword, so messages queued before it existed still run.
    kwargs = {"due_at": due_at.timestamp()} if due_at is not None else {}
    # retry=False: a dead broker must fail fast instead of holding the request.
    consolidate_chat.apply_async(args=(chat_id, trigger), kwargs=kwargs, retry=False)


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

    close_old_connections()
    try:
        consolidate_with_lock(chat_id, trigger, chat_lock(), due_at=due_at)
    except Exception:
        log.exception("inline consolidation failed", extra={"chat_id": chat_id})
    finally:
        # The executor thread lives on: do not leave its connection open between folds.
        connection.close()


def drain_inline(timeout: float = 30.0) -> None:
    """Wait until the in-process runner has finished what was queued before this call (one
    thread, first in first out). For graceful shutdown and tests."""
    if _inline_executor is not None:
        _inline_executor.submit(lambda: None).result(timeout=timeout)
