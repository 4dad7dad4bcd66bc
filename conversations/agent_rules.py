"""The agent state's Summarize step (docs/agent-state.md), as pure functions (no Django, no I/O):
the rules that turn one agent turn into the chat's agent state. The worker
(``memory_worker.agents.summaries``) loads the state, calls these, makes the LLM calls, and commits
the result.

docs/agent-state.md describes the behaviour against the seed; the constants below are its
vocabulary. An agent turn is the validated ``agent`` object of a turn request (see
``conversations.api.agent_serializers``): a plain dict with ``decision`` and optional
``complexity``, ``entities``, ``step_results``, ``goal``, ``proposal_message``,
``assumptions`` and ``clarification_questions``."""

import itertools
import json
import re
from collections.abc import Callable, Iterable, Iterator, Mapping, Sequence
from dataclasses import dataclass, replace
from typing import Any

PLAN_DIRECT = "plan_direct"
PROPOSE = "propose"
CLARIFY = "clarify"
DECISIONS = (PLAN_DIRECT, PROPOSE, CLARIFY)
COMPLEXITIES = ("low", "medium", "high")
ENTITY_STATES = ("PENDING", "ACTIVE")
ENTITY_SOURCES = ("db_read", "db_write", "generate", "analyze")
# Only these sources prove the entity exists in the database: a generated id may not exist, and a
# later turn using it as a reference would fail (docs/agent-state.md, "Entities").
DB_SOURCES = frozenset({"db_read", "db_write"})

# Registry statuses: promoted to active_entities, recorded only, or garbage-collected.
ACTIVE = "active"
TRACKED = "tracked"
INACTIVE = "inactive"

PROPOSED_SUMMARY = "Proposed a plan and awaiting user confirmation."
SENTENCE_LIMIT = 300  # characters of a one-sentence summary or theme
STEP_LINE_LIMIT = 160  # characters of a compressed step result
CONTEXT_HEADER = "Agent state (session memory):"

RESPONSE_SUMMARY_INSTRUCTIONS = (
    "You write a one-sentence summary of what an assistant's reply accomplished, for the "
    "assistant's own memory. Rules: a proposal or an offer is not a completed action "
    '("I\'ll save the recipes" -> "Proposed to save recipes; awaiting confirmation"; '
    '"Done! I saved the recipes." -> "Saved recipes: <exact names>"). Use the exact entity '
    "names from the text; never invent or paraphrase names. Answer with the sentence only."
)
THEME_INSTRUCTIONS = (
    "You maintain a one-sentence theme of a conversation session. Focus on the ongoing theme, "
    'not on individual actions ("Planning rice bowl meal prep", not "Just saved a recipe"). '
    "Answer with the updated sentence only."
)


@dataclass(frozen=True)
class Limits:
    """The seed's configuration (docs/agent-state.md), read from settings by the service."""

    summarize_threshold: int = 400
    full_detail_steps: int = 3
    pending_ttl_turns: int = 3
    max_active_entities: int = 20
    max_step_summaries: int = 50
    max_registry_entities: int = 500
    max_context_tokens: int = 1000


# ---------------------------------------------------------------------------------------------
# Text helpers


def one_sentence(text: str, limit: int = SENTENCE_LIMIT) -> str:
    """Whitespace collapsed and clipped at a word boundary, so it stays one line."""
    flat = " ".join(text.split())
    if len(flat) <= limit:
        return flat
    return flat[: limit - 1].rsplit(" ", 1)[0].rstrip(",;:") + "…"


def first_sentence(text: str) -> str:
    flat = " ".join(text.split())
    match = re.match(r"(.+?[.!?])(?:\s|$)", flat)
    return one_sentence(match.group(1) if match else flat)


def labels_in_text(text: str, labels: Iterable[str]) -> list[str]:
    """The labels that occur verbatim in ``text``, in order of first occurrence (exact entity
    names from the text, never paraphrased)."""
    found = {label: text.find(label) for label in dict.fromkeys(labels) if label}
    return sorted((label for label, at in found.items() if at >= 0), key=lambda label: found[label])


DETERMINERS = re.compile(r"\b(?:the|a|an|these|those|this|that|your|my|our|all)\s+", re.IGNORECASE)
# A future or offered action: the reply proposes, it has not done anything yet.
PROPOSAL = re.compile(
    r"\b(?:I'll|I will|I can|I could|I'd|I would|I'm going to|I am going to|Shall I|Should I|"
    r"Would you like me to|Do you want me to|Want me to)\s+(?P<action>[^.!?\n]+)",
    re.IGNORECASE,
)
DONE_VERBS = (
    "saved|created|updated|deleted|added|designed|generated|scheduled|removed|built|wrote|"
    "made|stored|booked|sent|planned|imported|renamed|archived"
)
# A completed action: "I saved …", "I've created …", or a sentence opening with the verb.
COMPLETED = re.compile(
    rf"(?:\b(?:I|we)(?:'ve| have)?\s+|(?:^|[.!?]\s+))"
    rf"(?P<verb>{DONE_VERBS})\b(?P<object>[^.!?\n:]*)",
    re.IGNORECASE,
)


def _phrase(text: str, words: int) -> str:
    return " ".join(DETERMINERS.sub("", text).split()[:words]).strip(" ,;")


def offline_response_summary(reply: str, labels: Iterable[str]) -> str:
    """The deterministic stand-in for the AssistantResponseSummary LLM call, keeping the seed's
    critical rules: whichever comes first, a proposal ("I'll save the recipes") is summarised as
    proposed and awaiting confirmation, a completed action ("Done! I saved the recipes.") as
    "Saved recipes: <exact names>"; otherwise the first sentence. Names are the known entity
    labels that occur verbatim in the reply."""
    names = labels_in_text(reply, labels)
    proposal = PROPOSAL.search(reply)
    done = COMPLETED.search(reply)
    if proposal and (done is None or proposal.start() < done.start()):
        action = _phrase(proposal.group("action"), 8)
        unnamed = [name for name in names if name not in action]
        suffix = f" ({', '.join(unnamed)})" if unnamed else ""
        return one_sentence(f"Proposed to {action}{suffix}; awaiting confirmation.")
    if done:
        what = " ".join(filter(None, [done.group("verb").capitalize(), _phrase(done["object"], 6)]))
        return one_sentence(f"{what}: {', '.join(names)}." if names else f"{what}.")
    sentence = first_sentence(reply).rstrip(".!?")
    return one_sentence(f"{sentence} ({', '.join(names)})." if names else f"{sentence}.")


def deterministic_summary(agent: Mapping[str, Any]) -> str:
    """The propose/clarify safeguard: a propose/clarify reply is never summarised by a model, so a
    proposal can never be remembered as done."""
    goal = agent.get("goal") or ""
    if agent.get("decision") == PROPOSE:
        if goal:
            return one_sentence(f"Proposed a plan and awaiting user confirmation (goal: {goal}).")
        return PROPOSED_SUMMARY
    questions = agent.get("clarification_questions") or []
    about = f" about {goal}" if goal else ""
    if questions:
        more = f" (and {len(questions) - 1} more)" if len(questions) > 1 else ""
        return one_sentence(
            f"Asked the user to clarify{about}: {questions[0].rstrip('?')}?{more}; "
            "awaiting an answer."
        )
    return one_sentence(f"Asked the user to clarify{about}; awaiting an answer.")


def uses_llm_summary(agent: Mapping[str, Any], reply: str, limits: Limits) -> bool | None:
    """None: no response summary (a short plan_direct reply is its own summary); False: the
    deterministic one; True: the one-sentence summary (LLM, or the offline summarizer)."""
    if agent.get("decision") in (PROPOSE, CLARIFY):
        return False
    if len(reply) <= limits.summarize_threshold:
        return None
    return True


# ---------------------------------------------------------------------------------------------
# Session theme


def needs_theme_update(agent: Mapping[str, Any]) -> bool:
    """Only a significant action (high complexity or multi-step) moves the theme."""
    return agent.get("complexity") == "high" or len(agent.get("step_results") or []) > 1


def offline_theme(current: str, agent: Mapping[str, Any], user_text: str) -> str:
    """The deterministic stand-in for EngagementSummary: the router's goal names the theme;
    without one, the user's request does, and an existing theme is kept."""
    goal = agent.get("goal") or ""
    if goal:
        return one_sentence(goal[0].upper() + goal[1:].rstrip(".") + ".")
    if current:
        return current
    return one_sentence(f"Working on: {first_sentence(user_text).rstrip('.!?')}.")


def theme_request(current: str, user_text: str, reply: str) -> str:
    return (
        f"Current theme: {current or '(none yet)'}\n\n"
        f"Latest exchange:\nUser: {one_sentence(user_text, 2000)}\n"
        f"Assistant: {one_sentence(reply, 4000)}"
    )


def response_summary_request(reply: str, labels: Sequence[str]) -> str:
    known = f"Known entity names: {', '.join(labels)}\n\n" if labels else ""
    return f"{known}Assistant reply:\n{reply}"


# ---------------------------------------------------------------------------------------------
# Entities


def merge_entities(
    registry: Mapping[str, dict[str, Any]],
    entities: Sequence[Mapping[str, Any]],
    turn: int,
    seq: int,
) -> dict[str, dict[str, Any]]:
    """Every entity of the turn goes into the registry (the latest type, label, state and
    source win); ``in_db`` sticks once a db_read/db_write step has seen the id, since only those
    ids can be used as references later."""
    merged = {key: dict(record) for key, record in registry.items()}
    for entity in entities:
        previous = merged.get(entity["id"], {})
        in_db = bool(previous.get("in_db")) or entity["source"] in DB_SOURCES
        merged[entity["id"]] = {
            "id": entity["id"],
            "type": entity["type"],
            "label": entity["label"],
            "state": entity["state"],
            "source": entity["source"],
            "in_db": in_db,
            "status": ACTIVE if in_db else TRACKED,
            "first_turn": previous.get("first_turn", turn),
            "last_turn": turn,
            "first_seq": previous.get("first_seq", seq),
            "last_seq": seq,
        }
    return merged


def collect_garbage(
    registry: Mapping[str, dict[str, Any]], turn: int, ttl_turns: int
) -> dict[str, dict[str, Any]]:
    """PENDING entities not referenced in the last ``ttl_turns`` turns become inactive (kept in
    the registry for the lifecycle record, dropped from active_entities)."""
    collected = {}
    for key, record in registry.items():
        stale = record["state"] == "PENDING" and turn - record["last_turn"] >= ttl_turns
        collected[key] = {**record, "status": INACTIVE} if stale else dict(record)
    return collected


# Which records go first when the registry is full: inactive ones, then those only tracked,
# then the ones a database step has seen (the only ids later turns can use as references).
EVICTION_ORDER = {INACTIVE: 0, TRACKED: 1, ACTIVE: 2}


def bounded_registry(registry: Mapping[str, dict[str, Any]], cap: int) -> dict[str, dict[str, Any]]:
    """At most ``cap`` records: the whole registry is rewritten with every turn and its labels
    go to the response-summary model, so an agent that names new entities every turn must not
    grow it for ever. The least useful go first (EVICTION_ORDER), the least recently referenced
    among equals."""
    if len(registry) <= cap:
        return dict(registry)

    def keep_first(item: tuple[str, dict[str, Any]]) -> tuple[int, int, int]:
        record = item[1]
        return (-EVICTION_ORDER.get(record["status"], 0), -record["last_turn"], -record["last_seq"])

    return dict(sorted(registry.items(), key=keep_first)[:cap])


def active_entities(registry: Mapping[str, Mapping[str, Any]], cap: int) -> list[dict[str, Any]]:
    """The promoted entities, most recently referenced first, at most ``cap`` (they go into
    every context, so they are bounded)."""
    active = [record for record in registry.values() if record["status"] == ACTIVE]
    active.sort(key=lambda record: (-record["last_turn"], -record["last_seq"], record["id"]))
    return [
        {key: record[key] for key in ("id", "type", "label", "state", "source")}
        for record in active[:cap]
    ]


# ---------------------------------------------------------------------------------------------
# Pending clarification and step results


def pending_after(
    current: Mapping[str, Any] | None, agent: Mapping[str, Any], seq: int
) -> dict[str, Any] | None:
    """Decision context tracking: propose stores the proposal, clarify the questions,
    plan_direct clears it (execution complete)."""
    decision = agent.get("decision")
    keys: tuple[str, ...]
    if decision == PROPOSE:
        keys = ("goal", "proposal_message", "assumptions")
    elif decision == CLARIFY:
        keys = ("goal", "clarification_questions")
    elif decision == PLAN_DIRECT:
        return None
    else:
        return dict(current) if current else None
    stored = {key: agent[key] for key in keys if agent.get(key)}
    return {"decision": decision, "seq": seq, **stored}


def step_line(result: object) -> str:
    """One line for an older step result (deterministic: no LLM call per step)."""
    if isinstance(result, Mapping) and isinstance(result.get("summary"), str):
        text = result["summary"]
    elif isinstance(result, str):
        text = result
    else:
        text = json.dumps(result, sort_keys=True, ensure_ascii=False, separators=(",", ":"))
    return one_sentence(text, STEP_LINE_LIMIT)


def compress_steps(
    recent: Sequence[Mapping[str, Any]],
    summaries: Sequence[Mapping[str, Any]],
    results: Sequence[object],
    seq: int,
    limits: Limits,
) -> tuple[list[dict[str, Any]], list[dict[str, Any]]]:
    """The newest FULL_DETAIL_STEPS results stay in full; older ones become one-line
    summaries (at most ``max_step_summaries``, the oldest dropped first)."""
    full = [dict(step) for step in recent]
    full += [{"seq": seq, "index": index, "result": r} for index, r in enumerate(results)]
    split = max(len(full) - max(limits.full_detail_steps, 0), 0)
    older, full = full[:split], full[split:]
    lines = [dict(line) for line in summaries]
    lines += [
        {"seq": step["seq"], "index": step["index"], "summary": step_line(step["result"])}
        for step in older
    ]
    return full, lines[-limits.max_step_summaries :] if limits.max_step_summaries else []


# ---------------------------------------------------------------------------------------------
# What the model receives


TokenCounter = Callable[[str], int]
# Free texts of the block (theme, goal, proposal, questions) are clipped to these lengths, one
# after the other, when dropping whole lines was not enough to fit the token bound.
CLIP_STEPS = (1000, 500, 250, 120, 60)
TRUNCATED = "…"


def render_context(
    theme: str,
    entities: Sequence[Mapping[str, Any]],
    pending: Mapping[str, Any] | None,
    max_tokens: int | None = None,
    count_tokens: TokenCounter | None = None,
) -> str:
    """The agent state as one system message right after the system prompt; empty when there
    is nothing to show.

    With ``max_tokens`` (and its ``count_tokens``) the block never exceeds that many tokens: it
    is counted with the system prompt, which no fold can shrink, so an unbounded block (a valid
    agent object with long texts) made every later turn of the chat a 503, including the one
    that would clear it. The least important parts go first (``smaller_parts``)."""
    parts = ContextParts(theme, list(entities), dict(pending) if pending else None)
    if max_tokens is None or count_tokens is None:
        return render_parts(parts)
    if max_tokens <= 0:
        return ""
    block = ""
    for candidate in itertools.chain([parts], smaller_parts(parts)):
        block = render_parts(candidate)
        if count_tokens(block) <= max_tokens:
            return block
    return clip_to_tokens(block, max_tokens, count_tokens)


@dataclass(frozen=True)
class ContextParts:
    theme: str
    entities: list[Mapping[str, Any]]
    pending: dict[str, Any] | None


def render_parts(parts: ContextParts) -> str:
    lines: list[str] = []
    if parts.theme:
        lines.append(f"Session theme: {parts.theme}")
    if parts.entities:
        lines.append("Active entities (exist in the database; use these ids):")
        lines += [
            f"- {e['label']} ({e['type']}, id {e['id']}, {e['source']})" for e in parts.entities
        ]
    if parts.pending:
        lines += pending_lines(parts.pending)
    return "\n".join([CONTEXT_HEADER, *lines]) if lines else ""


def smaller_parts(parts: ContextParts) -> Iterator[ContextParts]:
    """Ever smaller versions of the block, least important first: the proposal's assumptions
    (from the last), then the active entities (least recently referenced first), then the free
    texts clipped shorter and shorter, then the clarification questions but the first. The
    pending decision and the session theme are what the next turn needs most: they go last."""
    pending = dict(parts.pending) if parts.pending else None
    while pending and pending.get("assumptions"):
        pending = {**pending, "assumptions": pending["assumptions"][:-1]}
        yield replace(parts, pending=pending)
    parts = replace(parts, pending=pending)
    entities = list(parts.entities)
    while entities:
        entities = entities[:-1]
        yield replace(parts, entities=entities)
    parts = replace(parts, entities=[])
    for limit in CLIP_STEPS:
        clipped = clipped_texts(parts, limit)
        if clipped != parts:  # nothing longer than the limit: the same block, counted already
            yield clipped
            parts = clipped
    questions = (parts.pending or {}).get("clarification_questions") or []
    if len(questions) > 1:
        yield replace(
            parts, pending={**(parts.pending or {}), "clarification_questions": questions[:1]}
        )


def clipped_texts(parts: ContextParts, limit: int) -> ContextParts:
    pending = dict(parts.pending) if parts.pending else None
    if pending:
        for key in ("goal", "proposal_message"):
            if pending.get(key):
                pending[key] = one_sentence(pending[key], limit)
        if pending.get("clarification_questions"):
            pending["clarification_questions"] = [
                one_sentence(q, limit) for q in pending["clarification_questions"]
            ]
    return ContextParts(one_sentence(parts.theme, limit), parts.entities, pending)


def clip_to_tokens(text: str, max_tokens: int, count_tokens: TokenCounter) -> str:
    """The longest prefix of ``text`` (plus a mark) within ``max_tokens``: the last resort, so
    the bound holds whatever the parts are (a text without spaces is not shortened by
    ``one_sentence``'s word boundary)."""
    low, high = 0, len(text)
    while low < high:
        middle = (low + high + 1) // 2
        if count_tokens(text[:middle] + TRUNCATED) <= max_tokens:
            low = middle
        else:
            high = middle - 1
    return text[:low] + TRUNCATED if low else ""


def pending_lines(pending: Mapping[str, Any]) -> list[str]:
    if pending["decision"] == PROPOSE:
        lines = ["Pending proposal (awaiting the user's confirmation):"]
    else:
        lines = ["Pending clarification (awaiting the user's answer):"]
    if pending.get("goal"):
        lines.append(f"- Goal: {pending['goal']}")
    if pending.get("proposal_message"):
        lines.append(f"- Proposal: {pending['proposal_message']}")
    lines += [f"- Assumption: {a}" for a in pending.get("assumptions") or []]
    lines += [f"- Question: {q}" for q in pending.get("clarification_questions") or []]
    return lines
