"""The offline summarizer: deterministic and extractive, no network (the embedded default and
the tests). Plain Python (no Django)."""

import itertools
import re
from collections.abc import Iterator, Sequence
from dataclasses import dataclass

from conversations.chat_model.offline_backend import OFFLINE_MODEL_MARKER
from conversations.chat_model.tokens import count_tokens
from memory_worker.engine.presets import MIN_SUMMARY_TOKEN_CAP
from memory_worker.summaries.contract import (
    ARTIFACTS,
    DECISIONS,
    DEFAULT_CAP_TOKENS,
    FACTS,
    GOALS,
    HEADINGS,
    OPEN_ITEMS,
    FoldMessage,
    SummaryResult,
    format_fold_input,
)
from memory_worker.summaries.retention import (
    CHANGE_MARKERS,
    FILE_NAME,
    content_words,
    grouped,
    is_fact,
    is_rule_or_value,
    is_standing,
    line_sentences,
    normalise,
    summary_lines,
)

# A sentence goes to the first category whose rule matches, else to Facts / Constraints.
# Decisions and open items come first: "we decided the budget is 5k" is a decision, and a
# question is open even when it mentions a file.
CATEGORY_RULES: tuple[tuple[str, re.Pattern[str]], ...] = (
    (
        DECISIONS,
        re.compile(
            r"\b(decided|decide|let's|let us|we will|we'll|agreed|agree|chose|chosen|"
            r"going with|settled on)\b",
            re.IGNORECASE,
        ),
    ),
    (
        OPEN_ITEMS,
        re.compile(r"\?|\b(todo|to-do|next|pending|will you|follow up|remind)\b", re.IGNORECASE),
    ),
    (
        FACTS,
        re.compile(
            r"\b(must|never|always|constraint|limit|budget|cannot|can't|deadline|required?)\b",
            re.IGNORECASE,
        ),
    ),
    (
        GOALS,
        re.compile(
            r"\b(want|wants|prefer|prefers|like|likes|goal|goals|plan to|planning to|aim to)\b",
            re.IGNORECASE,
        ),
    ),
    (
        ARTIFACTS,
        re.compile(
            r"https?://\S+|"  # URLs
            + FILE_NAME
            + r'|"[^"]{2,}"|`[^`]+`'  # quoted names, code spans
            r"|\b(?=[\w-]*[A-Za-z])(?=[\w-]*\d)[\w-]{2,}\b",  # names with digits: v2, ABC-123
            re.IGNORECASE,
        ),
    ),
)
FILLER = frozenset(
    {
        "hi",
        "hello",
        "hey",
        "thanks",
        "thank you",
        "ok",
        "okay",
        "sure",
        "great",
        "cool",
        "yes",
        "no",
        "yep",
        "nope",
        "got it",
        "sounds good",
        "perfect",
        "nice",
        "you're welcome",
        "understood",
        "noted",
        "of course",
        "absolutely",
        "alright",
        "all right",
    }
)
# A sentence made only of acknowledgements ("Acknowledged.", "ok, thanks", "— recorded.",
# "Continuing with the plan."): never worth a line of memory.
ACKNOWLEDGEMENT = re.compile(
    r"^(?:(?:acknowledged|recorded|noted|understood|will do|done|sure thing|on it|got it|"
    r"okay|ok|thanks|thank you|sounds good|perfect|great|all set|makes sense|continuing"
    r"(?: with the plan)?)(?: |$))+$"
)
# What the cap keeps first (docs/policies.md, "What the summary keeps first"), most first:
# standing items (rules, preferences, where the work stands, decisions: what governs later
# answers), facts stated with their value, details (values in passing, open items, artifacts),
# other statements, and an assistant's sentence that is none of these (explanation, chatter).
# Within a weight, the oldest goes first.
STANDING, FACT_VALUE, DETAIL, STATEMENT, CHATTER = 4, 3, 2, 1, 0
MUST_KEEP = 5  # a line the fold guard's repair names: never dropped for another
PRIORITY_CATEGORIES = frozenset({DECISIONS, OPEN_ITEMS, GOALS, ARTIFACTS})
# An assistant's acknowledgement that repeats what it acknowledges ("Noted: never deploy on a
# Friday."): the user's own message carries the statement.
ECHO = re.compile(
    r"^(?:noted|got it|understood|acknowledged|copy that|recorded)\s*[:\u2014\u2013-]\s*\S",
    re.IGNORECASE,
)
# Words that identify one of our headings in a summary, also when a model varied the wording.
HEADING_WORDS = {
    "facts": FACTS,
    "constraints": FACTS,
    "goals": GOALS,
    "preferences": GOALS,
    "decisions": DECISIONS,
    "open": OPEN_ITEMS,
    "pending": OPEN_ITEMS,
    "artifacts": ARTIFACTS,
    "references": ARTIFACTS,
}
MAX_BULLET_CHARS = 300  # a sentence
MAX_ITEM_CHARS = 2 * MAX_BULLET_CHARS  # sentences kept together (statements_of)


@dataclass(frozen=True)
class Bullet:
    category: str
    text: str
    weight: int = STATEMENT  # what the cap keeps first: STANDING ... CHATTER


class OfflineSummarizer:
    """Deterministic extractive summaries, no network (the embedded default and the tests).

    Sentences of the existing summary and of the new messages are sorted under the five
    headings by keyword rules, deduplicated (a repeat counts as new), a decision that says it
    changes something replaces older decisions sharing a word with it, and when the rendered
    summary is over the cap the least important bullets go first (``weight_of``), the oldest
    first among equals. Same input, same output.
    """

    name = "offline"
    takes_pins = True  # summarizers.PinAwareSummarizer

    def __init__(self, cap_tokens: int = DEFAULT_CAP_TOKENS) -> None:
        if cap_tokens < MIN_SUMMARY_TOKEN_CAP:
            raise ValueError(f"cap_tokens must be at least {MIN_SUMMARY_TOKEN_CAP}")
        self.cap_tokens = cap_tokens

    def summarize(
        self, current_summary: str, messages: Sequence[FoldMessage], pinned: Sequence[str] = ()
    ) -> SummaryResult:
        return self._summarize(current_summary, messages, frozenset(), pinned)

    def repair(
        self,
        current_summary: str,
        messages: Sequence[FoldMessage],
        draft: str,
        keep: Sequence[str],
        pinned: Sequence[str] = (),
    ) -> SummaryResult:
        """The fold guard's repair: the same rewrite with the ``keep`` lines of
        ``current_summary`` dropped last. Deterministic, so the draft adds nothing."""
        return self._summarize(current_summary, messages, frozenset(map(normalise, keep)), pinned)

    def _summarize(
        self,
        current_summary: str,
        messages: Sequence[FoldMessage],
        keep: frozenset[str],
        pinned: Sequence[str] = (),
    ) -> SummaryResult:
        answered = answered_questions(messages)
        candidates = [
            *oldest_first(list(bullets_from_summary(current_summary, keep))),
            *(
                bullet
                for index, message in enumerate(messages)
                if not is_offline_echo(message)
                for bullet in bullets_from_text(
                    message.content, message.role, answered=index in answered
                )
            ),
        ]
        bullets = drop_superseded_decisions(deduplicate(candidates))
        text = fit_to_cap(bullets, self.cap_tokens)
        # Pinned items are in every context already: the input counts them, the summary need
        # not carry them.
        fold_input = format_fold_input(current_summary, messages, pinned)
        return SummaryResult(text, count_tokens(fold_input), count_tokens(text), self.name)


# The offline chat model's replies only echo the user's message, which is folded already, so they
# carry nothing worth remembering.


def is_offline_echo(message: FoldMessage) -> bool:
    return message.role == "assistant" and message.content.startswith(OFFLINE_MODEL_MARKER)


def bullets_from_summary(summary: str, keep: frozenset[str] = frozenset()) -> Iterator[Bullet]:
    """Bullets under one of our headings keep their category, so repeated folds are stable;
    any other text is classified like message text. A line whose normalised text is in
    ``keep`` (a repair's must-keep lines) is kept whole and dropped last."""
    for line in summary_lines(summary):
        category = category_for_heading(line.heading) if line.heading else None
        if normalise(line.text) in keep:
            yield Bullet(category or categorize(line.text), line.text, MUST_KEEP)
        elif category is not None:
            text = clip(line.text, MAX_ITEM_CHARS)
            yield Bullet(category, text, weight_of(category, text, "summary"))
        else:
            yield from bullets_from_text(line.text, "summary")


def oldest_first(bullets: Sequence[Bullet]) -> list[Bullet]:
    """A summary's bullets in the order they were most likely said: each section lists its own
    oldest first, so the first of every section come before the second of any. In heading
    order, the first section would all count as older than everything under later headings."""
    by_section: dict[str, list[Bullet]] = {}
    for bullet in bullets:
        by_section.setdefault(bullet.category, []).append(bullet)
    rows = itertools.zip_longest(*by_section.values())
    return [bullet for row in rows for bullet in row if bullet is not None]


def category_for_heading(title: str) -> str | None:
    for word in normalise(title).split():
        if word in HEADING_WORDS:
            return HEADING_WORDS[word]
    return None


def answered_questions(messages: Sequence[FoldMessage]) -> set[int]:
    """The indexes of the user messages an assistant message follows in this fold: their
    questions were answered, so they are no open items."""
    answered: set[int] = set()
    replied = False
    for index in range(len(messages) - 1, -1, -1):
        if messages[index].role == "assistant":
            replied = True
        elif messages[index].role == "user" and replied:
            answered.add(index)
    return answered


def bullets_from_text(text: str, role: str, *, answered: bool = False) -> Iterator[Bullet]:
    """``answered``: the message's questions were answered in the same fold, and are left out."""
    for statement in statements_of(text, role):
        if answered and statement.rstrip().endswith("?"):
            continue
        if role == "assistant" and ECHO.match(statement):
            continue
        category = categorize(statement)
        yield Bullet(category, statement, weight_of(category, statement, role))


def statements_of(text: str, role: str) -> Iterator[str]:
    """The text's sentences, with those of one line that belong together as one item: a rule
    and the rule or exception after it ("Deploys need two approvals. Never deploy on a
    Friday."), a statement and the status after it ("Phase 2 of 4 is done.")
    (retention.grouped). Under the cap an item goes whole or not at all, never half of a
    rule. An assistant's sentences stay apart: they are advice or echoes, not the user's rules."""
    for line in text.splitlines():
        sentences = list(sentences_of(line))
        yield from sentences if role == "assistant" else grouped(sentences)


def weight_of(category: str, text: str, role: str) -> int:
    """What the cap keeps first. ``role``: the message's, or "summary" for a bullet of the
    previous summary (kept once already, so never chatter). An assistant's rule or decision
    is advice or an echo: the user's own words are what stand."""
    if role == "assistant":
        if is_rule_or_value(text) or category == DECISIONS:
            return DETAIL
        return CHATTER
    if is_standing(text) or category == DECISIONS:
        return STANDING
    if is_fact(text):
        return FACT_VALUE
    if is_rule_or_value(text) or category in PRIORITY_CATEGORIES:
        return DETAIL
    return STATEMENT


def sentences_of(text: str) -> Iterator[str]:
    for line in text.splitlines():
        if line.strip().startswith("```"):
            continue
        for sentence in line_sentences(line):
            if is_substantive(sentence):
                yield clip(sentence)


def is_substantive(sentence: str) -> bool:
    words = normalise(sentence)
    if len(words.replace(" ", "")) < 3 or words in FILLER:
        return False
    return not ACKNOWLEDGEMENT.match(words)


def categorize(sentence: str) -> str:
    for category, rule in CATEGORY_RULES:
        if rule.search(sentence):
            return category
    return FACTS


def clip(text: str, limit: int = MAX_BULLET_CHARS) -> str:
    if len(text) <= limit:
        return text
    return text[: limit - 1].rsplit(" ", 1)[0] + "…"


def same_statement_key(text: str) -> str:
    """Two wordings of one statement share it: the same words in any order ("Never deploy on
    Fridays." and "On Fridays, never deploy!"); "room 101" is not "room 102", nor "allowed"
    "not allowed"."""
    return " ".join(sorted(set(normalise(text).split())))


def deduplicate(bullets: Sequence[Bullet]) -> list[Bullet]:
    """One bullet per statement (same_statement_key), at the position of its latest occurrence:
    a repeated statement is recent, so it is among the last to be dropped for the cap."""
    latest: dict[str, Bullet] = {}
    for bullet in bullets:
        key = same_statement_key(bullet.text)
        earlier = latest.pop(key, None)  # re-inserting moves it to the end (insertion order)
        if earlier is not None and earlier.weight > bullet.weight:
            bullet = Bullet(bullet.category, bullet.text, earlier.weight)
        latest[key] = bullet
    return list(latest.values())


def drop_superseded_decisions(bullets: Sequence[Bullet]) -> list[Bullet]:
    """Latest explicit decision wins, kept simple: a decision that says it changes something
    ("instead", "switch", "no longer"...) removes earlier decisions sharing a content word,
    unless a repair named them."""
    kept: list[Bullet] = []
    for bullet in bullets:
        if bullet.category == DECISIONS and CHANGE_MARKERS.search(bullet.text):
            words = content_words(bullet.text)
            kept = [
                earlier
                for earlier in kept
                if earlier.category != DECISIONS
                or earlier.weight == MUST_KEEP
                or not words & content_words(earlier.text)
            ]
        kept.append(bullet)
    return kept


def render(bullets: Sequence[Bullet]) -> str:
    sections = []
    for heading in HEADINGS:
        lines = [f"- {bullet.text}" for bullet in bullets if bullet.category == heading]
        sections.append("\n".join([heading, *(lines or ["- None"])]))
    return "\n\n".join(sections)


def fit_to_cap(bullets: Sequence[Bullet], cap_tokens: int) -> str:
    """Render, dropping bullets until it fits: the lightest first, the oldest first among equals
    (``bullets`` is in the order things were said). Binary search over how many to drop: each
    probe is one render and one count, instead of one per dropped bullet. A dropped rule or
    value that still fits afterwards goes back in (``refill``)."""
    if fits(bullets, cap_tokens):
        return render(bullets)
    drop_order = sorted(range(len(bullets)), key=lambda index: (bullets[index].weight, index))

    def without(count: int) -> list[Bullet]:
        dropped = set(drop_order[:count])
        return [bullet for index, bullet in enumerate(bullets) if index not in dropped]

    low, high = 1, len(bullets)  # dropping `high` (all) always fits; find the fewest that do
    while low < high:
        middle = (low + high) // 2
        if fits(without(middle), cap_tokens):
            high = middle
        else:
            low = middle + 1
    if low < len(bullets):
        return render(refill(bullets, drop_order[:low], cap_tokens))
    # Not even the weightiest, newest bullet fits whole: keep as much of it as fits, never an
    # empty memory.
    return render([shrink_to_fit(bullets[drop_order[-1]], cap_tokens)])


def refill(bullets: Sequence[Bullet], dropped: Sequence[int], cap_tokens: int) -> list[Bullet]:
    """The bullets without ``dropped`` (indexes), then each dropped rule or value that fits in
    the room left, the weightiest and newest first: a shorter rule dropped before a longer one
    must not be lost with room to spare (the fold guard would refuse that summary)."""
    left_out = set(dropped)
    for index in reversed(dropped):
        if bullets[index].weight < DETAIL:
            break
        left_out.discard(index)
        if not fits([b for i, b in enumerate(bullets) if i not in left_out], cap_tokens):
            left_out.add(index)
    return [bullet for index, bullet in enumerate(bullets) if index not in left_out]


def fits(bullets: Sequence[Bullet], cap_tokens: int) -> bool:
    return count_tokens(render(bullets)) <= cap_tokens


def shrink_to_fit(bullet: Bullet, cap_tokens: int) -> Bullet:
    words = bullet.text.split()
    low, high = 0, len(words)  # the most words that still fit
    while low < high:
        middle = (low + high + 1) // 2
        if fits([Bullet(bullet.category, " ".join(words[:middle]) + "…")], cap_tokens):
            low = middle
        else:
            high = middle - 1
    return Bullet(bullet.category, " ".join(words[:low]) + "…")
