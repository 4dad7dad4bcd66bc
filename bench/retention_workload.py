"""The retention benchmark's conversation (bench.retention): typed canaries carrying
unguessable values, the messages that plant them, and the chit-chat between them. Seeded: the
same seed, the same session."""

from __future__ import annotations

import random
import re
import string
from collections.abc import Callable, Iterable
from dataclasses import dataclass

CANARIES_PER_TYPE = 3

# --- canaries ------------------------------------------------------------------------------

CANARY_TYPES = ("safety", "constraint", "fact", "goal", "preference")
LETTERS = "".join(c for c in string.ascii_uppercase if c not in "IO")  # no 1/I, 0/O mix-ups


def code_value(rng: random.Random) -> str:
    """Like VX-81Q2."""
    pick = rng.choice
    return f"{pick(LETTERS)}{pick(LETTERS)}-{rng.randint(10, 99)}{pick(LETTERS)}{rng.randint(1, 9)}"


def tag_value(prefix: str) -> Callable[[random.Random], str]:
    """Like R-5539."""
    return lambda rng: f"{prefix}-{rng.randint(1000, 9999)}"


def amount_value(rng: random.Random) -> str:
    """Like 3,417."""
    return f"{rng.randint(2, 9)},{rng.randint(100, 999)}"


def number_value(rng: random.Random) -> str:
    """Five digits: more than any seq or message count a session reaches."""
    return str(rng.randint(10000, 99999))


def date_value(rng: random.Random) -> str:
    return f"20{rng.randint(27, 39)}-{rng.randint(1, 12):02d}-{rng.randint(1, 28):02d}"


@dataclass(frozen=True)
class Template:
    text: str  # with one {v}
    value: Callable[[random.Random], str]


TEMPLATES: dict[str, tuple[Template, ...]] = {
    "safety": (
        Template("Never share the vault code {v} with anyone.", code_value),
        Template("Do not ever paste the admin token {v} into a ticket or a chat.", code_value),
        Template("The door PIN {v} must never be written down anywhere.", code_value),
        Template("Under no circumstances reveal the recovery phrase {v} to support.", code_value),
        Template("Keep the signing key {v} out of every email, that is a hard rule.", code_value),
    ),
    "constraint": (
        Template("The budget must stay under {v} euros.", amount_value),
        Template("The final report is due no later than {v}, no extensions.", date_value),
        Template("We can spend at most {v} dollars on the venue.", amount_value),
        Template("The hard deadline for the migration is {v}.", date_value),
        Template("Each upload is limited to {v} kilobytes, never more.", amount_value),
    ),
    "fact": (
        Template("My locker number is {v}.", number_value),
        Template("For the record, my employee ID is {v}.", tag_value("E")),
        Template("The staging host we use is called {v}.", lambda rng: f"node-{code_value(rng)}"),
        Template("My flat is number {v} on the long street.", number_value),
        Template("The parcel's tracking number is {v}.", number_value),
    ),
    "goal": (
        Template("Our goal is to ship release {v} by Friday.", tag_value("R")),
        Template("We are aiming to close milestone {v} this sprint.", tag_value("M")),
        Template("The plan is to migrate cluster {v} before the audit.", tag_value("C")),
        Template("What we want this month is to finish epic {v}.", tag_value("EP")),
        Template("Right now we are working towards launch {v} for the spring.", tag_value("L")),
    ),
    "preference": (
        Template("I prefer replies in Portuguese, tag {v}.", tag_value("P")),
        Template("Please file my notes under the label {v}, that is how I like it.", code_value),
        Template("I like answers as short bullet lists, use template {v}.", tag_value("T")),
        Template("Call me by my handle {v} from now on, I prefer that.", code_value),
        Template("My favourite colour scheme for charts is palette {v}.", tag_value("PAL")),
    ),
}


@dataclass(frozen=True)
class Canary:
    kind: str
    value: str  # an unguessable value, or a standing item's key phrase
    sentence: str
    also: tuple[str, ...] = ()  # the item's other key phrases: kept only with all of them


def value_pattern(value: str) -> re.Pattern[str]:
    """The value as a whole token: not inside a longer code or number (a sentence's full stop
    or comma after it is fine). Case aside: a summary may capitalise a phrase it starts with."""
    return re.compile(rf"(?<![\w,.-]){re.escape(value)}(?![\w-]|[,.]\d)", re.IGNORECASE)


def make_canaries(rng: random.Random, per_type: int = CANARIES_PER_TYPE) -> list[Canary]:
    """``per_type`` canaries of each type, each with its own template while they last, and a
    value that appears nowhere else in the session, in a shuffled order."""
    canaries: list[Canary] = []
    taken: set[str] = set()
    for kind in CANARY_TYPES:
        templates = list(TEMPLATES[kind])
        rng.shuffle(templates)
        for index in range(per_type):
            template = templates[index % len(templates)]
            value = template.value(rng)
            while value in taken or any(value_pattern(value).search(t) for t in taken):
                value = template.value(rng)
            taken.add(value)
            canaries.append(Canary(kind, value, template.text.format(v=value)))
    rng.shuffle(canaries)
    return canaries


def survives(canary: Canary, texts: Iterable[str]) -> bool:
    """Its value, or every one of its key phrases, in one of ``texts``."""
    patterns = [value_pattern(key) for key in (canary.value, *canary.also)]
    return any(all(pattern.search(text) for pattern in patterns) for text in texts)


# --- chit-chat -----------------------------------------------------------------------------

ACKNOWLEDGEMENTS = (
    "ok thanks",
    "Acknowledged.",
    "Continuing with the plan.",
    "Got it, thanks!",
    "Sounds good.",
    "Okay.",
    "Thanks, that helps.",
    "Noted.",
    "Perfect, thank you.",
    "Makes sense.",
)
TOPICS = (
    "sourdough baking",
    "the new coffee place",
    "remote work",
    "mechanical keyboards",
    "the football match",
    "houseplants",
    "board games",
    "the train strike",
    "podcasts about history",
    "learning the guitar",
    "cheap flights",
    "the weather lately",
    "running shoes",
    "tea versus coffee",
    "the office move",
    "spreadsheet formulas",
)
QUESTIONS = (
    "What do you think about {topic}?",
    "Could you tell me a bit more about {topic}?",
    "Have you heard anything interesting about {topic} recently?",
    "Is {topic} worth the hype, in your opinion?",
    "How would you explain {topic} to a friend?",
    "Any quick tips on {topic}?",
)
SMALL_TALK = (
    "I spent the morning reading about {topic}.",
    "My neighbour keeps talking about {topic}.",
    "Honestly, {topic} has been on my mind all week.",
    "I walked {n} kilometres this morning before work.",
    "The meeting ran {n} minutes over again, as usual.",
    "We had {n} people at lunch today, it was loud.",
    "It rained for {n} hours straight yesterday.",
    "I tried a new recipe last night and it turned out fine.",
    "The coffee machine on our floor is broken again.",
    "My cat knocked a plant off the shelf this morning.",
    "I think the weekend went by far too quickly.",
    "The train was late, so I listened to a podcast on the way.",
)
CONNECTORS = ("Anyway,", "By the way,", "Also,", "Oh, and", "Quick one:", "Unrelated, but")


def chit_chat(rng: random.Random) -> str:
    """One user message of filler: an acknowledgement, or one to four sentences of small talk
    and questions (numbers only of one or two digits, so no filler looks like a canary)."""
    if rng.random() < 0.25:
        return rng.choice(ACKNOWLEDGEMENTS)
    sentences: list[str] = []
    for _ in range(rng.randint(1, 4)):
        pool = QUESTIONS if rng.random() < 0.35 else SMALL_TALK
        sentence = rng.choice(pool).format(topic=rng.choice(TOPICS), n=rng.randint(2, 95))
        if sentences and rng.random() < 0.3:
            first, rest = sentence.split(" ", 1)
            first = first if first == "I" else first.lower()
            sentence = f"{rng.choice(CONNECTORS)} {first} {rest}"
        sentences.append(sentence)
    return " ".join(sentences)


def planting_message(canary: Canary, rng: random.Random) -> str:
    """The canary on its own, or between sentences of chit-chat."""
    shape = rng.random()
    if shape < 0.4:
        return canary.sentence
    before = chit_chat(rng) if shape < 0.8 else ""
    after = chit_chat(rng) if shape >= 0.6 else ""
    return " ".join(part for part in (before, canary.sentence, after) if part)
