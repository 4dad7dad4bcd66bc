"""The daily tier: a flush hook that extracts durable facts from messages about to be folded into
one note per chat and day.

It runs as its own task after the fold has committed (memory_worker.hooks), so neither the fold
nor a turn waits for it. Extraction is offline and deterministic by default
(``MEMORY_DAILY_NOTES_BACKEND=offline``) or one Chat Completions call (``chat``)."""

from __future__ import annotations

import logging
import re
from collections import defaultdict
from collections.abc import Iterable, Sequence
from dataclasses import dataclass
from datetime import date

from django.conf import settings
from django.db import transaction
from django.utils import timezone

from conversations.chat_model.transport import (
    create_chat_completion,
    make_openai_client,
    token_limit,
    token_limit_field,
)
from conversations.models import DailyNote, Message
from memory_worker.summaries.contract import FACTS, FoldMessage
from memory_worker.summaries.offline import CATEGORY_RULES, is_offline_echo, sentences_of

log = logging.getLogger("chatmem.daily_notes")

HOOK_PATH = "memory_worker.daily_notes.extract_daily_notes"
MAX_FACTS_PER_NOTE = 200
MAX_FACT_CHARS = 300
# The extraction's output limit: a fold range's facts fit in it, and a small local model that
# loops stops here instead of at the deadline.
EXTRACTION_OUTPUT_TOKENS = 1024

# Sentences worth keeping for days: they carry a number or a name-like token, a commitment or a
# preference, or fall under one of the summary's non-fact headings (goals, decisions, open
# items, artifacts). Questions and chit-chat are not facts.
DURABLE_WORDS = re.compile(
    r"\b(must|always|never|prefer\w*|decid\w*|agreed|deadline|due|owner|owned|remember|"
    r"important|budget|password|port|rotat\w*|named|called|lives?|works?|uses?|requires?)\b",
    re.IGNORECASE,
)
HAS_NUMBER = re.compile(r"\d")
EXTRACTION_INSTRUCTIONS = (
    "Extract the durable facts from these chat messages: facts, constraints, preferences, "
    "decisions, commitments, names, numbers and identifiers worth remembering for days. One fact "
    'per line, each line starting with "- ". No commentary. If there is none, answer "- None".'
)


@dataclass(frozen=True)
class Fact:
    seq: int
    role: str
    text: str


def extract_daily_notes(chat_id: int, messages: Sequence[Message], version: int) -> None:
    """The flush hook: ``messages`` are the folded rows of one fold, in seq order."""
    if not messages:
        return
    fold_range = [messages[0].seq, messages[-1].seq]
    by_day: dict[date, list[Message]] = defaultdict(list)
    for message in messages:
        by_day[timezone.localdate(message.created_at)].append(message)
    extractor = settings.MEMORY_DAILY_NOTES_BACKEND
    for day, day_messages in sorted(by_day.items()):
        facts = extract_facts(day_messages, extractor)
        added = merge_into_note(chat_id, day, fold_range, facts, extractor)
        log.info(
            "daily note updated",
            extra={
                "event": "daily_note",
                "chat_id": chat_id,
                "day": day.isoformat(),
                "from_seq": fold_range[0],
                "to_seq": fold_range[1],
                "facts_added": added,
                "version": version,
            },
        )


def extract_facts(messages: Sequence[Message], extractor: str) -> list[Fact]:
    if extractor == "chat":
        return extract_with_model(messages)
    return list(extract_offline(messages))


def extract_offline(messages: Iterable[Message]) -> Iterable[Fact]:
    for message in messages:
        if not says_something_durable(message):
            continue
        for sentence in sentences_of(message.content):
            if is_durable(sentence):
                yield Fact(message.seq, message.role, sentence[:MAX_FACT_CHARS])


def says_something_durable(message: Message) -> bool:
    """Not tool output (every line with an id or a count would pass for a fact, and fill the
    note) and not the offline model's echo of its context, as the summarizer skips it too."""
    if message.role == "tool":
        return False
    return not is_offline_echo(FoldMessage(message.seq, message.role, message.content))


def is_durable(sentence: str) -> bool:
    if sentence.rstrip().endswith("?"):
        return False
    if HAS_NUMBER.search(sentence) or DURABLE_WORDS.search(sentence):
        return True
    return any(category != FACTS and rule.search(sentence) for category, rule in CATEGORY_RULES)


def extract_with_model(messages: Sequence[Message]) -> list[Fact]:
    """One call for the whole range; facts are attributed to the range's last message."""
    client = make_openai_client(
        base_url=settings.OPENAI_BASE_URL,
        api_key=settings.OPENAI_API_KEY,
        timeout=settings.MEMORY_LLM_TIMEOUT_SECONDS,
        max_retries=0,
    )
    transcript = "\n".join(f"{m.role.capitalize()}: {m.content}" for m in messages)
    response = create_chat_completion(
        client,
        {
            "model": settings.MEMORY_SUMMARIZER_MODEL,
            "messages": [
                {"role": "system", "content": EXTRACTION_INSTRUCTIONS},
                {"role": "user", "content": transcript},
            ],
            **token_limit(
                token_limit_field(settings.OPENAI_TOKEN_LIMIT_FIELD, settings.OPENAI_BASE_URL),
                EXTRACTION_OUTPUT_TOKENS,
            ),
        },
        settings.MEMORY_LLM_TIMEOUT_SECONDS,
    )
    text = response.choices[0].message.content or ""
    last = messages[-1]
    lines = (line.strip().removeprefix("- ").strip() for line in text.splitlines())
    return [
        Fact(last.seq, "extracted", line[:MAX_FACT_CHARS])
        for line in lines
        if line and line.lower() not in ("none", "none.")
    ]


def merge_into_note(
    chat_id: int, day: date, fold_range: list[int], facts: Sequence[Fact], extractor: str
) -> int:
    """Add the facts of one fold range to the day's note, at most once per range. The row lock
    serialises hook tasks of the same chat and day (parallel workers, redelivered tasks)."""
    with transaction.atomic():
        note, _ = DailyNote.objects.select_for_update().get_or_create(chat_id=chat_id, day=day)
        if fold_range in note.ranges:
            return 0
        known = {normalise(fact["text"]) for fact in note.facts}
        added = dropped = 0
        for fact in facts:
            key = normalise(fact.text)
            if key in known:
                continue
            if len(note.facts) >= MAX_FACTS_PER_NOTE:
                dropped += 1
                continue
            known.add(key)
            note.facts.append({"seq": fact.seq, "role": fact.role, "text": fact.text})
            added += 1
        if dropped:
            log.warning(
                "daily note full: facts dropped",
                extra={
                    "event": "daily_note_full",
                    "chat_id": chat_id,
                    "day": day.isoformat(),
                    "facts_dropped": dropped,
                    "max_facts": MAX_FACTS_PER_NOTE,
                },
            )
        note.ranges.append(fold_range)
        note.extractor = extractor
        note.save(update_fields=["facts", "ranges", "extractor", "updated_at"])
    return added


def normalise(text: str) -> str:
    return " ".join(re.findall(r"\w+", text.lower()))
