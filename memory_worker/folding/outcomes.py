"""What one fold attempt came to: its status (the strings logs, ledger and task results carry)
and what the run loop and the turn need to know about it."""

from dataclasses import dataclass
from enum import StrEnum

from memory_worker.engine import policy as engine


class FoldStatus(StrEnum):
    NOTHING = "nothing"  # nothing due, or the chat is gone
    DEFERRED = "deferred"  # in its failure backoff
    SUCCEEDED = "succeeded"
    SUPERSEDED = "superseded"  # another fold committed first: nothing written
    FAILED = "failed"
    WAITED = "waited"  # a turn that waited for a fold in flight instead of folding
    DATABASE_ERROR = "database_error"  # a task's result: the task retries on its own


@dataclass(frozen=True)
class FoldOutcome:
    status: FoldStatus
    decision: engine.Decision | None = None
    ledger_id: int | None = None
    error: str = ""
    transient: bool = False
    kind: str = ""  # the summarizer's error kind when failed ("crash" for anything else)
    retry_in: float | None = None  # seconds until the worker's own retry; None: no fast retry
    # Failed: the retry plan says a background fold falls back to the offline summarizer.
    fall_back: bool = False
    # Succeeded: whether the state this fold committed, judged on the messages it read, still
    # has a fold due (one fold per cycle: a long backlog takes several).
    more_due: bool = False
    # Succeeded: the deadline stopped it before the end of the decided range.
    cut_short: bool = False
