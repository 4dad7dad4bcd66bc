"""What a summary must not lose (docs/policies.md, "What the summary keeps first"): the rules and
exact values the offline summarizer keeps last, the fold guard checks and the loss report lists.
One definition for all three. Standard library only."""

import re
from collections.abc import Collection, Iterable, Iterator
from dataclasses import dataclass

# A constraint or safety rule.
KEEP_RULES = re.compile(
    r"\b(must|mustn't|never(?! mind)|always|don't|do not|cannot|can't|shall not|forbidden|"
    r"prohibited|"
    r"not allowed|required?|requires|limit|budget|deadline|at most|at least|no more than|"
    r"no later than|avoid|confidential|secret|password)\b"
    r"|(?<![Ii] )\bneeds?\b",  # "Deploys need two approvals", not "I need a break"
    re.IGNORECASE,
)
# Imperatives that state a standing rule without the words above: "Quote all prices in euros.",
# "Only PostgreSQL 15.", "No tracking cookies on the public site.", "If a user seems
# distressed, pause and offer help." Read after a lead-in ("Also,", "Please") is taken off. An
# imperative that asks for one thing ("Explain recursion.", "Write a function") is a request,
# not a rule: a task verb stands only with a word that makes it hold from now on.
STANDING_VERBS = "address avoid call keep mask quote redact round spell stay stick"
TASK_VERBS = (
    "add answer ask attach cite cc check confirm convert copy credit encrypt escalate explain "
    "express file format give include label list log mark mention name notify offer pause "
    "put read refer remind reply report respond run say send show sign state store summarise "
    "summarize tag tell translate treat use verify wait warn write"
)
_STANDING = "|".join(STANDING_VERBS.split())
_ANY_VERB = "|".join([*STANDING_VERBS.split(), *TASK_VERBS.split()])
# What makes an imperative hold beyond this turn.
SCOPE = re.compile(
    r"\b(?:all|every|each|any|always|whenever|throughout|by default|from now on|going forward|"
    r"in future|at all times)\b",
    re.IGNORECASE,
)
IMPERATIVE_RULE = re.compile(
    rf"^(?:always\s+|from now on,?\s+|going forward,?\s+)?(?:{_STANDING})\b"
    r"|^only\b(?!\s+\d)|\bonly[.!]?$|,\s*please[.!]?$"
    r"|^no\s+(?!problem|worries|idea|thanks|way\b|rush|pressure|big deal)\w"
    rf"|^(?:if|when|whenever|unless|before|after)\b[^,]{{2,}},\s*(?:then\s+|please\s+)?"
    rf"(?:always\s+)?(?:{_ANY_VERB}|don't|do not|never)\b",
    re.IGNORECASE,
)
TASK_IMPERATIVE = re.compile(rf"^(?:{_ANY_VERB})\b", re.IGNORECASE)
# A stated preference: how the user wants to be answered or addressed.
PREFERENCE = re.compile(
    r"\b(?:i|we)(?:'d like|\s+(?:really\s+|much\s+)?(?:prefer|want|would like|like my|like answers|"
    r"like replies|like it when|hate it when|dislike))\b|\bfrom now on\b|\bgoing forward\b"
    r"|\b(?:the user|user|they|she|he)\s+(?:wants|prefers|likes|would like)\b"
    r"|^(?:prefers|wants|likes|dislikes)\b",  # a summary's note: "Prefers short answers."
    re.IGNORECASE,
)
# Where the work stands: the goal, the plan, the step reached.
GOAL_STATE = re.compile(
    r"\b(?:our goal|the goal|my goal|we are aiming|we're aiming|aim to|the plan is|our plan|"
    r"working towards|milestone|next step|(?:phase|step|stage|part) \d+ of \d+)\b",
    re.IGNORECASE,
)
# Words a statement opens with when it is said in passing, not as the statement itself.
LEAD_IN = re.compile(
    r"^(?:(?:also|and|oh,? and|plus|please|anyway|by the way|quick one|one more thing|"
    r"important|note|reminder|remember)[,:]?\s+)+",
    re.IGNORECASE,
)


def bare(sentence: str) -> str:
    """The sentence without its lead-ins."""
    return LEAD_IN.sub("", sentence.strip())


def is_rule(text: str) -> bool:
    """A constraint or safety rule: rule words, or an imperative that holds beyond this turn
    (never a question)."""
    if text.rstrip().endswith("?"):
        return False
    plain = bare(text)
    if KEEP_RULES.search(text) or IMPERATIVE_RULE.search(plain):
        return True
    return bool(TASK_IMPERATIVE.search(plain) and SCOPE.search(plain))


def is_standing(text: str) -> bool:
    """What governs later answers: a rule, a stated preference, or where the work stands."""
    if text.rstrip().endswith("?"):
        return False
    return is_rule(text) or bool(PREFERENCE.search(text) or GOAL_STATE.search(text))


# A sentence that goes on from the one before: an exception or a second clause of a rule.
CONTINUATION = re.compile(
    r"^(?:except|unless|but|however|otherwise|and|also|then|even|this|that|it|they|so)\b",
    re.IGNORECASE,
)
# How far a task has come: it belongs with the sentence that names the task.
STATUS = re.compile(r"^(?:phase|step|stage|part|milestone)\s+\d+(?:\s+of\s+\d+)?\b", re.IGNORECASE)
SENTENCE_BREAK = re.compile(r"(?<=[.!?])\s+")


# One item holds at most this many sentences: a rule and its exception or second clause, a
# task and its status. A paragraph of rules stays a paragraph of items.
MAX_STATEMENT_SENTENCES = 3


def belongs_with(first: str, sentence: str) -> bool:
    """Whether ``sentence`` goes on from an item that opened with ``first`` (its first
    sentence): a status after its task, a rule or an exception after a rule. A question is
    never part of another statement: it is answered or open on its own."""
    if sentence.rstrip().endswith("?"):
        return False
    if STATUS.match(bare(sentence)):
        return True
    return is_rule(first) and (is_rule(sentence) or bool(CONTINUATION.match(sentence)))


def grouped(sentences: Iterable[str]) -> Iterator[str]:
    """The sentences of one line, those that belong together joined (belongs_with), each item
    at most MAX_STATEMENT_SENTENCES long."""
    item: list[str] = []
    for sentence in sentences:
        if item and len(item) < MAX_STATEMENT_SENTENCES and belongs_with(item[0], sentence):
            item.append(sentence)
            continue
        if item:
            yield " ".join(item)
        item = [sentence]
    if item:
        yield " ".join(item)


def line_sentences(line: str) -> list[str]:
    """One line's sentences, its bullet or number markup gone."""
    parts = (part.strip() for part in SENTENCE_BREAK.split(LINE_MARKUP.sub("", line)))
    return [part for part in parts if part]


def statements(text: str) -> Iterator[str]:
    """A message's statements: its sentences, those of one line that belong together as one."""
    for line in text.splitlines():
        yield from grouped(line_sentences(line))


# An exact value: a number of three digits or more, a formatted one (3,417; 12:30; 2032-01-01),
# a code (VX-81Q2, R5539, v2), a URL, an e-mail address, a code span. Not any digit: small talk
# ("we were 12 at lunch") must not outrank a rule.
EXACT_VALUE = re.compile(r"\d{3,}|\d[,.:/-]\d|[A-Za-z]-?\d|\d[A-Za-z]|https?://|\S@\S|`[^`]+`")
# A file name: a name, not a number, though it holds no digit.
FILE_NAME = r"\b[\w-]+\.(?:py|js|ts|md|txt|json|csv|pdf|ya?ml|toml|html|sql|docx?|xlsx?)\b"
# A statement that says it changes or takes back something said before.
CHANGE_MARKERS = re.compile(
    r"\b(instead|actually|changed?|switch(?:ed)?|no longer|rather than|anymore|replace[sd]?)\b",
    re.IGNORECASE,
)
# Words too common (or too much about deciding itself) to say two statements share a subject.
STOPWORD_TEXT = (
    "that this with from have will would should could into about their there them they then "
    "than what when which your also just some more most very been were does done make made "
    "instead actually change changed switch switched longer rather anymore replace replaced "
    "decided decide agreed agree chose chosen going settled let's"
)
STOPWORDS = frozenset(STOPWORD_TEXT.split())


def normalise(text: str) -> str:
    return " ".join(re.findall(r"[a-z0-9']+", text.lower()))


def content_words(text: str) -> set[str]:
    return {word for word in normalise(text).split() if len(word) >= 4 and word not in STOPWORDS}


# The placeholder of a message the summarizer refused (memory_worker.folding.isolation): the only
# sign in the context that the message is not in memory, so it is kept like a rule whatever its
# seq (a two-digit one is no exact value).
WITHHELD_MARKER = re.compile(r"\bmessages? \d+(?:-\d+)? withheld\b", re.IGNORECASE)


def is_rule_or_value(text: str) -> bool:
    return bool(
        KEEP_RULES.search(text)
        or is_standing(text)
        or EXACT_VALUE.search(text)
        or WITHHELD_MARKER.search(text)
    )


# A value stated as what something is ("My locker number is 48211", "The staging host is
# called node-7"): a fact that stands, where a value in passing ("the import took 41 minutes")
# is an incidental detail.
DEFINING = re.compile(
    r"\b(?:is|are)\s+(?:called\s+|named\s+|number\s+|now\s+)?(?=[^\s]*(?:\d|[A-Z]-))",
)


def is_fact(text: str) -> bool:
    return bool(
        EXACT_VALUE.search(text) and (DEFINING.search(text) or "for the record" in text.lower())
    )


# What a line is worth when the cap makes lines compete, most first.
WRITTEN_OR_MARKER, RULE, FACT, VALUE, WEAK = range(5)


def rank(text: str, user_lines: Collection[str] = ()) -> int:
    """A line a person wrote or a withheld message's marker; a standing item (a rule, a
    preference, where the work stands; with or without a value); a fact stated with its value;
    a line that only carries an exact value in passing; a line that states neither."""
    if text in user_lines or WITHHELD_MARKER.search(text):
        return WRITTEN_OR_MARKER
    # An open question about a rule ("Does legal require a sign-off?") is guarded like one.
    if is_standing(text) or KEEP_RULES.search(text):
        return RULE
    if is_fact(text):
        return FACT
    return VALUE if is_rule_or_value(text) else WEAK


def yields_to(worth: int) -> int:
    """The rank above which a line gives way, under the cap, to one worth ``worth``: lines
    that state nothing for a value; values in passing for a fact; facts and values for a
    standing item or a person's line. A standing item never gives way to another line."""
    return max(worth, RULE)


# A summary's line: a heading ("## Decisions"), or an item with its bullet or number markup.
HEADING_LINE = re.compile(r"^\s*#{1,6}\s*(?P<title>.+?)\s*$")
LINE_MARKUP = re.compile(r"^\s*(?:[-*+>#]+|\d+[.)])\s*")


@dataclass(frozen=True)
class SummaryLine:
    heading: str | None  # the title of the heading above it; None before the first
    text: str  # without its markup


def summary_lines(summary: str) -> Iterator[SummaryLine]:
    """The items of a summary, each with its heading; "None" placeholders left out."""
    heading: str | None = None
    for line in summary.splitlines():
        title = HEADING_LINE.match(line)
        if title:
            heading = title.group("title")
            continue
        text = LINE_MARKUP.sub("", line).strip()
        if text and text.rstrip(".").lower() != "none":
            yield SummaryLine(heading, text)
