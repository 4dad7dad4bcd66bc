"""Seed 004's Summarize node off the request path: the Celery task and its dispatch, through the
same mechanism as consolidation (MEMORY_DISPATCH: celery / inline / off). The work itself is the
service ``conversations.services.agent_state.summarize_turns``."""

import time

from celery import shared_task

from memory_worker.dispatch import hand_off
from memory_worker.task_base import WorkerDeadlinesTask


@shared_task(
    name="chatmem.summarize_agent_turns",
    queue="memory",
    acks_late=True,
    base=WorkerDeadlinesTask,
    # No lock bounds it: a task whose process dies is retried (3 times, 3 minutes apart), not
    # put back on the queue at once for ever (reject_on_worker_lost alone requeues uncounted).
    retry_on_worker_lost=True,
)
def summarize_agent_turns(chat_id: int, from_seq: int | None = None) -> int:
    started = time.monotonic()  # Celery's time limits count from here
    # Late ack is safe: the service applies each turn once (a conditional commit on its
    # watermark), so a redelivered task finds nothing left to do. The service commits turn by
    # turn and hands on what would not finish before the soft time limit.
    from conversations.services.agent_state import summarize_turns

    return summarize_turns(chat_id, from_seq, started=started)


def _run_inline(chat_id: int, from_seq: int | None) -> None:
    from conversations.services.agent_state import summarize_turns

    summarize_turns(chat_id, from_seq)


def request_agent_summary(chat_id: int, from_seq: int | None = None) -> bool:
    """Returns whether the work was handed on. Never raises: the turn is already stored, and
    the next turn's task applies whatever this one missed (everything after the watermark)."""
    return hand_off(
        "the agent-state update",
        {"chat_id": chat_id},
        # retry=False: a dead broker must fail fast instead of holding the request.
        lambda: summarize_agent_turns.apply_async(args=(chat_id, from_seq), retry=False),
        _run_inline,
        chat_id,
        from_seq,
    )
