"""A scripted stand-in for a real model's summarizer, for the retention benchmark: it answers the
summarize requests chatmem sends (Chat Completions, through the fake OpenAI-compatible server)
by doing what the instructions ask, the way a careful model would read them:

- it rewrites EXISTING_SUMMARY merged with NEW_TURNS under the five headings, "- " bullets;
- it keeps only durable, action-guiding sentences: rules ("never", "must", limits, budgets,
  deadlines), goals, preferences and decisions, and sentences carrying an exact value (a number
  of three or more digits, a code, a URL or a file); small talk, questions without a value,
  acknowledgements and the assistant's replies stay out;
- within the cap the instructions state, it drops the least durable first (rules last), oldest
  first among equals, and counts tokens only approximately (four characters a token), so it can
  overshoot the cap and get chatmem's "shorten" request, which it then follows;
- ``forget_rate`` makes it lossy like real rewrites are: each bullet of the existing summary is
  left out of a rewrite with that probability (seeded by the request, so runs repeat). A
  follow-up request that is not a "shorten" one (a repair naming what went missing) is answered
  without forgetting, unless ``ignores_repairs``: then it is answered like the draft, as small
  local models often answer a correction;
- ``pads`` makes it fill its room as models do: the merged bullets are held to half the cap
  (so older ones go), and the rest is filled with prose that states no rule and no value.

It is deliberately not chatmem's offline summarizer: it shares no code with it, so the benchmark
measures what chatmem's pipeline (prompt, validation, cap, retries) does with a summarizer that
follows the prompt. It is no measure of any real model's judgement.
"""

from __future__ import annotations

import hashlib
import random
import re
from dataclasses import dataclass
from typing import Any

from tests.support.fake_openai import is_fold_input, read_fold_input, request_texts

HEADINGS = (
    "Facts / Constraints",
    "Goals / Preferences",
    "Decisions",
    "Open Items",
    "Key Artifacts",
)
CAP = re.compile(r"within (\d+) tokens")
SHORTEN = re.compile(r"in at most (\d+) tokens")
# Durability, highest first: what a careful reader of the instructions keeps longest.
RULE = re.compile(
    r"\b(never|must|do not|don't|under no circumstances|hard rule|at most|no later than|"
    r"deadline|budget|limit(ed)?|only|no extensions?)\b",
    re.IGNORECASE,
)
GOAL = re.compile(r"\b(goal|plan|aim(ing)?|want|working towards)\b", re.IGNORECASE)
PREFERENCE = re.compile(r"\b(prefer|like|favourite|favorite|call me)\b", re.IGNORECASE)
DECISION = re.compile(r"\b(decided|we will|we'll|agreed|going with)\b", re.IGNORECASE)
VALUE = re.compile(
    r"https?://\S+|\b[\w./-]+\.(py|md|json|yaml|yml|txt|csv)\b|\b\d[\d,.]{2,}\d\b|"
    r"\b(?=[A-Z0-9-]*\d)(?=[A-Z0-9-]*[A-Z])[A-Z0-9]+(-[A-Z0-9]+)+\b|\b\d{3,}\b"
)
ARTIFACT = re.compile(r"https?://\S+|\b[\w./-]+\.(py|md|json|yaml|yml|txt|csv)\b")
LEAD_INS = re.compile(
    r"^(anyway|by the way|also|oh, and|quick one:|unrelated, but|for the record|please|"
    r"honestly|so|well|right now)[,:]?\s+",
    re.IGNORECASE,
)
SENTENCE = re.compile(r"(?<=[.!?])\s+")


@dataclass(frozen=True)
class Bullet:
    heading: str
    text: str
    rank: int  # 3 rules, 2 goals, preferences and decisions, 1 other exact values


def rank_of(sentence: str) -> int:
    if RULE.search(sentence):
        return 3
    if GOAL.search(sentence) or PREFERENCE.search(sentence) or DECISION.search(sentence):
        return 2
    return 1 if VALUE.search(sentence) else 0


def heading_of(sentence: str, rank: int) -> str:
    if rank == 3:
        return "Facts / Constraints"
    if DECISION.search(sentence):
        return "Decisions"
    if GOAL.search(sentence) or PREFERENCE.search(sentence):
        return "Goals / Preferences"
    if sentence.endswith("?"):
        return "Open Items"
    if ARTIFACT.search(sentence):
        return "Key Artifacts"
    return "Facts / Constraints"


def rewritten(sentence: str) -> str:
    """The sentence as a note: lead-ins dropped, first letter capitalised; values untouched."""
    text = " ".join(sentence.split())
    while (shorter := LEAD_INS.sub("", text)) != text:
        text = shorter
    return text[:1].upper() + text[1:]


def new_bullets(messages: list[tuple[str, str]]) -> list[Bullet]:
    bullets = []
    for role, content in messages:
        if role != "user":  # no assistant reasoning, replies or tool chatter
            continue
        for sentence in SENTENCE.split(content.strip()):
            rank = rank_of(sentence)
            is_question = sentence.rstrip().endswith("?")
            if rank == 0 or (is_question and not VALUE.search(sentence)):
                continue
            bullets.append(Bullet(heading_of(sentence, rank), rewritten(sentence), rank))
    return bullets


def old_bullets(summary: str) -> list[Bullet]:
    heading, bullets = HEADINGS[0], []
    for raw in summary.splitlines():
        line = raw.strip()
        if line.startswith("## ") and line[3:].strip() in HEADINGS:
            heading = line[3:].strip()
        elif line.startswith("- ") and line[2:].strip().lower() != "none":
            text = line[2:].strip()
            bullets.append(Bullet(heading, text, max(rank_of(text), 1)))
    return bullets


def render(bullets: list[Bullet]) -> str:
    parts = []
    for heading in HEADINGS:
        lines = [f"- {b.text}" for b in bullets if b.heading == heading] or ["- None"]
        parts.append("\n".join([f"## {heading}", *lines]))
    return "\n".join(parts)


def approx_tokens(text: str) -> int:
    return len(text) // 4 + 1


def within(bullets: list[Bullet], cap: int) -> list[Bullet]:
    """Least durable first, oldest first among equals, until the rendering fits the cap."""
    kept = list(bullets)
    order = sorted(range(len(kept)), key=lambda i: (kept[i].rank, i))
    dropped: set[int] = set()
    for index in order:
        if approx_tokens(render([b for i, b in enumerate(kept) if i not in dropped])) <= cap:
            break
        dropped.add(index)
    return [b for i, b in enumerate(kept) if i not in dropped]


class ScriptedModel:
    """``summary_fn`` for tests.support.fake_openai.FakeOpenAI."""

    def __init__(
        self, forget_rate: float = 0.0, *, ignores_repairs: bool = False, pads: bool = False
    ) -> None:
        self.forget_rate = forget_rate
        self.ignores_repairs, self.pads = ignores_repairs, pads
        self.requests = 0
        self.forgotten = 0

    def __call__(self, body: dict[str, Any]) -> str:
        self.requests += 1
        texts = request_texts(body)
        source = next(text for text in reversed(texts) if is_fold_input(text))
        cap_match = CAP.search(texts[0]) if texts else None
        cap = int(cap_match.group(1)) if cap_match else 500
        follow_up = texts[-1] if not is_fold_input(texts[-1]) else ""
        shorten = SHORTEN.search(follow_up)
        if shorten:
            cap = int(shorten.group(1))
        if self.ignores_repairs and not shorten:
            follow_up = ""
        existing, messages = read_fold_input(source)
        old = old_bullets(existing)
        # A follow-up that is not a "shorten" request asks for what went missing: nothing is
        # forgotten then. A "shorten" one rewrites the same draft: the same forgetting.
        if self.forget_rate and not (follow_up and not shorten):
            rng = random.Random(hashlib.sha256(source.encode()).hexdigest())
            remembered = [b for b in old if rng.random() >= self.forget_rate]
            self.forgotten += len(old) - len(remembered)
            old = remembered
        merged: list[Bullet] = []
        seen: set[str] = set()
        for bullet in old + new_bullets(messages):
            key = bullet.text.lower().rstrip(".")
            if key not in seen:
                seen.add(key)
                merged.append(bullet)
        if not self.pads:
            return render(within(merged, cap))
        return padded(within(merged, cap // 2), cap, len(source))


PADDING = (
    "The conversation went on in a friendly and relaxed way.",
    "Both sides stayed polite and the exchange felt productive overall.",
    "Several topics came up briefly before moving on to other things.",
    "There was some general discussion about how things usually go.",
)


def padded(bullets: list[Bullet], cap: int, source_chars: int) -> str:
    """``bullets`` rendered with prose bullets in the first section, up to about 95 % of ``cap``
    and no longer than the fold's input (a summary longer than its input is refused)."""
    limit = min(int(cap * 0.95), source_chars // 4)
    filler = list(bullets)
    for number in range(200):
        line = Bullet(HEADINGS[0], PADDING[number % len(PADDING)], 0)
        if approx_tokens(render([*filler, line])) > limit:
            break
        filler.append(line)
    return render(filler)
