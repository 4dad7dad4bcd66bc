"""A range the provider keeps refusing, folded piece by piece (docs/policies.md, poison
messages): the refused range is halved (at turn boundaries while it holds several turns), each
piece summarized from the summary the pieces before it produced, and a refused piece halved
again, until the single message the provider refuses is left; refused again on its own (a
refusal may be a fluke), that message is withheld (the summarizer never sees it) and its
placeholder line goes into the summary. The pieces are probes held in memory: the fold commits
once, over the whole range (or the part of it folded before the budget or the task's time ran
out, up to a turn boundary), through the same fenced UPDATE as any fold
(memory_worker.folding.commit), so W still moves only to a turn boundary."""

from collections.abc import Sequence
from dataclasses import dataclass

from memory_worker.coordination.deadlines import time_for_a_chunk
from memory_worker.engine import isolation as isolation_policy
from memory_worker.folding.retries import REFUSAL_KINDS
from memory_worker.summaries.contract import (
    OPEN_ITEMS,
    FoldMessage,
    Summarizer,
    SummarizerError,
    SummaryResult,
)

WITHHELD_LINE = "- message {seq} withheld: the summarizer refused it"
# A run of them, as the fallback after a refused fold withholds its whole range: one line, so a
# long range does not crowd the summary's cap.
WITHHELD_RANGE_LINE = "- messages {first}-{last} withheld: the summarizer refused them"


@dataclass(frozen=True)
class Withheld:
    seq: int
    reason: str  # the refusal's error, as the ledger shows errors


@dataclass(frozen=True)
class Isolated:
    result: SummaryResult  # the summary of the range up to to_seq, its tokens and calls summed
    withheld: tuple[Withheld, ...]
    to_seq: int  # the range's last seq, or where the bisection stopped at a turn boundary


class IsolationFailed(Exception):
    """No summary to commit: the budget or the time ran out before a turn boundary, a piece
    failed some other way, or every piece was refused (then no single message is the cause).
    ``error`` is the last failure."""

    def __init__(self, error: SummarizerError, calls: int) -> None:
        super().__init__(str(error))
        self.error = error
        self.calls = calls


def isolate(
    summarizer: Summarizer,
    summary: str,
    messages: Sequence[FoldMessage],
    refusal: SummarizerError,
    deadline: float | None = None,
) -> Isolated:
    """``messages`` (refused as a whole with ``refusal``) summarized onto ``summary`` in pieces;
    at most ``engine.isolation.isolation_call_budget`` summarizer attempts, none started that
    could not end by ``deadline`` (deadlines.time_for_a_chunk). Stopped early, it returns what
    it folded if that ends at a turn boundary: the rest is a later fold's."""
    budget = isolation_policy.isolation_call_budget(len(messages))
    pending = halves(messages) if len(messages) > 1 else [list(messages)]
    current = summary
    attempts = calls = input_tokens = output_tokens = 0
    withheld: list[Withheld] = []
    # Single messages refused once on their own; a range of one was refused twice already.
    retried = {messages[0].seq} if len(messages) == 1 else set()
    folded_any = False
    done_to = 0  # the pieces go in seq order: everything up to this seq is folded or withheld
    last_error = refusal
    while pending:
        piece = pending.pop(0)
        if attempts >= budget or not time_for_a_chunk(deadline):
            # A prefix may be committed only up to a turn boundary, and only with something in
            # it folded (a prefix of refusals alone proves nothing about single messages).
            if not folded_any or piece[0].role != "user":
                raise IsolationFailed(last_error, calls)
            pending.clear()
            break
        attempts += 1
        try:
            result = summarizer.summarize(current, piece)
        except SummarizerError as error:
            calls += 1
            last_error = error
            if error.kind not in REFUSAL_KINDS:
                raise IsolationFailed(error, calls) from error
            if len(piece) == 1 and piece[0].seq not in retried:
                # A refusal may be a fluke: the message alone gets one more try first.
                retried.add(piece[0].seq)
                pending.insert(0, piece)
            elif len(piece) == 1:
                withheld.append(Withheld(piece[0].seq, str(error)[:300]))
                done_to = piece[0].seq
            else:
                pending[:0] = halves(piece)
            continue
        calls += result.calls
        input_tokens += result.input_tokens
        output_tokens += result.output_tokens
        current = result.text
        folded_any = True
        done_to = piece[-1].seq
    if not folded_any:
        raise IsolationFailed(last_error, calls)
    text = with_withheld_lines(current, [item.seq for item in withheld])
    result = SummaryResult(text, input_tokens, output_tokens, summarizer.name, calls)
    return Isolated(result, tuple(withheld), done_to)


def halves(piece: Sequence[FoldMessage]) -> list[list[FoldMessage]]:
    at = isolation_policy.split_index([message.role for message in piece])
    return [list(piece[:at]), list(piece[at:])]


def with_withheld_lines(summary: str, seqs: Sequence[int]) -> str:
    """``summary`` with one Open Items line per withheld message (its content never reached the
    summarizer), so the model reading the memory knows a message is not in it."""
    if not seqs:
        return summary
    added = withheld_lines(seqs)
    lines = summary.rstrip().splitlines()
    if OPEN_ITEMS not in lines:
        return "\n".join([*lines, "", OPEN_ITEMS, *added])
    start = lines.index(OPEN_ITEMS) + 1
    end = next(
        (i for i in range(start, len(lines)) if lines[i].startswith("## ")),
        len(lines),
    )
    section = [line for line in lines[start:end] if line.strip().lower() not in NO_ITEMS]
    while section and not section[-1].strip():
        section.pop()
    tail = ["", *lines[end:]] if end < len(lines) else []
    return "\n".join([*lines[:start], *section, *added, *tail])


NO_ITEMS = frozenset({"- none", "- (none)"})


def withheld_lines(seqs: Sequence[int]) -> list[str]:
    """One line per withheld message, or per run of consecutive ones."""
    runs: list[list[int]] = []
    for seq in sorted(seqs):
        if runs and seq == runs[-1][-1] + 1:
            runs[-1].append(seq)
        else:
            runs.append([seq])
    return [
        WITHHELD_LINE.format(seq=run[0])
        if len(run) == 1
        else WITHHELD_RANGE_LINE.format(first=run[0], last=run[-1])
        for run in runs
    ]
