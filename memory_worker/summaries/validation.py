"""Whether a summarizer's output may be written: not empty, cut off, refused, over the cap, a
reply in place of a summary, a transcript or an echo of its input, or longer than what it
replaces. Plain Python (no Django)."""

import re
import unicodedata
from collections.abc import Sequence

from conversations.chat_model.text import storable
from conversations.chat_model.tokens import count_tokens
from memory_worker.engine.state import ROLE_OVERHEAD_TOKENS
from memory_worker.summaries.contract import HEADINGS, FoldMessage, SummarizerError

# A heading line in any markup: "## Decisions", "## 1. Facts", "**Open Items**", "Decisions:"
# (a short line ending in a colon).
ANY_HEADING_LINE = re.compile(
    r"^[ \t]*(?:#{1,6}[ \t]+\S.*|\*\*[^*\n]+\*\*:?|(?:\S+[ \t]+){0,5}\S+:)[ \t]*$",
    re.MULTILINE,
)
# chatmem's five headings (summarizers.HEADINGS) by their words, so that markup, numbering,
# case, accents and either half of a two-part name ("# Facts and constraints") still count.
HEADING_WORDS = (
    ("facts", "constraints"),
    ("goals", "preferences"),
    ("decisions",),
    ("open items",),
    ("artifacts", "artefacts"),
)
MIN_HEADINGS = 2
# A transcript, not a summary: a turn header ("Turn 1:", "## Turn 2") or a role line ("User: …",
# "**Assistant:** …") at the start of a line. A bullet that names a role ("- User: prefers
# tea") is a summary's line.
TURN_HEADER = re.compile(
    r"^[ \t]*(?:#{1,6}[ \t]*|\*\*|\[)?turn[ \t]*#?\d+\b[ \t]*(?:\*\*|\])?[ \t]*(?:[:.)-]|$)",
    re.IGNORECASE | re.MULTILINE,
)
ROLE_LINE = re.compile(
    r"^[ \t]*(?:\*\*)?(?:user|assistant)(?:\*\*)?[ \t]*:", re.IGNORECASE | re.MULTILINE
)
# The input's own framing, echoed: a line that is one of its section markers (or a model's
# variant of them: "=== NAME ===", a lone "FULL_TURNS:"), or a message's data line. Within a
# bullet, a marker is a message's own text, quoted.
SECTION_LINE = re.compile(
    r"^[ \t]*(?:===[ \t]*[A-Z_]+[ \t]*===|[A-Z]+(?:_[A-Z]+)+[ \t]*:?)[ \t]*$"
    r"|^[ \t]*\{\s*\"turn\"\s*:",
    re.MULTILINE,
)
# What a summary of a short fold may spend beyond its input: the five headings with a "- None"
# each (a message's own role overhead is counted with the input).
HEADINGS_ROOM = count_tokens("\n\n".join(f"{heading}\n- None" for heading in HEADINGS))
# A refusal in plain words, from servers that fill no ``refusal`` field (vLLM, Ollama, most
# non-OpenAI models): only when the text has no heading at all.
REFUSAL_OPENING = re.compile(
    r"^\W*(i'?m sorry|i am sorry|sorry\b|i can'?t\b|i cannot\b|i can not\b|i'?m unable|"
    r"i am unable|i won'?t\b|i will not\b|as an ai\b|i apologi[sz]e|my apologies|"
    r"unfortunately\b|i'?m not able|i am not able|i'?m afraid)",
    re.IGNORECASE,
)


def headings_found(summary: str) -> list[str]:
    return [match.strip() for match in ANY_HEADING_LINE.findall(summary)]


def chatmem_headings(summary: str) -> set[int]:
    """Which of the five headings (their index in summarizers.HEADINGS) the summary has."""
    found: set[int] = set()
    for line in headings_found(summary):
        words = plain(line)
        found.update(
            index
            for index, names in enumerate(HEADING_WORDS)
            if any(re.search(rf"\b{name}\b", words) for name in names)
        )
    return found


def plain(text: str) -> str:
    """Lower case without accents or markup: "## Décisions" is "decisions"."""
    decomposed = unicodedata.normalize("NFKD", text.casefold())
    letters = "".join(c for c in decomposed if not unicodedata.combining(c))
    return " ".join(re.sub(r"[^\w]+", " ", letters).split())


def replaced_tokens(
    current_summary: str, messages: Sequence[FoldMessage], model: str | None
) -> int:
    """What a fold's summary replaces, as a context counts it: the old summary and each folded
    message with its role overhead."""
    return count_tokens(current_summary.strip(), model) + sum(
        count_tokens(message.content, model) + ROLE_OVERHEAD_TOKENS for message in messages
    )


def clip_text(text: str, limit: int = 120) -> str:
    flat = " ".join(text.split())
    return flat if len(flat) <= limit else flat[: limit - 1] + "…"


def validate_summary(
    text: str | None,
    finish_reason: str | None,
    cap_tokens: int,
    model: str | None,
    *,
    refusal: str | None = None,
    headings: bool = False,
    replaces: int | None = None,
) -> str:
    """The stripped summary, or a non-transient SummarizerError when it must not be written.

    ``headings``: the model was asked for the five headings (our instructions; a hosted prompt
    is the operator's): fewer than MIN_HEADINGS of them is not a summary but a reply (a refusal
    in plain words, a question, a chat answer), and writing it would lose every message it was
    meant to keep. ``replaces``: the tokens of what the summary replaces (``replaced_tokens``);
    a summary longer than that, beyond the headings' own room, is not a summary of it."""
    if refusal or finish_reason == "content_filter":
        raise SummarizerError("refused", "summarizer refused to summarize (refusal/content filter)")
    if finish_reason == "length":
        raise SummarizerError("truncated", "summarizer output was cut off by the token limit")
    summary = storable(text or "").strip()
    if not summary:
        raise SummarizerError("empty", "summarizer returned an empty summary")
    # Before the cap: a transcript shortened on request is still a transcript.
    check_not_transcript(summary)
    tokens = count_tokens(summary, model)
    if tokens > cap_tokens:
        raise SummarizerError(
            "over_cap", f"summary is {tokens} tokens, over the cap of {cap_tokens}"
        )
    found = headings_found(summary)
    if not found and REFUSAL_OPENING.match(summary):
        raise SummarizerError("refused", f"summarizer refused in its text: {clip_text(summary)}")
    if not found and summary.endswith("?"):
        # "Could you clarify which part to summarize?": a reply to the summarizer's input, and
        # written as the summary it would replace every fact the old one kept.
        raise SummarizerError(
            "malformed", f"summarizer asked a question instead: {clip_text(summary)}"
        )
    if headings:
        ours = len(chatmem_headings(summary))
        if ours < MIN_HEADINGS:
            raise SummarizerError(
                "malformed",
                f"summarizer output has {ours} of the five headings (at least {MIN_HEADINGS} "
                f"needed): not a summary: {clip_text(summary)}",
            )
    if replaces is not None and tokens > replaces + HEADINGS_ROOM:
        raise SummarizerError(
            "malformed",
            f"summary is {tokens} tokens, longer than the {replaces} tokens of summary and "
            f"messages it replaces (and {HEADINGS_ROOM} for the headings)",
        )
    return summary


def check_not_transcript(summary: str) -> None:
    """A transcript of the input, or an echo of it, is a malformed summary: it keeps the
    dialogue the instructions say to drop, and the next fold would summarize it again."""
    for pattern, what in (
        (TURN_HEADER, "a turn header"),
        (ROLE_LINE, "a role line"),
        (SECTION_LINE, "the input's section markers"),
    ):
        match = pattern.search(summary)
        if match:
            raise SummarizerError(
                "malformed",
                f"summarizer output is a transcript or an echo of its input ({what}: "
                f"{clip_text(match.group(0).strip(), 40)}): {clip_text(summary)}",
            )
