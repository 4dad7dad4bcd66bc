"""A fold's commit: ONE conditional UPDATE of the brief (``WHERE version = v AND
last_consolidated = W``) with its ledger row's outcome. Zero rows means another fold committed
first: nothing is written and the row says ``superseded``. This UPDATE, not the Redis lock, is
what makes folding exactly-once."""

import logging
import time
from collections.abc import Sequence
from dataclasses import dataclass, replace
from datetime import datetime, timedelta
from functools import partial
from typing import Any

from django.db import connection, transaction
from django.db.models import F

from conversations import rows
from conversations.models import HOLD_CHAT_SQL, Brief, Chat, Consolidation, ConsolidationStatus
from memory_worker.engine import policy as engine
from memory_worker.folding.effective_policy import chat_tokens
from memory_worker.folding.isolation import Withheld
from memory_worker.folding.ledger import lag_ms
from memory_worker.folding.outcomes import FoldOutcome, FoldStatus
from memory_worker.folding.snapshot import MemorySnapshot, after_fold
from memory_worker.signals import messages_folded
from memory_worker.summaries import guard as fold_guard
from memory_worker.summaries.contract import SummaryResult
from memory_worker.summaries.guarded import DROPPED_DETAILS_KEPT

log = logging.getLogger("chatmem.fold")


def commit_fold(
    chat: Chat,
    snapshot: MemorySnapshot,
    decision: engine.Decision,
    ledger: Consolidation,
    result: SummaryResult,
    *,
    now: datetime,
    started: float,
    withheld: Sequence[Withheld] = (),
    fallback_reason: str = "",
    dropped_details: Sequence[str] = (),
) -> tuple[FoldOutcome, MemorySnapshot]:
    """``withheld``: messages of the range folded past without their content (an isolation's;
    memory_worker.folding.isolation), recorded on the ledger row and added to the brief's list.
    ``decision.to_seq`` is where W moves (an isolation may stop short of the row's range).
    ``fallback_reason``: this is the offline summarizer's fold after the model's failed (why,
    for the brief and the ledger row). ``dropped_details``: the fold's loss report
    (memory_worker.summaries.guarded), all of it for the log line and the metric; the ledger row
    keeps the first DROPPED_DETAILS_KEPT."""
    duration_ms = int((time.monotonic() - started) * 1000)
    # Counted as the chat's model counts it: the summary is part of every prompt it is sent.
    summary_tokens = chat_tokens(chat, result.text)
    # Database time (the row's start is the database's) plus the fold's own duration.
    finished_at = ledger.started_at + timedelta(milliseconds=duration_ms)
    chat_id = chat.pk
    ledger_values: dict[str, Any] = {
        "finished_at": finished_at,
        "duration_ms": duration_ms,
        "input_tokens": result.input_tokens,
        "output_tokens": result.output_tokens,
        "summarizer_calls": result.calls,
        # The row's range as folded: an isolation may stop short of the one it started on.
        "to_seq": decision.to_seq,
    }
    if fallback_reason:
        ledger_values["error"] = f"fallback after: {fallback_reason}"[:2000]
    write = FoldWrite(
        chat_id=chat_id,
        snapshot=snapshot,
        ledger_id=ledger.pk,
        summary_tokens=summary_tokens,
        brief_values={
            "summary": result.text,
            "summary_tokens": summary_tokens,
            "last_consolidated": decision.to_seq,
            "last_consolidated_at": now,
            "turns_mark": snapshot.last_seq,
            "user_lines": fold_guard.user_lines_kept(snapshot.user_lines, result.text),
            **summary_source_values(snapshot, fallback_reason, now),
            "updated_at": finished_at,
        },
        dropped_details=list(dropped_details[:DROPPED_DETAILS_KEPT]),
        ledger_values=ledger_values,
    )
    if withheld:
        write = with_withheld(write, withheld)
    commit = commit_in_one_statement if connection.vendor == "postgresql" else commit_in_transaction
    committed = commit(write)
    status = FoldStatus.SUCCEEDED if committed else FoldStatus.SUPERSEDED
    if committed:
        # After the commit: at once outside a transaction, else when the caller's ends.
        transaction.on_commit(
            partial(
                messages_folded.send,
                sender=Brief,
                chat_id=chat_id,
                from_seq=decision.from_seq,
                to_seq=decision.to_seq,
                version=snapshot.version + 1,
                summary=result.text,
            )
        )
    log.info(
        "fold %s",
        status,
        extra={
            "event": "fold",
            "chat_id": chat_id,
            "trigger": decision.trigger,
            "synchronous": ledger.synchronous,
            "from_seq": decision.from_seq,
            "to_seq": decision.to_seq,
            "messages_folded": decision.to_seq - decision.from_seq + 1,
            "summary_tokens_before": snapshot.summary_tokens,
            "summary_tokens_after": summary_tokens,
            "input_tokens": result.input_tokens,
            "output_tokens": result.output_tokens,
            "summarizer_calls": result.calls,
            "withheld_seqs": [item.seq for item in withheld],
            "dropped_details": len(dropped_details),
            "duration_ms": duration_ms,
            "lag_ms": lag_ms(ledger.due_at, finished_at),
            "fallback": bool(fallback_reason),
            "outcome": str(status),
        },
    )
    outcome = FoldOutcome(status, decision, ledger.pk)
    return outcome, after_fold(snapshot, write.brief_values) if committed else snapshot


def summary_source_values(
    snapshot: MemorySnapshot, fallback_reason: str, now: datetime
) -> dict[str, Any]:
    """A model fold ends the failure state and the fallback. A fallback fold marks the summary
    as the offline summarizer's (since its first such fold: the fence makes the snapshot's
    value the brief's) and keeps the failure count, degraded flag and error: the model
    summarizer still fails. Its retry time goes, as the range is folded: the next fold due
    asks the model first, so memory keeps its rhythm and catches the model's recovery."""
    if fallback_reason:
        return {
            "fallback_since": snapshot.fallback_since or now,
            "fallback_reason": fallback_reason[:2000],
            "next_attempt_at": None,
        }
    return {
        "consecutive_failures": 0,
        "degraded": False,
        "next_attempt_at": None,
        "last_error": "",
        "failure_kind": "",
        "fallback_since": None,
        "fallback_reason": "",
    }


@dataclass(frozen=True)
class FoldWrite:
    """What committing a fold writes: the brief (``brief_values``, and its version advanced) if
    it wins the fencing step, the ledger row's outcome either way."""

    chat_id: int
    snapshot: MemorySnapshot  # what the fold read: the fencing step's version and W
    ledger_id: int
    summary_tokens: int  # the new summary's
    dropped_details: list[str]  # on the ledger row if it commits: a superseded summary lost nothing
    brief_values: dict[str, Any]
    ledger_values: dict[str, Any]


def with_withheld(write: FoldWrite, withheld: Sequence[Withheld]) -> FoldWrite:
    """``write`` recording ``withheld`` too. The brief's list as of the version the fold read:
    had another fold committed since, this one loses its fencing step and writes nothing."""
    recorded = (
        Brief.objects.filter(chat_id=write.chat_id, version=write.snapshot.version)
        .values_list("withheld", flat=True)
        .first()
    )
    added = [{"seq": item.seq, "reason": item.reason} for item in withheld]
    return replace(
        write,
        brief_values={**write.brief_values, "withheld": [*(recorded or []), *added]},
        ledger_values={**write.ledger_values, "withheld_seqs": [item.seq for item in withheld]},
    )


def commit_in_transaction(write: FoldWrite) -> bool:
    """The fencing step and the ledger's outcome, in one transaction. Returns whether this fold
    advanced W."""
    snapshot = write.snapshot
    with transaction.atomic():
        # The fencing step: only the fold that read this exact version may advance W.
        committed = bool(
            Brief.objects.filter(
                chat_id=write.chat_id,
                version=snapshot.version,
                last_consolidated=snapshot.last_consolidated,
            ).update(version=F("version") + 1, **write.brief_values)
        )
        status = ConsolidationStatus.SUCCEEDED if committed else ConsolidationStatus.SUPERSEDED
        Consolidation.objects.filter(pk=write.ledger_id).update(
            status=status,
            summary_tokens_after=write.summary_tokens if committed else snapshot.summary_tokens,
            dropped_details=write.dropped_details if committed else [],
            **write.ledger_values,
        )
    return committed


def commit_in_one_statement(write: FoldWrite) -> bool:
    """PostgreSQL: ``commit_in_transaction`` as one statement, atomic on its own (no BEGIN and
    COMMIT round trips): the brief's conditional UPDATE in a data-modifying CTE, and the ledger
    row's UPDATE reading whether it changed a row. A CTE's UPDATE runs exactly once, however
    often the statement refers to it. The brief's UPDATE first holds the chat row (its one-time
    filter runs before any row is touched), as a deletion takes the chat before the brief and
    the ledger (conversations.models.hold_chat): one order, so the two cannot deadlock."""
    snapshot = write.snapshot
    column = rows.column
    brief_sets, params = rows.assignments(Brief, write.brief_values)
    ledger_sets, ledger_params = rows.assignments(Consolidation, write.ledger_values)
    version = column(Brief, "version")
    won = "EXISTS (SELECT 1 FROM folded)"
    sql = (
        f"WITH folded AS (UPDATE {rows.quoted_table(Brief)} "
        f"SET {brief_sets}, {version} = {version} + 1 "
        f"WHERE {column(Brief, 'chat')} = %s AND {version} = %s "
        f"AND {column(Brief, 'last_consolidated')} = %s "
        f"AND EXISTS ({HOLD_CHAT_SQL}) RETURNING 1) "
        f"UPDATE {rows.quoted_table(Consolidation)} SET {ledger_sets}, "
        f"{column(Consolidation, 'status')} = CASE WHEN {won} THEN %s ELSE %s END, "
        f"{column(Consolidation, 'summary_tokens_after')} = CASE WHEN {won} THEN %s ELSE %s END, "
        f"{column(Consolidation, 'dropped_details')} = CASE WHEN {won} THEN %s ELSE %s END "
        f"WHERE {column(Consolidation, 'id')} = %s RETURNING {won}"
    )
    params += [write.chat_id, snapshot.version, snapshot.last_consolidated, write.chat_id]
    params += ledger_params
    params += [ConsolidationStatus.SUCCEEDED.value, ConsolidationStatus.SUPERSEDED.value]
    params += [write.summary_tokens, snapshot.summary_tokens]
    details = rows.model_field(Consolidation, "dropped_details")
    params += [details.get_db_prep_save(write.dropped_details, connection)]
    params += [details.get_db_prep_save([], connection), write.ledger_id]
    with connection.cursor() as cursor:
        cursor.execute(sql, params)
        found = cursor.fetchone()
    if found is not None:
        return bool(found[0])
    # The ledger row is gone (the chat was deleted while its fold ran): so is the brief.
    return False
