"""What the fake model answers: chat replies, summaries with their habits (padding, ignored
repairs), answer faults and output-limit modes."""

from __future__ import annotations

import json
import re
from collections.abc import Iterable
from dataclasses import dataclass, replace
from typing import Any

from tests.support.fake_openai.wire import (
    ARTIFACT_PATTERN,
    END_NEW_TURNS_MARKER,
    END_SUMMARY_MARKER,
    FILLER_WORDS,
    GOAL_WORDS,
    NEW_TURNS_MARKER,
    REFUSAL_TEXT,
    SUMMARY_HEADINGS,
    SUMMARY_MARKER,
    WORDS_PER_STREAM_CHUNK,
    approx_tokens,
    is_fold_input,
    last_user_text,
    request_texts,
)

# --------------------------------------------------------------------------------------------
# Deterministic replies
# --------------------------------------------------------------------------------------------


def chat_reply_text(number: int, body: dict[str, Any], reply_words: int | None) -> str:
    text = f"fake reply #{number} to: {last_user_text(body)[:60]}"
    words = text.split()
    if reply_words is None or len(words) >= reply_words:
        return text
    # Benchmarks need long assistant messages; pad with filler up to exactly reply_words words.
    filler = [FILLER_WORDS[i % len(FILLER_WORDS)] for i in range(reply_words - len(words))]
    return " ".join([*words, *filler])


def section_lines(lines: list[str], start: str, end: str) -> list[str]:
    """The lines between a line that is exactly ``start`` and the next that is exactly ``end``:
    a marker counts at the start of a line, as a model reads it."""
    if start not in lines:
        return []
    begin = lines.index(start) + 1
    finish = lines.index(end, begin) if end in lines[begin:] else len(lines)
    return lines[begin:finish]


def read_fold_input(source: str) -> tuple[str, list[tuple[str, str]]]:
    """A summarize request's existing summary ("" for NONE) and its new messages as (role,
    content): the summary is one JSON string, each message a "Role: <JSON string>" line among
    "Turn n:" lines."""
    lines = source.splitlines()
    existing = "\n".join(section_lines(lines, SUMMARY_MARKER, END_SUMMARY_MARKER)).strip()
    summary = "" if existing in ("", "NONE") else str(json.loads(existing))
    messages = []
    for line in section_lines(lines, NEW_TURNS_MARKER, END_NEW_TURNS_MARKER):
        role, separator, text = line.partition(": ")
        if separator and text.startswith('"'):
            messages.append((role.lower(), str(json.loads(text))))
    return summary, messages


def transcript(messages: Iterable[tuple[str, str]]) -> str:
    """The new messages as "User: …" / "Assistant: …" lines, one per message."""
    return "\n".join(
        f"{role.capitalize()}: {' '.join(content.split())}" for role, content in messages
    )


def existing_bullets(summary: str) -> list[tuple[str, str]]:
    """(heading, bullet) pairs of a previous summary; free text lands under the first heading."""
    if summary.strip().upper() in ("", "NONE"):
        return []
    heading = SUMMARY_HEADINGS[0]
    bullets = []
    for raw_line in summary.splitlines():
        line = raw_line.strip()
        if line.startswith("## ") and line[3:].strip() in SUMMARY_HEADINGS:
            heading = line[3:].strip()
        elif line and line not in ("- (none)", "(none)"):
            bullets.append((heading, line.removeprefix("- ").strip()))
    return bullets


def turn_bullets(messages: Iterable[tuple[str, str]]) -> list[tuple[str, str]]:
    """(heading, bullet) pairs from the first words of each user and assistant message."""
    bullets = []
    for role, content in messages:
        speaker, text = role.capitalize(), " ".join(content.split())
        if speaker not in ("User", "Assistant") or not text:
            continue
        bullets.append((turn_heading(speaker, text), f"{speaker}: {' '.join(text.split()[:12])}"))
        bullets.extend(("Key Artifacts", artifact) for artifact in ARTIFACT_PATTERN.findall(text))
    return bullets


def turn_heading(speaker: str, text: str) -> str:
    if speaker == "Assistant":
        return "Decisions"
    if text.rstrip().endswith("?"):
        return "Open Items"
    if any(word in text.lower().split() for word in GOAL_WORDS):
        return "Goals / Preferences"
    return "Facts / Constraints"


def render_summary(bullets: list[tuple[str, str]]) -> str:
    parts = []
    for heading in SUMMARY_HEADINGS:
        lines = [f"- {text}" for section, text in bullets if section == heading] or ["- (none)"]
        parts.append("\n".join([f"## {heading}", *lines]))
    return "\n\n".join(parts)


# A summarizer's bad habits (``summary_habits``), as real models have them: "pads" keeps the
# newest facts in half the room it is given and fills the rest with prose toward its cap;
# "ignores-repairs" answers a follow-up naming lines to keep exactly as it answered the draft.
SUMMARY_HABITS = ("pads", "ignores-repairs")
PADDING = (
    "The conversation went on in a friendly and relaxed way.",
    "Both sides stayed polite and the exchange felt productive overall.",
    "The user seemed satisfied with the answers so far.",
    "Several topics came up briefly before moving on to other things.",
    "The assistant explained its reasoning in plain language.",
    "There was some general discussion about how things usually go.",
)
CAP_IN_INSTRUCTIONS = re.compile(r"within (\d+) tokens")


def summary_text(body: dict[str, Any], cap_words: int, habits: Iterable[str] = ()) -> str:
    """A valid seed-000/003 summary: old bullets kept, new ones added, oldest dropped over cap.
    A follow-up naming lines to keep (the fold guard's repair) keeps those and drops others,
    unless it ``habits`` to ignore it (SUMMARY_HABITS)."""
    habits = frozenset(habits)
    texts = request_texts(body)
    source = next(text for text in reversed(texts) if is_fold_input(text))
    existing, messages = read_fold_input(source)
    follow_up = texts[-1] if texts[-1] != source else ""
    if "ignores-repairs" in habits:
        follow_up = ""
    if "pads" in habits:
        cap_words //= 2
    keep = {line[2:].strip().lower() for line in follow_up.splitlines() if line.startswith("- ")}
    bullets, seen = [], set()
    for heading, text in existing_bullets(existing) + turn_bullets(messages):
        if text.lower() not in seen:
            seen.add(text.lower())
            bullets.append((heading, text))
    rendered = render_summary(bullets)
    droppable = [bullet for bullet in bullets if bullet[1].lower() not in keep]
    while droppable and len(rendered.split()) > cap_words:
        bullets.remove(droppable.pop(0))  # the oldest go first, like a real rewrite under a cap
        rendered = render_summary(bullets)
    if "pads" in habits:
        replaced = len(existing) + sum(len(content) for _, content in messages)
        rendered = padded(rendered, texts, replaced)
    return rendered


def padded(summary: str, texts: list[str], replaced_chars: int) -> str:
    """``summary`` with prose bullets (no rule, no value) at the end of its first section, up to
    about 95 % of the cap its instructions name (four characters a token), and no longer than
    what it replaces (a summary longer than its input is refused as no summary)."""
    found = CAP_IN_INSTRUCTIONS.search(texts[0]) if texts else None
    cap_tokens = int(found.group(1)) if found else 500
    limit = min(int(cap_tokens * 0.95) * 4, replaced_chars)
    head, _, rest = summary.partition("\n\n")
    head = head.replace("\n- (none)", "")
    for number in range(200):
        line = f"- {PADDING[number % len(PADDING)]}"
        if len(head) + len(line) + 1 + len(rest) + 2 > limit:
            break
        head += "\n" + line
    return f"{head}\n\n{rest}" if rest else head


@dataclass(frozen=True)
class Reply:
    """What the fake model answers, before it is put in a wire format."""

    text: str | None
    finish_reason: str = "stop"
    refusal: str | None = None
    tool_call: tuple[str, str] | None = None  # (call id, function name)


def apply_answer_fault(reply: Reply, fault: str | None) -> Reply:
    if fault == "truncated":
        text = reply.text or ""
        return replace(reply, text=text[: len(text) // 2], finish_reason="length")
    if fault == "empty":
        return Reply(text="")
    if fault == "refusal":
        return Reply(text=None, refusal=REFUSAL_TEXT)
    return reply


def split_for_stream(text: str) -> list[str]:
    """Word-group chunks whose concatenation is exactly ``text``."""
    words = re.findall(r"\s*\S+\s*", text) or ([text] if text else [])
    return [
        "".join(words[i : i + WORDS_PER_STREAM_CHUNK])
        for i in range(0, len(words), WORDS_PER_STREAM_CHUNK)
    ]


# --------------------------------------------------------------------------------------------
# Output limits: a server that honours one limit field only
# --------------------------------------------------------------------------------------------

# ``limit_mode``: "local" honours only ``max_tokens`` and ignores ``max_completion_tokens``, as
# llama.cpp's server and Ollama do; "openai" honours only ``max_completion_tokens`` and, as
# OpenAI's API does, refuses a request that sets both. In either mode every text reply runs on
# (filler words, a looping small model) to ``runaway_tokens`` unless the honoured field stops
# it first, with finish_reason "length". Tokens are the fake's own (``approx_tokens``).
LIMIT_MODES: dict[str, tuple[str, ...]] = {
    "local": ("max_tokens",),
    "openai": ("max_completion_tokens",),
}
RUNAWAY_TOKENS = 3000
BOTH_LIMITS_MESSAGE = (
    "Setting 'max_tokens' and 'max_completion_tokens' at the same time is not supported (fake)."
)


def honoured_limit(body: dict[str, Any], mode: str) -> int | None:
    limits = [body[key] for key in LIMIT_MODES[mode] if isinstance(body.get(key), int)]
    return min(limits) if limits else None


def refuses_both_limits(body: dict[str, Any], mode: str | None) -> bool:
    return mode == "openai" and all(
        body.get(key) is not None for key in ("max_tokens", "max_completion_tokens")
    )


def apply_limit_mode(
    reply: Reply, body: dict[str, Any], mode: str | None, runaway_tokens: int
) -> Reply:
    if mode is None or reply.text is None or reply.tool_call:
        return reply
    words = reply.text.split(" ")
    filler = 0
    while approx_tokens(" ".join(words)) < runaway_tokens:
        words.append(FILLER_WORDS[filler % len(FILLER_WORDS)])
        filler += 1
    text = " ".join(words)
    limit = honoured_limit(body, mode)
    if limit is not None and approx_tokens(text) > limit:
        return replace(reply, text=text[: limit * 4].rstrip(), finish_reason="length")
    return replace(reply, text=text)
