"""What a summary must not lose (docs/policies.md, "What the summary keeps first"): the rules and
exact values the offline summarizer keeps last, the fold guard checks and the loss report lists.
One definition for all three. Standard library only."""

import re
from collections.abc import Collection, Iterator
from dataclasses import dataclass

# A constraint or safety rule.
KEEP_RULES = re.compile(
    r"\b(must|mustn't|never|always|don't|do not|cannot|can't|shall not|forbidden|prohibited|"
    r"not allowed|required?|requires|limit|budget|deadline|at most|at least|no more than|"
    r"no later than|avoid|confidential|secret|password)\b",
    re.IGNORECASE,
)
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


# The placeholder of a message the summarizer refused (memory_worker.fold_isolation): the only
# sign in the context that the message is not in memory, so it is kept like a rule whatever its
# seq (a two-digit one is no exact value).
WITHHELD_MARKER = re.compile(r"\bmessages? \d+(?:-\d+)? withheld\b", re.IGNORECASE)


def is_rule_or_value(text: str) -> bool:
    return bool(KEEP_RULES.search(text) or EXACT_VALUE.search(text) or WITHHELD_MARKER.search(text))


# What a line is worth when the cap makes lines compete, most first.
WRITTEN_OR_MARKER, RULE, VALUE, WEAK = range(4)


def rank(text: str, user_lines: Collection[str] = ()) -> int:
    """A line a person wrote or a withheld message's marker; a rule (with or without a value);
    a line that only carries an exact value; a line that states neither."""
    if text in user_lines or WITHHELD_MARKER.search(text):
        return WRITTEN_OR_MARKER
    if KEEP_RULES.search(text):
        return RULE
    return VALUE if is_rule_or_value(text) else WEAK


def yields_to(worth: int) -> int:
    """The rank above which a line gives way, under the cap, to one worth ``worth``: lines
    that state nothing for a value; lines that only carry a value for a rule or a person's
    line. A rule never gives way to another line."""
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
