"""The fold guard and the loss report (docs/policies.md, "The fold guard"): deterministic checks
of a new summary against the old one and the folded messages. Standard library only.

- ``losses``: the lines of the old summary that state a rule or an exact value
  (memory_worker.summaries.retention) whose values, or for a rule without one most of its words,
  are not in the new summary though it had room for them under its cap (free, or taken by
  lines that state no rule or value), unless a folded message superseded the line.
- ``dropped_details``: every exact detail of the fold's input (old summary and folded messages)
  that is not in the new summary, whatever the reason: what the fold let go.
"""

import re
from collections.abc import Collection, Iterable, Sequence
from dataclasses import dataclass, replace
from functools import lru_cache
from typing import Protocol

from conversations.chat_model.tokens import count_tokens
from memory_worker.summaries.retention import (
    CHANGE_MARKERS,
    EXACT_VALUE,
    FACT,
    FILE_NAME,
    RULE,
    VALUE,
    WITHHELD_MARKER,
    content_words,
    is_fact,
    is_rule,
    is_rule_or_value,
    is_standing,
    rank,
    statements,
    summary_lines,
    yields_to,
)

# A message that takes something back: the change markers, and plain revocations.
REVOKES = re.compile(
    r"\b(forget|cancel(?:led|s)?|revoke[ds]?|drop(?:ped)?|remove[ds]?|ignore|disregard|scrap|"
    r"never mind|no need|not needed|obsolete|outdated|lift(?:ed)?|void)\b",
    re.IGNORECASE,
)
# Rule words say how, not what: two lines sharing only "must" share no subject.
RULE_WORD_TEXT = (
    "must mustn't never always cannot can't don't required require requires allowed avoid least "
    "later shall"
)
RULE_WORDS = frozenset(RULE_WORD_TEXT.split())
# Details found whole, before the text is cut into words: URLs, e-mail addresses, code spans,
# file names.
WHOLE_DETAIL = re.compile(
    r"https?://[^\s<>\"'`)\]]+[^\s<>\"'`)\].,;:!?]|[\w.+-]+@[\w-]+(?:\.[\w-]+)+|`[^`\n]+`|"
    + FILE_NAME,
    re.IGNORECASE,
)
WORD_EDGES = "\"'()[]{}<>.,;:!?*_"
ORDINAL = re.compile(r"\d+(?:st|nd|rd|th)", re.IGNORECASE)
DIGIT_GROUPING = re.compile(r"(?<=\d),(?=\d{3})")
# Most of a rule's words gone, and its values with them: the rule is gone, not reworded.
RULE_WORDS_KEPT = 0.5
ROOM_MARGIN = 2  # tokens
# A summarizer cannot count its own tokens to the last: one that stopped within this share of
# its cap was cutting for the cap.
CAP_SLACK = 0.1
# A message's statement is kept when the summary states this share of its subject words: more
# than an old line's half, since half of a two-sentence rule is not the rule, and less than all,
# since a summarizer rewords.
STATEMENT_WORDS_KEPT = 0.6
# Where a standing item a summary dropped goes back: the summary's section of that name, in
# whatever markup (splice.with_line), or a new one in the headings' order.
RULES_HEADING = "Facts / Constraints"
GOALS_HEADING = "Goals / Preferences"
# A message restating a line's subject shares most of its words: "my locker number" is not
# "my flat number".
SAME_SUBJECT = 0.5


class Said(Protocol):
    """A folded message, as the guard reads it (memory_worker.summaries.contract.FoldMessage)."""

    @property
    def seq(self) -> int: ...

    @property
    def role(self) -> str: ...

    @property
    def content(self) -> str: ...


@dataclass(frozen=True)
class Loss:
    line: str  # the old summary's line
    missing: tuple[str, ...]  # its exact values not in the new summary; () for a rule's words
    heading: str | None = None  # the heading it stood under in the old summary
    # A statement of a folded message, not a line of the old summary: no repair call is made
    # for it (the draft's room went to its equals, and a model asked again would choose alike).
    said: bool = False

    def describe(self) -> str:
        if not self.missing:
            return self.line
        return f"{', '.join(self.missing)} (from: {self.line})"


def losses(
    old_summary: str,
    folded: Sequence[Said],
    new_summary: str,
    cap_tokens: int | None = None,
    user_lines: Collection[str] = (),
) -> list[Loss]:
    """The rules and exact values of ``old_summary`` that ``new_summary`` dropped and no message
    of ``folded`` superseded, one ``Loss`` per line, in the old summary's order. With
    ``cap_tokens``, only a line the new summary had room for (``SummaryText``): at the cap,
    with nothing weaker left to drop, something must go. ``user_lines``: lines a person wrote
    (the brief's), each kept like a rule, whatever it states."""
    kept = SummaryText(new_summary, cap_tokens, user_lines)
    found: list[Loss] = []
    seen: set[str] = set()
    for line in summary_lines(old_summary):
        text = line.text
        written = text in user_lines
        if text in seen or not (written or is_rule_or_value(text)):
            continue
        seen.add(text)
        loss = line_loss(text, kept, any_line=written)
        if (
            loss is not None
            and kept.has_room_for(text, rank(text, user_lines))
            and not superseded(text, folded, written=written)
        ):
            found.append(replace(loss, heading=line.heading))
    return [*found, *new_standing_losses(folded, kept, seen)]


def new_standing_losses(folded: Sequence[Said], kept: "SummaryText", seen: set[str]) -> list[Loss]:
    """The standing items the user said in ``folded`` (retention.is_standing: rules,
    preferences, where the work stands) and the facts stated with their value, that the new
    summary dropped though it had room (a fact's room: what only carries a value in passing),
    and no later message of the user's took back (a reply restating it is no revision): a
    summarizer must not decide that a rule said once is not worth a line. Each under the
    heading the offline summarizer would give it."""
    ordered = sorted(folded, key=seq_of)
    found = []
    for index, message in enumerate(ordered):
        if message.role != "user":
            continue
        for statement in statements(message.content):
            worth = RULE if is_standing(statement) else FACT if is_fact(statement) else None
            if statement in seen or worth is None:
                continue
            seen.add(statement)
            loss = line_loss(statement, kept, any_line=True, words_kept=STATEMENT_WORDS_KEPT)
            if loss is None or not kept.has_room_for(statement, worth):
                continue
            # Taken back only by the user, and as a person's line is: by its value or most of
            # its subject, not one shared word ("Actually, what were the prices again?").
            later = [m for m in ordered[index + 1 :] if m.role == "user"]
            if not superseded(statement, later, written=True):
                heading = (
                    GOALS_HEADING if worth == RULE and not is_rule(statement) else RULES_HEADING
                )
                found.append(replace(loss, heading=heading, said=True))
    return found


def user_lines_kept(user_lines: Iterable[str], new_summary: str) -> list[str]:
    """The lines a person wrote that ``new_summary`` still states (its values, most of its
    words): what stays marked as theirs after a fold. A line the fold let go (a folded message
    revoked it, or the cap bit) is no longer theirs to keep."""
    kept = SummaryText(new_summary)
    return [line for line in user_lines if line_loss(line, kept, any_line=True) is None]


def dropped_details(old_summary: str, folded: Sequence[Said], new_summary: str) -> list[str]:
    """The exact details of the fold's input absent from ``new_summary``, each once, in the
    order the input gives them (old summary first, then the messages by seq)."""
    kept = SummaryText(new_summary)
    texts = [old_summary, *(message.content for message in sorted(folded, key=seq_of))]
    dropped: dict[str, str] = {}
    for text in texts:
        for detail in details_of(text):
            key = detail_key(detail)
            if key not in dropped and not kept.has(detail):
                dropped[key] = detail
    return list(dropped.values())


def seq_of(message: Said) -> int:
    return message.seq


def details_of(text: str) -> list[str]:
    """Numbers of three digits or more, formatted numbers, dates and times, codes and
    identifiers with digits, URLs, e-mail addresses, code spans, file names."""
    found = [match.group(0) for match in WHOLE_DETAIL.finditer(text)]
    for word in WHOLE_DETAIL.sub(" ", text).split():
        word = word.strip(WORD_EDGES)
        if word and EXACT_VALUE.search(word) and not ORDINAL.fullmatch(word):
            found.append(word)
    return found


def detail_key(detail: str) -> str:
    """How a detail is compared: case and digit grouping aside ("$4,000" is "$4000"), a code
    span by its text."""
    return DIGIT_GROUPING.sub("", detail.strip("`").lower())


def usable_tokens(cap_tokens: int) -> int:
    """The part of the cap a summary is judged by: the last tenth is a summarizer's margin."""
    return int(cap_tokens * (1 - CAP_SLACK))


class SummaryText:
    """A new summary, as the checks look things up in it."""

    def __init__(
        self, summary: str, cap_tokens: int | None = None, user_lines: Collection[str] = ()
    ) -> None:
        self.key = detail_key(" ".join(summary.split()))
        self.words = content_words(summary)
        self.free: int | None = None
        self.ranked: list[tuple[int, int]] = []  # (rank, tokens) of each of its lines
        if cap_tokens is not None:
            self.free = usable_tokens(cap_tokens) - count_tokens(summary)
            self.ranked = [
                (rank(line.text, user_lines), count_tokens(f"- {line.text}\n"))
                for line in summary_lines(summary)
            ]

    def room(self, worth: int) -> int | None:
        """Free tokens below the cap's usable part, plus what the lines that would give way to
        a line worth ``worth`` take (retention.yields_to): small talk kept at the cap was
        room a value could have had, and a line that only carries a value room for a rule."""
        if self.free is None:
            return None
        floor = yields_to(worth)
        return self.free + sum(tokens for worth_of, tokens in self.ranked if worth_of > floor)

    def has(self, detail: str) -> bool:
        """Whether the summary states ``detail`` as a value of its own: "8,502" is not kept by
        "T-8502", nor "4821" by "14821"."""
        key = re.escape(detail_key(detail))
        return re.search(rf"(?<![\w-]){key}(?![\w])", self.key) is not None

    def has_room_for(self, line: str, worth: int = VALUE) -> bool:
        """Whether ``line`` as one more bullet fits under the cap, with a token or two to spare
        for where it would go: when in doubt, no room, and no refusal."""
        room = self.room(worth)
        return room is None or count_tokens(f"- {line}\n") + ROOM_MARGIN <= room


def line_loss(
    line: str, kept: SummaryText, *, any_line: bool = False, words_kept: float = RULE_WORDS_KEPT
) -> Loss | None:
    """``any_line``: a line without values is checked by its words even if it states no rule
    (a person wrote it, or a folded message said it). ``words_kept``: the share of its subject
    words the summary must state (STATEMENT_WORDS_KEPT for a folded message's statement). A
    withheld message's marker is checked by its seq: its words are the same for every message."""
    marker = WITHHELD_MARKER.search(line)
    if marker:
        return None if kept.has(marker.group(0)) else Loss(line, (marker.group(0),))
    values = details_of(line)
    if values:
        missing = tuple(dict.fromkeys(value for value in values if not kept.has(value)))
        return Loss(line, missing) if missing else None
    if not any_line and not is_standing(line):
        return None
    words = subject_words(line)
    if not words or len(words & kept.words) >= len(words) * words_kept:
        return None
    return Loss(line, ())


def superseded(line: str, folded: Sequence[Said], *, written: bool = False) -> bool:
    """A folded message takes the line back: it names one of the line's values or shares a
    subject word with it, and says so ("forget", "no longer", "instead", "cancel"); or it
    states the line's subject anew: more than half of the line's subject words, with a value
    the line does not have ("New door code: 7730"). Loose for the summarizer's own lines, since
    the loss report still lists what a missed loss drops. ``written``: a person wrote the line,
    and one shared word is not enough ("Actually, remove the kitchen photos" does not revoke
    "Budget for the kitchen is 4000 EUR"): the message must name its value or restate most of
    its subject. A withheld message's marker is never taken back: the message stays withheld."""
    if WITHHELD_MARKER.search(line):
        return False
    subject = subject_words(line)
    values = {detail_key(value) for value in details_of(line)}
    for message in folded:
        named, words, takes_back = message_facts(message.content)
        shared = subject & words
        restated = len(shared) > len(subject) * SAME_SUBJECT
        about = (values & named or restated) if written else (shared or values & named)
        if about and takes_back:
            return True
        if restated and named - values:
            return True
    return False


@lru_cache(maxsize=4096)
def message_facts(text: str) -> tuple[frozenset[str], frozenset[str], bool]:
    """A folded message's details (compared as detail_key), subject words, and whether it takes
    something back: read once per message, though every line of a fold is checked against
    every later message, and a guard checks a fold's summary more than once."""
    named = frozenset(detail_key(value) for value in details_of(text))
    takes_back = bool(REVOKES.search(text) or CHANGE_MARKERS.search(text))
    return named, frozenset(subject_words(text)), takes_back


def subject_words(text: str) -> set[str]:
    return content_words(text) - RULE_WORDS
