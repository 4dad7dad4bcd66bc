"""The memory flush hook: after a fold commits, each dotted path in MEMORY_FLUSH_HOOKS runs as its
own task with the folded range, so extraction never blocks a turn or a fold.

A hook is a callable ``hook(chat_id, messages, version)`` where ``messages`` are the folded
Message rows in seq order."""

import logging
from collections import defaultdict
from datetime import datetime, timedelta
from typing import Any

from django.conf import settings
from django.core.cache import cache
from django.dispatch import receiver
from django.utils.module_loading import import_string

from conversations.models import Consolidation, ConsolidationStatus, DailyNote, Message
from memory_worker.coordination.dispatch import TaskByName, hand_off
from memory_worker.daily_notes import HOOK_PATH as DAILY_NOTES_HOOK
from memory_worker.signals import messages_folded

log = logging.getLogger("chatmem.hooks")

RUN_FLUSH_HOOK = TaskByName("chatmem.run_flush_hook")


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
        queue_hook(hook_path, chat_id, from_seq, to_seq, version)


def queue_hook(hook_path: str, chat_id: int, from_seq: int, to_seq: int, version: int) -> bool:
    """Hand one hook run on; False (logged) when the broker refused it, or dispatch is off.
    Never raises: the fold is committed, and the sweep replays the daily-notes hook of a fold it
    never reached (``replay_missed_daily_notes``)."""

    def publish() -> None:
        RUN_FLUSH_HOOK.apply_async(
            args=(hook_path, chat_id, from_seq, to_seq, version), retry=False
        )

    return hand_off(
        "flush hook",
        {"hook": hook_path, "chat_id": chat_id},
        publish,
        run_hook,
        hook_path,
        chat_id,
        from_seq,
        to_seq,
        version,
    )


# ---------------------------------------------------------------------------------------------
# The sweep: daily-notes hooks that were never queued
#
# A hook whose publish failed (the broker was down for a moment after the fold committed) leaves
# no queued task, and nothing else would run that fold range through it again. For the daily
# notes both halves are already stored: the ledger has every committed fold's range, and each
# note records the ranges merged into it (DailyNote.ranges). So the sweep walks the ledger in id
# order from a cursor and queues the hook again for a committed fold whose range no note of its
# chat records. Each ledger row is looked at once (the cursor moves past it), so a range whose
# hook keeps failing is replayed once, not at every sweep. Other hooks record nothing chatmem
# can read, so they are not replayed (docs/policies.md).

REPLAY_CURSOR_KEY = "chatmem:hook-replay-cursor"
# Longer than the hook task's own retries (30 s doubling to 480 s: 15.5 minutes), so a hook
# still being retried is not queued twice (twice would be harmless: a note merges a range once).
REPLAY_AFTER = timedelta(minutes=20)
# Where the walk starts when the cursor is lost (cache flushed or per-process): the folds of
# the last day are looked at again, the older ones are not.
REPLAY_LOOKBACK = timedelta(days=1)
# Ledger rows looked at per sweep (one indexed range read): more than a busy service commits
# between two sweeps, so the cursor keeps up instead of falling further behind every minute.
REPLAY_BATCH = 5000


def replay_missed_daily_notes(now: datetime, limit: int = REPLAY_BATCH) -> int:
    """Queue the daily-notes hook for committed folds it never ran for; returns how many."""
    if DAILY_NOTES_HOOK not in settings.MEMORY_FLUSH_HOOKS or settings.MEMORY_DISPATCH == "off":
        return 0
    cursor = replay_cursor(now)
    folds = settled_folds(cursor, now - REPLAY_AFTER, limit)
    committed = [fold for fold in folds if fold.status == ConsolidationStatus.SUCCEEDED]
    merged = merged_ranges({fold.chat_id for fold in committed})
    replayed = 0
    for fold in folds:
        missed = fold.status == ConsolidationStatus.SUCCEEDED and (
            (fold.from_seq, fold.to_seq) not in merged[fold.chat_id]
        )
        if missed:
            version = fold.base_version + 1
            if not queue_hook(DAILY_NOTES_HOOK, fold.chat_id, fold.from_seq, fold.to_seq, version):
                break  # the broker is still down: this fold is looked at again next sweep
            replayed += 1
        cursor = fold.pk
    set_replay_cursor(cursor)
    if replayed:
        log.warning(
            "daily-notes hooks replayed",
            extra={"event": "hook_replayed", "hook": DAILY_NOTES_HOOK, "replayed": replayed},
        )
    return replayed


def settled_folds(cursor: int, cutoff: datetime, limit: int) -> list[Consolidation]:
    """Ledger rows after ``cursor``, in id order, up to the first one that may still be in
    flight (running, or committed after ``cutoff``): the cursor must not move past a fold whose
    hook may still come."""
    rows = Consolidation.objects.filter(pk__gt=cursor).order_by("pk")
    fields = ("id", "chat_id", "status", "from_seq", "to_seq", "base_version", "finished_at")
    settled = []
    for fold in rows.only(*fields)[:limit]:
        if fold.status == ConsolidationStatus.RUNNING:
            break
        if fold.status == ConsolidationStatus.SUCCEEDED and (
            fold.finished_at is None or fold.finished_at > cutoff
        ):
            break
        settled.append(fold)
    return settled


def merged_ranges(chat_ids: set[int]) -> dict[int, set[tuple[int, int]]]:
    """The fold ranges the chats' daily notes record, per chat (only committed folds' chats are
    asked for: the others' notes are never looked at)."""
    merged: dict[int, set[tuple[int, int]]] = defaultdict(set)
    notes = DailyNote.objects.filter(chat_id__in=chat_ids).values_list("chat_id", "ranges")
    for chat_id, ranges in notes:
        merged[chat_id].update((first, last) for first, last in ranges)
    return merged


def replay_cursor(now: datetime) -> int:
    try:
        stored = cache.get(REPLAY_CURSOR_KEY)
    except Exception:  # the cache is down: start from the lookback
        log.warning("hook replay cursor unreadable", exc_info=True)
        stored = None
    if stored is not None:
        return int(stored)
    before = Consolidation.objects.filter(started_at__lt=now - REPLAY_LOOKBACK).order_by("-pk")
    return int(before.values_list("pk", flat=True).first() or 0)


def set_replay_cursor(fold_id: int) -> None:
    try:
        cache.set(REPLAY_CURSOR_KEY, fold_id, timeout=None)
    except Exception:
        log.warning("hook replay cursor not saved", exc_info=True)
