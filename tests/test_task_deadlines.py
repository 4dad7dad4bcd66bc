"""Whose time limits a memory task runs under: the worker's (docs/design.md, the fold). Celery
writes the publishing process's limits into each message and the worker obeys the message, so the
web process's deadlines (here the test process's defaults, 240 s and 300 s) would govern every fold
it queued, whatever the workers are configured with; the memory tasks publish none
(WorkerDeadlinesTask)."""

import threading

import pytest

from memory_worker import tasks
from tests.support.workers import FAST_DEADLINES, Worker, wait_until
from tests.test_worker import celery_broker  # noqa: F401  (fixture)

RELEASE = threading.Event()


def sleeping_hook(chat_id: int, messages: list[object], version: int) -> None:
    """A flush hook that outlives any soft time limit (run in the worker process)."""
    RELEASE.wait(60)


@pytest.mark.parametrize(
    ("task", "args"),
    [
        (tasks.fold_chat, (1,)),
        (tasks.sweep, ()),
        (tasks.run_flush_hook, ("hook", 1, 1, 2, 1)),
        (tasks.summarize_agent_turns, (1,)),
    ],
    ids=lambda value: getattr(value, "name", ""),
)
def test_memory_tasks_are_published_without_time_limits(task, args, monkeypatch) -> None:  # type: ignore[no-untyped-def]
    from chatmem_project.celery import app

    sent: list[object] = []
    monkeypatch.setattr(app.amqp, "send_task_message", lambda *args, **kw: sent.append(args[2]))
    task.apply_async(args=args)
    (message,) = sent
    assert message.headers["timelimit"] == [None, None]  # type: ignore[attr-defined]
    # The worker falls back to the task's own, from its settings.
    assert (task.soft_time_limit, task.time_limit) == (240, 300)


@pytest.mark.postgres
@pytest.mark.redis
@pytest.mark.worker
def test_a_task_queued_elsewhere_runs_under_the_workers_soft_time_limit(
    require_postgres,
    celery_broker,  # noqa: F811
) -> None:  # type: ignore[no-untyped-def]
    worker = Worker(celery_broker, "deadlines", env=dict(FAST_DEADLINES))
    try:
        worker.wait_ready()
        hook = f"{__name__}.sleeping_hook"
        tasks.run_flush_hook.apply_async(args=(hook, 1, 1, 2, 1), retry=False)
        assert wait_until(lambda: "Soft time limit (5s) exceeded" in worker.log(), timeout=30), (
            worker.log()
        )
    finally:
        worker.stop()


@pytest.mark.parametrize("task", [tasks.run_flush_hook, tasks.summarize_agent_turns])
def test_a_task_no_lock_bounds_is_retried_a_bounded_number_of_times_after_worker_loss(
    task,  # type: ignore[no-untyped-def]
) -> None:
    """reject_on_worker_lost puts the message back at once, uncounted: a hook that kills its
    process (out of memory) would run again and again for ever. Celery's retry_on_worker_lost
    counts it against max_retries instead (celery/worker/request.py, on_failure)."""
    assert task.acks_late and task.reject_on_worker_lost
    assert task.retry_on_worker_lost is True  # type: ignore[attr-defined]
    assert task.max_retries is not None and task.max_retries <= 5
    assert tasks.fold_chat.retry_on_worker_lost is False  # type: ignore[attr-defined]
