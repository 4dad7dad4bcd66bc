"""Seed 002's memory flush hook: after a fold commits, each dotted path in MEMORY_FLUSH_HOOKS
runs as its own task with the folded range, so extraction never blocks a turn or a fold.

A hook is a callable ``hook(chat_id, messages, version)`` where ``messages`` are the folded
Message rows in seq order."""

import logging
from typing import Any

from django.conf import settings
from django.dispatch import receiver
from django.utils.module_loading import import_string

from conversations.models import Message
from memory_worker.signals import messages_folded

log = logging.getLogger("chatmem.hooks")


def run_hook(hook_path: str, chat_id: int, from_seq: int, to_seq: int, version: int) -> None:
    hook = import_string(hook_path)
    messages = list(
        Message.objects.filter(chat_id=chat_id, seq__gte=from_seq, seq__lte=to_seq).order_by("seq")
    )
    hook(chat_id, messages, version)


@receiver(messages_folded, dispatch_uid="chatmem.flush_hooks")
def queue_flush_hooks(
    sender: Any, chat_id: int, from_seq: int, to_seq: int, version: int, **_: Any
) -> None:
    for hook_path in settings.MEMORY_FLUSH_HOOKS:
        try:
            if settings.MEMORY_DISPATCH == "celery":
                from memory_worker.tasks import run_flush_hook

                run_flush_hook.apply_async(
                    args=(hook_path, chat_id, from_seq, to_seq, version), retry=False
                )
            elif settings.MEMORY_DISPATCH == "inline":
                from memory_worker.dispatch import submit_inline

                submit_inline(run_hook, hook_path, chat_id, from_seq, to_seq, version)
        except Exception:
            log.exception(
                "could not queue flush hook", extra={"hook": hook_path, "chat_id": chat_id}
            )
