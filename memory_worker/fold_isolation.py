"""A range the provider keeps refusing, folded piece by piece (docs/policies.md, poison
messages): the refused range is halved (at turn boundaries while it holds several turns), each
piece summarized from the summary the pieces before it produced, and a refused piece halved
again, until the single message the provider refuses is left; that message is withheld (the
summarizer never sees it) and its placeholder line goes into the summary. The pieces are probes
held in memory: the fold commits once, over the whole range, through the same fenced UPDATE as
any fold (memory_worker.fold_commit), so W still moves only to the range's turn boundary."""

from collections.abc import Sequence
from dataclasses import dataclass

from memory_worker import policy as engine
from memory_worker.retries import REFUSAL_KINDS
from memory_worker.summarizers import (
    OPEN_ITEMS,
    FoldMessage,
    Summarizer,
    SummarizerError,
    SummaryResult,
)

WITHHELD_LINE = "- message {seq} withheld: the summarizer refused it"


@dataclass(frozen=True)
class Withheld:
    seq: int
    reason: str  # the refusal's error, as the ledger shows errors


@dataclass(frozen=True)
class Isolated:
    result: SummaryResult  # the whole range's summary, its tokens and calls summed
    withheld: tuple[Withheld, ...]


class IsolationFailed(Exception):
    """No summary for the range: the budget ran out, a piece failed some other way, or every
    piece was refused (then no single message is the cause). ``error`` is the last failure."""

    def __init__(self, error: SummarizerError, calls: int) -> None:
        super().__init__(str(error))
        self.error = error
        self.calls = calls


def isolate(
    summarizer: Summarizer, summary: str, messages: Sequence[FoldMessage], refusal: SummarizerError
) -> Isolated:
    """``messages`` (refused as a whole with ``refusal``) summarized onto ``summary`` in pieces;
    at most ``policy.isolation_call_budget`` summarizer attempts."""
    budget = engine.isolation_call_budget(len(messages))
    pending = halves(messages) if len(messages) > 1 else [list(messages)]
    current = summary
    attempts = calls = input_tokens = output_tokens = 0
    withheld: list[Withheld] = []
    folded_any = False
    last_error = refusal
    while pending:
        piece = pending.pop(0)
        if attempts >= budget:
            raise IsolationFailed(last_error, calls)
        attempts += 1
        try:
            result = summarizer.summarize(current, piece)
        except SummarizerError as error:
            calls += 1
            last_error = error
            if error.kind not in REFUSAL_KINDS:
                raise IsolationFailed(error, calls) from error
            if len(piece) == 1:
                withheld.append(Withheld(piece[0].seq, str(error)[:300]))
            else:
                pending[:0] = halves(piece)
            continue
        calls += result.calls
        input_tokens += result.input_tokens
        output_tokens += result.output_tokens
        current = result.text
        folded_any = True
    if not folded_any:
        raise IsolationFailed(last_error, calls)
    text = with_withheld_lines(current, [item.seq for item in withheld])
    result = SummaryResult(text, input_tokens, output_tokens, summarizer.name, calls)
    return Isolated(result, tuple(withheld))


def halves(piece: Sequence[FoldMessage]) -> list[list[FoldMessage]]:
    at = engine.split_index([message.role for message in piece])
    return [list(piece[:at]), list(piece[at:])]


def with_withheld_lines(summary: str, seqs: Sequence[int]) -> str:
    """``summary`` with one Open Items line per withheld message (its content never reached the
    summarizer), so the model reading the memory knows a message is not in it."""
    if not seqs:
        return summary
    added = [WITHHELD_LINE.format(seq=seq) for seq in seqs]
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
