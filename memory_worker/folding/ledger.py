"""The ledger rows of fold attempts (``Consolidation``): the "running" row a fold starts with and
its heartbeat (renewed from a thread while the fold lives), the row of a fold a database error
interrupted, the fields of every failed fold's log line, and the retention of old rows that
prove nothing."""

import logging
import socket
import threading
import time
import uuid
from collections.abc import Sequence
from datetime import datetime, timedelta
from typing import Any

from django.conf import settings
from django.db import connection
from django.db.models.functions import Now

from conversations import rows
from conversations.models import PRUNABLE_STATUSES, Consolidation, ConsolidationStatus
from conversations.rows import DATABASE_ERRORS
from memory_worker.coordination.deadlines import call_lifetime, fold_heartbeat_stale_after
from memory_worker.folding.outcomes import FoldStatus
from memory_worker.summaries.contract import (
    FoldMessage,
    RepairingSummarizer,
    Summarizer,
    SummaryResult,
)

log = logging.getLogger("chatmem.fold")


WORKER_NAME = f"{socket.gethostname()}:{uuid.uuid4().hex[:6]}"


def record_running(ledger: Consolidation) -> None:
    """The fold's "running" ledger row. On PostgreSQL its commit does not wait for a disk flush:
    if the database crashes before the fold's own (synchronous) commit, the fold is lost with
    it and there is nothing for the row to record."""
    if connection.vendor == "postgresql":
        rows.insert_without_flush_wait(ledger)
    else:
        ledger.save(force_insert=True)


def beat(ledger: Consolidation) -> bool | None:
    """The running fold's heartbeat: its row's ``heartbeat_at`` set to the database's now (the
    recovery compares it with its own, on another host), only while the row is still running.
    Whether it was (False: the recovery took the fold for dead and marked it, and the chat is
    being folded beside it; its commit stays fenced). Best effort: None when the database did
    not answer, and the fold's own commit then meets the same trouble."""
    try:
        renewed = Consolidation.objects.filter(
            pk=ledger.pk, status=ConsolidationStatus.RUNNING
        ).update(heartbeat_at=Now())
    except DATABASE_ERRORS:
        log.warning(
            "could not renew the fold's heartbeat",
            extra={"chat_id": ledger.chat_id, "ledger_id": ledger.pk},
        )
        return None
    if not renewed:
        log.warning(
            "the fold was taken for dead and marked; its commit stays fenced",
            extra={"event": "fold_heartbeat_lost", "chat_id": ledger.chat_id},
        )
    return bool(renewed)


class Heartbeat:
    """A running fold's heartbeat, renewed every quarter of the staleness bound
    (deadlines.fold_heartbeat_stale_after) by a daemon thread, so a fold is judged dead within
    that bound of its process dying, however long one summarizer call takes. The thread dies
    with its process, and stops by itself once a summarizer call started (``beat``) should have
    ended, at the slowest, for a while: a process alive but stuck in a call past its deadline
    is then taken for dead like a killed one (its commit stays fenced)."""

    def __init__(self, ledger: Consolidation) -> None:
        self.ledger = ledger
        self._interval = fold_heartbeat_stale_after() / 4
        self._stopped = threading.Event()
        self._until = time.monotonic() + call_lifetime()
        self._thread = threading.Thread(
            target=self._run, name=f"chatmem-heartbeat-{ledger.chat_id}", daemon=True
        )

    def __enter__(self) -> "Heartbeat":
        self._thread.start()
        return self

    def __exit__(self, *exc_info: object) -> None:
        self._stopped.set()
        # A renewal in flight waits at most for the commit's row lock; not waited for longer.
        self._thread.join(timeout=1.0)

    def beat(self) -> bool | None:
        """Renewed now, before a summarizer call: the thread beats for that call's lifetime.
        Whether the row is still running (ledger.beat)."""
        self._until = time.monotonic() + call_lifetime()
        return beat(self.ledger)

    def _run(self) -> None:
        while not self._stopped.wait(self._interval):
            if time.monotonic() >= self._until or not self._renew():
                return

    def _renew(self) -> bool:
        """Silent, unlike ``beat``: a row found finished here is most often the fold's own
        commit, which the renewal waited for."""
        try:
            return bool(
                Consolidation.objects.filter(
                    pk=self.ledger.pk, status=ConsolidationStatus.RUNNING
                ).update(heartbeat_at=Now())
            )
        except DATABASE_ERRORS:
            return True  # the database blinked: try again at the next beat
        finally:
            # The thread's own connection, closed between beats minutes apart: held, it would
            # double a fold's share of the database's (or the pooler's) connections.
            connection.close()


class Beating:
    """``summarizer`` renewing its fold's heartbeat before each call but the first (the row was
    stamped when it was written, just before), which tells the fold when the recovery took it
    for dead and keeps the heartbeat's thread going for that call."""

    def __init__(self, summarizer: Summarizer, heartbeat: Heartbeat) -> None:
        self.summarizer = summarizer
        self.heartbeat = heartbeat
        # (A plug-in's or a test's summarizer may do without the name until it is asked for.)
        self.name: str = getattr(summarizer, "name", type(summarizer).__name__)
        self._calls = 0

    def _beat(self) -> None:
        if self._calls:
            self.heartbeat.beat()
        self._calls += 1

    def summarize(self, current_summary: str, messages: Sequence[FoldMessage]) -> SummaryResult:
        self._beat()
        return self.summarizer.summarize(current_summary, messages)


class BeatingRepairing(Beating):
    """``Beating`` for a summarizer the fold guard can ask for a repair."""

    summarizer: RepairingSummarizer

    def repair(
        self,
        current_summary: str,
        messages: Sequence[FoldMessage],
        draft: str,
        keep: Sequence[str],
    ) -> SummaryResult:
        self._beat()
        return self.summarizer.repair(current_summary, messages, draft, keep)


def beating(summarizer: Summarizer, heartbeat: Heartbeat) -> Summarizer:
    if isinstance(summarizer, RepairingSummarizer):
        return BeatingRepairing(summarizer, heartbeat)
    return Beating(summarizer, heartbeat)


# The error of a row a database error interrupted: "<exception class> (database error)".
DATABASE_ERROR = "(database error)"


def record_interrupted(ledger: Consolidation, error: BaseException, started: float) -> None:
    """Best effort: the ledger row of a fold a database error interrupted, marked interrupted (not
    the chat's failure, nor its worker's death: memory_worker.scheduling.sweep.deaths_in_a_row), and
    the attempt's ``fold`` log line. Only a row still "running": the error may have come after the
    commit itself landed (the connection lost before its answer), and then the row says so. The
    brief is left alone: nothing is wrong with the chat's folds, and the task counts its own
    retries. The database may still be down (this then fails, within DB_CONNECT_TIMEOUT, and says
    so): the sweep abandons the row once no lock can still cover it."""
    duration_ms = int((time.monotonic() - started) * 1000)
    error_name = type(error).__name__
    marked: bool | None = None  # unknown: the row could not be written
    try:
        if not connection.in_atomic_block:  # (in one, closing would break the caller's)
            # A connection the error broke is replaced, not reused (it would fail again).
            connection.close_if_unusable_or_obsolete()
        marked = bool(
            Consolidation.objects.filter(pk=ledger.pk, status=ConsolidationStatus.RUNNING).update(
                status=ConsolidationStatus.INTERRUPTED,
                finished_at=Now(),
                duration_ms=duration_ms,
                error=f"{error_name} {DATABASE_ERROR}",
            )
        )
    except Exception as unmarked:
        log.warning(
            "could not mark the interrupted fold failed (%s); the sweep will",
            type(unmarked).__name__,
            extra={"chat_id": ledger.chat_id, "ledger_id": ledger.pk},
        )
    if marked is False:
        # Not running: the commit landed after all (its outcome stands), or the chat is gone.
        log.info(
            "database error after the fold's row was written",
            extra={"chat_id": ledger.chat_id, "ledger_id": ledger.pk, "error": error_name},
        )
        return
    log.warning(
        "fold interrupted by a database error",
        extra={
            **failed_fold_fields(ledger),
            "outcome": str(ConsolidationStatus.INTERRUPTED),
            "ledger_id": ledger.pk,
            "error_kind": "database",
            "duration_ms": duration_ms,
            "error": error_name,
        },
    )


# Rows deleted per statement, and statements per call: one sweep's share, so a large backlog of
# old rows goes over several sweeps rather than in one long transaction.
PRUNE_BATCH = 1000
PRUNE_BATCHES_PER_SWEEP = 10


def prune_ledger() -> int:
    """Deletes ledger rows of PRUNABLE_STATUSES finished more than MEMORY_LEDGER_RETENTION_DAYS
    ago (0: keep every row), in batches; returns how many. Database time: the rows were stamped
    by many hosts."""
    days = settings.MEMORY_LEDGER_RETENTION_DAYS
    if days <= 0:
        return 0
    old = Consolidation.objects.filter(
        status__in=PRUNABLE_STATUSES, finished_at__lt=Now() - timedelta(days=days)
    )
    deleted = 0
    for _batch in range(PRUNE_BATCHES_PER_SWEEP):
        ids = list(old.order_by().values_list("pk", flat=True)[:PRUNE_BATCH])
        if not ids:
            break
        deleted += Consolidation.objects.filter(pk__in=ids).delete()[0]
    if deleted:
        log.info("ledger pruned", extra={"event": "ledger_pruned", "deleted": deleted})
    return deleted


def failed_fold_fields(ledger: Consolidation) -> dict[str, Any]:
    """What every failed fold's log line says of the attempt."""
    return {
        "event": "fold",
        "chat_id": ledger.chat_id,
        "trigger": ledger.trigger,
        "synchronous": ledger.synchronous,
        "from_seq": ledger.from_seq,
        "to_seq": ledger.to_seq,
        "outcome": str(FoldStatus.FAILED),
    }


def lag_ms(due_at: datetime | None, finished_at: datetime) -> int | None:
    """Consolidation lag: from the turn that found a fold due to the fold's commit."""
    if due_at is None:
        return None
    return max(int((finished_at - due_at).total_seconds() * 1000), 0)
