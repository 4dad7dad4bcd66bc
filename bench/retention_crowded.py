"""The retention benchmark's crowded sessions (``bench.retention --sessions crowded``): more
standing items than a summary keeps beside everything else worth keeping. Four of each type:
safety rules, hard constraints and preferences said as people say them (imperatives and
conditionals without "never" or "must", a rule over two sentences, "only …", "no …"), goal
state (a task and the phase it reached, the goal, the next step), and facts stated with their
value; between them, and through every round after, incidental details that carry values
(durations, counts, hosts, tickets, file names) and chit-chat with questions that get answered.
Standing items carry no unguessable value, so each is found by its key phrases (every one of
them, in one text: a rule kept in half is lost). Seeded: the same seed, the same session."""

from __future__ import annotations

import random
from collections.abc import Callable, Sequence
from dataclasses import dataclass

from bench.retention_workload import TEMPLATES, Canary, chit_chat, code_value, value_pattern

PER_TYPE = 4
# In the rounds after the planting, this share of the user's messages carries a detail in
# passing (the rest is chit-chat): the incidental values keep coming, as a conversation's do.
DETAIL_SHARE = 0.5

Slots = dict[str, Sequence[str]]


@dataclass(frozen=True)
class Phrased:
    """A standing item's text and its key phrases, with ``{slot}``s filled from ``slots``."""

    text: str
    keys: tuple[str, ...]
    slots: Slots


STANDING: dict[str, tuple[Phrased, ...]] = {
    "safety": (
        Phrased(
            "If a user seems {state}, pause and offer {offer}.",
            ("seems {state}, pause",),
            {
                "state": ("distressed", "confused", "panicked", "overwhelmed"),
                "offer": ("help", "a break", "the hotline number"),
            },
        ),
        Phrased(
            "Mask any {secret} before you share a screen.",
            ("{secret} before you share a screen",),
            {"secret": ("card number", "password", "date of birth", "security answer")},
        ),
        Phrased(
            "Keep {data} out of the {place}.",
            ("{data} out of the {place}",),
            {
                "data": ("patient names", "salary figures", "home addresses", "customer emails"),
                "place": ("logs", "screenshots", "shared drive", "tickets"),
            },
        ),
        Phrased(
            "Escalate any {event} to the {team} team at once.",
            ("{event} to the {team} team",),
            {
                "event": ("data breach", "outage", "fraud report", "legal threat"),
                "team": ("security", "on-call", "compliance", "legal"),
            },
        ),
    ),
    "constraint": (
        Phrased(
            "Quote all prices in {currency}.",
            ("prices in {currency}",),
            {"currency": ("euros", "yen", "Swiss francs", "Danish kroner", "Mexican pesos")},
        ),
        Phrased(
            "Only {db} for the {component}.",
            ("{db} for the {component}",),
            {
                "db": ("PostgreSQL", "SQLite", "MySQL", "Redis"),
                "component": ("ledger", "cache layer", "audit trail", "job queue"),
            },
        ),
        Phrased(
            "No {thing} on the {site}.",
            ("{thing} on the {site}",),
            {
                "thing": ("tracking cookies", "third-party fonts", "autoplay video"),
                "site": ("public site", "checkout page", "help centre", "landing page"),
            },
        ),
        Phrased(
            "Deploys need {count} approvals. Never deploy on a {day}.",
            ("{count} approvals", "deploy on a {day}"),
            {"count": ("two", "three"), "day": ("Friday", "Monday", "Sunday", "holiday")},
        ),
        Phrased(
            "Report all {quantity} in {unit}.",
            ("{quantity} in {unit}",),
            {
                "quantity": ("distances", "weights", "temperatures", "durations"),
                "unit": ("kilometres", "kilograms", "Celsius", "minutes"),
            },
        ),
    ),
    "preference": (
        Phrased(
            "I want answers as {format}, no {other}.",
            ("answers as {format}",),
            {
                "format": ("bullet points", "short paragraphs", "numbered steps"),
                "other": ("tables", "emoji", "jargon"),
            },
        ),
        Phrased(
            "From now on, address me as {title}.",
            ("address me as {title}",),
            {"title": ("Doctor", "Captain", "Professor", "Coach")},
        ),
        Phrased(
            "I prefer {tone} replies without {extra}.",
            ("{tone} replies without {extra}",),
            {
                "tone": ("formal", "casual", "terse", "detailed"),
                "extra": ("small talk", "disclaimers", "apologies"),
            },
        ),
        Phrased(
            "Going forward, write code samples in {language}.",
            ("code samples in {language}",),
            {"language": ("Rust", "Go", "Kotlin", "Elixir", "Haskell")},
        ),
    ),
    "goal": (
        Phrased(
            "Our task is the {project} migration. Phase {done} of {phases} is done.",
            ("{project} migration", "Phase {done} of {phases}"),
            {
                "project": ("billing", "payroll", "inventory", "search"),
                "done": ("2", "3"),
                "phases": ("4", "5"),
            },
        ),
        Phrased(
            "Our goal is to {goal} before the {when}.",
            ("{goal} before the {when}",),
            {
                "goal": ("retire the old API", "cut cloud costs", "pass the audit"),
                "when": ("board meeting", "summer break", "year end"),
            },
        ),
        Phrased(
            "The next step is to {step}.",
            ("next step is to {step}",),
            {
                "step": (
                    "write the rollback plan",
                    "freeze the schema",
                    "brief the support team",
                    "load-test the queue",
                )
            },
        ),
        Phrased(
            "We are working towards {target}.",
            ("working towards {target}",),
            {"target": ("zero-downtime deploys", "weekly releases", "single sign-on")},
        ),
    ),
}

# Details in passing: values that matter when asked for, not standing items or facts.
DETAILS: tuple[tuple[str, Callable[[random.Random], dict[str, str]]], ...] = (
    (
        "The nightly import took {n} seconds on {day}.",
        lambda rng: {
            "n": str(rng.randint(100, 999)),
            "day": rng.choice(("Monday", "Tuesday", "Thursday")),
        },
    ),
    (
        "Build {code} finished in {n} seconds.",
        lambda rng: {"code": code_value(rng), "n": str(rng.randint(100, 999))},
    ),
    (
        "The dashboard showed {n} errors at {hour}:{minute}.",
        lambda rng: {
            "n": str(rng.randint(100, 999)),
            "hour": str(rng.randint(10, 23)),
            "minute": f"{rng.randint(0, 59):02d}",
        },
    ),
    (
        "Someone uploaded report_{n}.pdf to the shared drive.",
        lambda rng: {"n": str(rng.randint(100, 9999))},
    ),
    ("Ticket {code} came up in the standup again.", lambda rng: {"code": code_value(rng)}),
    (
        "The disk on host h{n} filled up to {m} gigabytes yesterday.",
        lambda rng: {"n": str(rng.randint(100, 999)), "m": str(rng.randint(100, 999))},
    ),
    (
        "We processed {a},{b} rows in the last batch.",
        lambda rng: {"a": str(rng.randint(2, 99)), "b": str(rng.randint(100, 999))},
    ),
)


def fill(phrased: Phrased, rng: random.Random, taken: set[str]) -> tuple[str, tuple[str, ...]]:
    """The text and keys with slots drawn so no key repeats one already in the session."""
    for _ in range(200):
        choice = {slot: rng.choice(values) for slot, values in phrased.slots.items()}
        keys = tuple(key.format(**choice) for key in phrased.keys)
        if not any(key.lower() in taken for key in keys):
            taken.update(key.lower() for key in keys)
            return phrased.text.format(**choice), keys
    raise ValueError(f"no unused slots left for {phrased.text!r}")


def make_crowded_canaries(rng: random.Random, per_type: int = PER_TYPE) -> list[Canary]:
    """``per_type`` standing items of each standing type (a template each while they last) and
    ``per_type`` facts with unguessable values (bench.retention_workload's), shuffled."""
    canaries: list[Canary] = []
    taken: set[str] = set()
    for kind, templates in STANDING.items():
        order = list(templates)
        rng.shuffle(order)
        for index in range(per_type):
            text, keys = fill(order[index % len(order)], rng, taken)
            canaries.append(Canary(kind, keys[0], text, keys[1:]))
    facts = list(TEMPLATES["fact"])
    rng.shuffle(facts)
    for index in range(per_type):
        template = facts[index % len(facts)]
        value = template.value(rng)
        while value.lower() in taken:
            value = template.value(rng)
        taken.add(value.lower())
        canaries.append(Canary("fact", value, template.text.format(v=value)))
    rng.shuffle(canaries)
    return canaries


def detail(rng: random.Random) -> str:
    template, values = rng.choice(DETAILS)
    return template.format(**values(rng))


def crowded_filler(rng: random.Random) -> str:
    """A user message of the rounds: a detail in passing (DETAIL_SHARE of them), else chit-chat."""
    return detail(rng) if rng.random() < DETAIL_SHARE else chit_chat(rng)


def planting_messages(canary: Canary, rng: random.Random) -> list[str]:
    """Chit-chat, a detail in passing, then the item itself, on its own or after a lead-in."""
    lead = rng.choice(("", "", "Also, ", "Oh, and ", "One more thing: "))
    sentence = canary.sentence
    if lead and not sentence.startswith("I "):
        sentence = sentence[0].lower() + sentence[1:]
    return [chit_chat(rng), detail(rng), lead + sentence]


__all__ = [
    "PER_TYPE",
    "crowded_filler",
    "make_crowded_canaries",
    "planting_messages",
    "value_pattern",
]
