"""Celery tasks: thin wrappers over the consolidation service. Arguments are ids only; names
are stable so queued messages survive deploys."""

import logging

from celery import shared_task
from django.conf import settings
from django.utils import timezone

from memory_worker import consolidation, hooks
from memory_worker.dispatch import request_consolidation
from memory_worker.runtime import chat_lock

log = logging.getLogger("chatmem.tasks")


@shared_task(name="chatmem.consolidate_chat", queue="memory", acks_late=True)
def consolidate_chat(chat_id: int, trigger: str = "turn") -> list[str]:
    outcomes = consolidation.consolidate_with_lock(chat_id, trigger, chat_lock())
    return [outcome.status for outcome in outcomes]


@shared_task(name="chatmem.sweep", queue="memory")
def sweep() -> int:
    now = timezone.now()
    consolidation.abandon_stale_runs(now)
    chat_ids = consolidation.sweep_candidates(now, chat_lock(), settings.MEMORY_SWEEP_BATCH)
    for chat_id in chat_ids:
        request_consolidation(chat_id, "sweep")
    log.info("sweep", extra={"event": "sweep", "enqueued": len(chat_ids)})
    return len(chat_ids)


@shared_task(name="chatmem.run_flush_hook", queue="memory", acks_late=True)
def run_flush_hook(hook_path: str, chat_id: int, from_seq: int, to_seq: int, version: int) -> None:
    hooks.run_hook(hook_path, chat_id, from_seq, to_seq, version)
