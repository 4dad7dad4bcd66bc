"""A chat's memory over its turns, for the admin's timeline: each reply's prompt tokens and the
unfolded messages its context carried, each committed fold where it landed (its kind, range and
the summary's size after it), and the chat's bounds and background thresholds as the engine
sets them for its policy now.

Three queries whatever the chat's length: its replies (seq, time, the prompt tokens the model
reported), its committed ledger rows, and its policy; the unfolded count of each turn is
derived from the folds that had committed before it."""

from bisect import bisect_left, bisect_right
from dataclasses import dataclass
from datetime import datetime

from django.db.models.fields.json import KeyTextTransform

from conversations.models import Chat, Consolidation, ConsolidationStatus, Message, Role
from memory_worker.engine import policy as engine
from memory_worker.memory import policy_for_chat, variant_context_tokens

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
    unfolded: int  # messages after W in the context the reply was made from
    waited: bool = False  # over its bound, it waited for the fold in flight


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
    found = engine.thresholds(policy, variant_context_tokens(chat))
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
        )
        .values_list("seq", "created_at", "prompt", "waited")
    )
    rows = (
        Consolidation.objects.filter(chat_id=chat.pk, status=ConsolidationStatus.SUCCEEDED)
        .exclude(finished_at=None)
        .order_by("finished_at", "id")
        .values_list(*LEDGER_FIELDS)
    )
    committed = list(rows)
    # W after each commit, in commit order: a turn's context had the W of the last fold before it.
    finished = [row[5] for row in committed]
    watermarks: list[int] = []
    for row in committed:
        watermarks.append(max(row[4], watermarks[-1] if watermarks else 0))
    turns = []
    for seq, at, prompt, waited in replies:
        before = bisect_right(finished, at)
        watermark = watermarks[before - 1] if before else 0
        unfolded = max(seq - 1 - watermark, 0)
        turns.append(Turn(seq, at, _tokens(prompt), unfolded, waited is not None))
    times = [turn.at for turn in turns]
    folds = [
        Fold(
            id=row[0],
            kind=fold_kind(row[1], row[2]),
            trigger=row[1],
            from_seq=row[3],
            to_seq=row[4],
            at=row[5],
            summary_tokens=row[6],
            turn_index=bisect_left(times, row[5]),
        )
        for row in committed
    ]
    return Timeline(turns, folds, limits_of(chat))


def _tokens(reported: object) -> int:
    try:
        return max(int(str(reported)), 0)
    except ValueError:
        return 0
