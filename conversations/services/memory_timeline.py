"""A chat's memory over its turns, for the admin's timeline: what each reply's context held (the
unfolded messages and the history's tokens as the engine counted them, and the prompt tokens
the model reported), each committed fold at the first turn it served (its kind, range and the
summary's size after it), and the chat's bounds and background thresholds as the engine sets
them for it now.

Each reply's metadata keeps the W its context was built from (``context``); a fold is placed
at the first turn whose W covers its range, which no clock decides. Replies stored before that
was recorded are placed by time (the fold committed before the reply was stored), and their
unfolded count is derived from the W of the last fold before them. Three queries whatever the
chat's length: its replies, its committed ledger rows, and its snapshot for the thresholds."""

from bisect import bisect_left, bisect_right
from dataclasses import dataclass
from datetime import datetime

from django.db.models.fields.json import KeyTextTransform, KeyTransform

from conversations.models import Chat, Consolidation, ConsolidationStatus, Message, Role
from memory_worker.engine import policy as engine
from memory_worker.memory import (
    engine_state,
    load_snapshot,
    policy_for_chat,
    variant_context_tokens,
)

# How a committed ledger row is drawn, by what made it (its trigger, and whether a turn waited).
LEDGER_FIELDS = (
    "id",
    "trigger",
    "synchronous",
    "from_seq",
    "to_seq",
    "finished_at",
    "summary_tokens_after",
)
KINDS = ("background", "synchronous", "manual", "fallback", "edit")
FALLBACK_TRIGGERS = {engine.Trigger.HARD_BOUND_FALLBACK, engine.Trigger.SUMMARIZER_FALLBACK}


@dataclass(frozen=True, slots=True)
class Turn:
    seq: int  # the reply's
    at: datetime
    prompt_tokens: int  # as the model reported them (0: not reported)
    unfolded: int  # stored messages after W in the context the reply was made from
    waited: bool = False  # over its bound, it waited for the fold in flight
    history_tokens: int = 0  # the summary, pins and unfolded messages, as the bound counts them
    watermark: int = 0  # W of its context


@dataclass(frozen=True, slots=True)
class Fold:
    id: int
    kind: str
    trigger: str
    from_seq: int
    to_seq: int
    at: datetime
    summary_tokens: int  # the summary's size once it committed
    turn_index: int  # the first turn after it (len(turns): after the last)


@dataclass(frozen=True, slots=True)
class Limits:
    prompt_bound: int
    prompt_trigger: int
    token_bound: int | None  # history tokens (summary, pins, unfolded), when the policy has one
    token_trigger: int | None
    message_bound: int | None  # unfolded messages, when the policy bounds them
    message_trigger: int | None
    summary_cap: int


@dataclass(frozen=True, slots=True)
class Timeline:
    turns: list[Turn]
    folds: list[Fold]
    limits: Limits


def fold_kind(trigger: str, synchronous: bool) -> str:
    if trigger == engine.Trigger.EDIT:
        return "edit"
    if trigger in FALLBACK_TRIGGERS:
        return "fallback"
    if trigger == engine.Trigger.MANUAL:
        return "manual"
    if synchronous:
        return "synchronous"
    return "background"


def limits_of(chat: Chat) -> Limits:
    policy = policy_for_chat(chat)
    # The thresholds as the engine sets them for this chat now: its reserve sized from its
    # recent turns.
    state = engine_state(chat, load_snapshot(chat.pk), variant_context_tokens(chat))
    found = engine.chat_thresholds(state, policy)
    return Limits(
        prompt_bound=found.prompt_bound,
        prompt_trigger=found.prompt_trigger,
        token_bound=found.token_bound,
        token_trigger=found.token_trigger,
        message_bound=found.message_bound,
        message_trigger=found.message_trigger,
        summary_cap=policy.summary_token_cap,
    )


def memory_timeline(chat: Chat) -> Timeline:
    replies = (
        Message.objects.filter(chat_id=chat.pk, role=Role.ASSISTANT)
        .order_by("seq")
        .annotate(
            prompt=KeyTextTransform("prompt_tokens", "metadata"),
            waited=KeyTextTransform("waited_for_fold_ms", "metadata"),
            context=KeyTransform("context", "metadata"),
        )
        .values_list("seq", "created_at", "prompt", "waited", "context")
    )
    rows = (
        Consolidation.objects.filter(chat_id=chat.pk, status=ConsolidationStatus.SUCCEEDED)
        .exclude(finished_at=None)
        .order_by("finished_at", "id")
        .values_list(*LEDGER_FIELDS)
    )
    committed = list(rows)
    # W after each commit, in commit order: for a reply with no recorded context, the W of the
    # last fold committed before it was stored.
    finished = [row[5] for row in committed]
    watermarks: list[int] = []
    for row in committed:
        watermarks.append(max(row[4], watermarks[-1] if watermarks else 0))
    turns: list[Turn] = []
    for seq, at, prompt, waited, context in replies:
        recorded = context if isinstance(context, dict) else {}
        before = bisect_right(finished, at)
        estimate = watermarks[before - 1] if before else 0
        watermark = max(
            _int(recorded.get("watermark"), estimate), turns[-1].watermark if turns else 0
        )
        # A REST turn's reply follows its user message: stored messages before that, after W.
        unfolded = _int(recorded.get("unfolded"), max(seq - 2 - watermark, 0))
        history = _int(recorded.get("history_tokens"), 0)
        turns.append(
            Turn(seq, at, _int(prompt, 0), unfolded, waited is not None, history, watermark)
        )
    times = [turn.at for turn in turns]
    served = [turn.watermark for turn in turns]
    folds = []
    for row in committed:
        kind = fold_kind(row[1], row[2])
        # A fold serves the first turn whose context's W covers its range; an edit folds no
        # range and lands where it was made.
        index = bisect_left(times, row[5]) if kind == "edit" else bisect_left(served, row[4])
        folds.append(
            Fold(
                id=row[0],
                kind=kind,
                trigger=row[1],
                from_seq=row[3],
                to_seq=row[4],
                at=row[5],
                summary_tokens=row[6],
                turn_index=index,
            )
        )
    return Timeline(turns, folds, limits_of(chat))


def _int(value: object, default: int) -> int:
    try:
        return max(int(str(value)), 0) if value is not None else default
    except ValueError:
        return default
