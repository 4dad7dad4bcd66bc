"""Whether a summarizer's output may be written: not empty, cut off, refused, over the cap, or
a reply in place of a summary. Plain Python (no Django)."""

import re

from memory_worker.summarizers import SummarizerError
from memory_worker.text import storable
from memory_worker.tokens import count_tokens

# A heading line in any language or markup: "## Décisions", "## 1. Facts", "**Open Items**",
# "Decisions:" (a short line ending in a colon). The instructions ask for five; a summary
# translated, renumbered or with two merged still has several, a chat answer or a refusal none
# or one ("Here is what I found:").
ANY_HEADING_LINE = re.compile(
    r"^[ \t]*(?:#{1,6}[ \t]+\S.*|\*\*[^*\n]+\*\*:?|(?:\S+[ \t]+){0,5}\S+:)[ \t]*$",
    re.MULTILINE,
)
MIN_HEADINGS = 2
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
) -> str:
    """The stripped summary, or a non-transient SummarizerError when it must not be written.

    ``headings``: the model was asked for the five headings (our instructions; a hosted prompt
    is the operator's): fewer than MIN_HEADINGS heading lines is not a summary but a reply (a
    refusal in plain words, a question, a chat answer), and writing it would lose every message
    it was meant to keep."""
    if refusal or finish_reason == "content_filter":
        raise SummarizerError("refused", "summarizer refused to summarize (refusal/content filter)")
    if finish_reason == "length":
        raise SummarizerError("truncated", "summarizer output was cut off by the token limit")
    summary = storable(text or "").strip()
    if not summary:
        raise SummarizerError("empty", "summarizer returned an empty summary")
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
    if headings and len(found) < MIN_HEADINGS:
        raise SummarizerError(
            "malformed",
            f"summarizer output has {len(found)} heading line(s), not a summary under the five "
            f"headings (at least {MIN_HEADINGS} needed): {clip_text(summary)}",
        )
    return summary
