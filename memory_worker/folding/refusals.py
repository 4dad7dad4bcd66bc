"""A fold's summarizer call that did not give a plain summary (docs/policies.md, poison
messages and the fold guard): the failure recorded, or a refused range bisected
(memory_worker.folding.isolation) or, for the offline fallback after a refusal, withheld; each
summary that is written passes the fold guard like any other (``guard_context``)."""

from dataclasses import replace
from datetime import datetime

from conversations.chat_model.tokens import count_tokens
from conversations.models import Chat, Consolidation
from conversations.variants import chat_variant
from memory_worker.engine import isolation as isolation_policy
from memory_worker.engine import policy as engine
from memory_worker.folding.commit import commit_fold
from memory_worker.folding.isolation import (
    Isolated,
    IsolationFailed,
    Withheld,
    isolate,
    with_withheld_lines,
    withheld_lines,
)
from memory_worker.folding.outcomes import FoldOutcome, FoldStatus
from memory_worker.folding.retries import (
    CRASH_KIND,
    REFUSAL_KINDS,
    prior_refusals,
    record_failure,
)
from memory_worker.folding.snapshot import MemorySnapshot
from memory_worker.summaries.backends import offline_summarizer
from memory_worker.summaries.contract import FoldMessage, Summarizer, SummarizerError
from memory_worker.summaries.guarded import GuardContext, guard

# The Open Items heading a withheld marker may need, with its line breaks.
WITHHELD_HEADING_TOKENS = 8


def fold_after_error(
    chat: Chat,
    snapshot: MemorySnapshot,
    chunk: engine.Decision,
    messages: list[FoldMessage],
    summarizer: Summarizer,
    ledger: Consolidation,
    error: SummarizerError,
    *,
    now: datetime,
    started: float,
    deadline: float | None,
    cap_tokens: int,
) -> tuple[FoldOutcome, MemorySnapshot]:
    """The chunk's summarizer call failed with ``error``: the failure recorded, unless it is a
    refusal due for isolation and the isolation folds the chunk (``commit_isolated``)."""
    isolate_next, calls = False, 0
    if error.kind in REFUSAL_KINDS and not ledger.synchronous:
        if isolation_policy.isolation_due(
            prior_refusals(chat.pk, snapshot.version, chunk.from_seq) + 1
        ):
            try:
                isolated = isolate(summarizer, snapshot.summary, messages, error, deadline)
            except IsolationFailed as unisolated:
                error, calls = unisolated.error, unisolated.calls + 1
            except Exception as crash:
                record_crash(chat, snapshot, ledger, crash, now=now, started=started)
                raise
            else:
                try:
                    return commit_isolated(
                        chat, snapshot, chunk, messages, ledger, isolated, now, started, cap_tokens
                    )
                except SummarizerError as lossy:
                    error, calls = lossy, isolated.result.calls + 1
        else:
            isolate_next = True
    plan = record_failure(
        chat.pk,
        snapshot,
        ledger,
        error=str(error),
        kind=error.kind,
        now=now,
        started=started,
        isolate_next=isolate_next,
        calls=calls,
    )
    failed = FoldOutcome(
        FoldStatus.FAILED,
        chunk,
        ledger.pk,
        str(error),
        error.transient,
        error.kind,
        plan.delay.total_seconds() if plan.fast_retry else None,
        fall_back=plan.fall_back,
    )
    return failed, snapshot


def guard_context(
    chat: Chat, snapshot: MemorySnapshot, seen: list[FoldMessage], cap_tokens: int
) -> GuardContext:
    """What the fold guard checks a summary of ``seen`` (the messages the summarizer read)
    against: the summary it replaces, the chat's pins and the lines a person wrote, its cap in
    the chat's model's tokens."""
    pinned = [pin.text for pin in snapshot.pins]
    model = chat_variant(chat.model_variant).model
    return GuardContext(snapshot.summary, seen, cap_tokens, pinned, snapshot.user_lines, model)


def commit_isolated(
    chat: Chat,
    snapshot: MemorySnapshot,
    chunk: engine.Decision,
    messages: list[FoldMessage],
    ledger: Consolidation,
    isolated: Isolated,
    now: datetime,
    started: float,
    cap_tokens: int,
) -> tuple[FoldOutcome, MemorySnapshot]:
    """An isolation's summary, guarded like any other against what the summarizer saw (a
    withheld message's content never reached it, so it takes nothing back), with no repair
    call (its pieces were refused once already), then committed."""
    folded = replace(chunk, to_seq=isolated.to_seq)
    withheld = {item.seq for item in isolated.withheld}
    seen = [m for m in messages if m.seq <= folded.to_seq and m.seq not in withheld]
    context = guard_context(chat, snapshot, seen, cap_tokens)
    guarded = guard(isolated.result, context)
    # The whole chunk's refused call counts too.
    result = replace(guarded.result, calls=guarded.result.calls + 1)
    outcome, after = commit_fold(
        chat,
        snapshot,
        folded,
        ledger,
        result,
        now=now,
        started=started,
        withheld=isolated.withheld,
        dropped_details=guarded.dropped_details,
    )
    return replace(outcome, cut_short=folded.to_seq < chunk.to_seq), after


def commit_withheld(
    chat: Chat,
    snapshot: MemorySnapshot,
    chunk: engine.Decision,
    messages: list[FoldMessage],
    ledger: Consolidation,
    reason: str,
    now: datetime,
    started: float,
    cap_tokens: int,
) -> tuple[FoldOutcome, MemorySnapshot]:
    """The fallback after the model refused the range: its messages withheld (a marker line,
    their content left out), since a summary carrying what the model refused would have every
    later model fold of the chat refused too. The rest of the summary as it was, made room for
    by the offline summarizer, guarded like any other; the messages stay in the history."""
    lines = withheld_lines([m.seq for m in messages])
    room = cap_tokens - count_tokens("\n".join(lines)) - WITHHELD_HEADING_TOKENS
    base = offline_summarizer(max(room, 1)).summarize(snapshot.summary, [])
    text = with_withheld_lines(base.text, [m.seq for m in messages])
    context = guard_context(chat, snapshot, [], cap_tokens)
    guarded = guard(replace(base, text=text), context)
    withheld = [Withheld(m.seq, reason[:300]) for m in messages]
    return commit_fold(
        chat,
        snapshot,
        chunk,
        ledger,
        guarded.result,
        now=now,
        started=started,
        withheld=withheld,
        fallback_reason=reason,
        dropped_details=guarded.dropped_details,
    )


def record_crash(
    chat: Chat,
    snapshot: MemorySnapshot,
    ledger: Consolidation,
    error: Exception,
    *,
    now: datetime,
    started: float,
) -> None:
    """Anything else, Celery's soft time limit included: the ledger must not stay "running".
    The name only: the error's text may hold anything (SQL, a provider's account details), and
    the brief's last_error is shown to the chat's owner; the traceback goes to the log with the
    task's failure."""
    failure = f"{type(error).__name__} (crashed; see the worker's log)"
    record_failure(
        chat.pk, snapshot, ledger, error=failure, kind=CRASH_KIND, now=now, started=started
    )
