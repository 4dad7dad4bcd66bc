"""When a chat's next fold is due and why, for people (the admin's chat page): the policy engine's
own decision and trigger measures for the chat as it stands, with the brief's failure state."""

from dataclasses import dataclass
from datetime import datetime

from conversations.models import Brief, Chat
from conversations.rows import database_now
from memory_worker.engine import policy as engine
from memory_worker.memory import (
    engine_state,
    load_snapshot,
    policy_for_chat,
    variant_context_tokens,
)


@dataclass(frozen=True)
class FoldOutlook:
    summary_tokens: int
    summary_cap: int  # the chat's policy's summary_token_cap
    watermark: int  # W: messages with seq <= W are folded into the summary
    # The fold the engine would run now (None: nothing is due), else the trigger nearest its
    # threshold; ``held``: a trigger reached whose range is empty (the verbatim tail keeps it all).
    due: engine.Decision | None
    due_measure: engine.Measure | None
    nearest: engine.Measure | None
    held: bool
    # Failures: turn-triggered folds wait until ``backing_off_until``; ``degraded`` after
    # MEMORY_DEGRADED_AFTER_FAILURES in a row.
    backing_off_until: datetime | None
    degraded: bool
    consecutive_failures: int
    last_error: str


def fold_outlook(chat: Chat, now: datetime | None = None) -> FoldOutlook:
    now = now or database_now()  # backoff and cooldowns were stamped with the database's time
    snapshot = load_snapshot(chat.pk)
    brief = Brief.objects.only(
        "degraded", "consecutive_failures", "last_error", "next_attempt_at"
    ).get(chat_id=chat.pk)
    state = engine_state(chat, snapshot, variant_context_tokens(chat))
    policy = policy_for_chat(chat)
    decision = engine.decide(state, policy, now)
    measures = engine.measures(state, policy, now)
    due_measure = None
    if decision is not None:
        due_measure = next(
            (m for m in measures if m.trigger == decision.trigger and m.reached), None
        )
    waiting = [m for m in measures if m.armed and not m.reached and m.threshold > 0]
    nearest = max(waiting, key=lambda m: m.value / m.threshold, default=None)
    retry_at = brief.next_attempt_at
    backing_off = retry_at if retry_at is not None and retry_at > now else None
    return FoldOutlook(
        summary_tokens=snapshot.summary_tokens,
        summary_cap=policy.summary_token_cap,
        watermark=snapshot.last_consolidated,
        due=decision,
        due_measure=due_measure,
        nearest=nearest,
        held=decision is None and any(m.reached for m in measures),
        backing_off_until=backing_off,
        degraded=brief.degraded,
        consecutive_failures=brief.consecutive_failures,
        last_error=brief.last_error,
    )


def nothing_to_fold_detail(chat: Chat) -> str:
    """Why a manual fold found nothing, and when it will: every unfolded message is in the
    verbatim tail the chat's policy keeps, which no fold takes. Raises Chat.DoesNotExist when
    the chat was deleted since (its brief goes with it), as the manual request does."""
    policy = policy_for_chat(chat)
    watermark = Brief.objects.filter(chat=chat).values_list("last_consolidated", flat=True).first()
    if watermark is None:
        raise Chat.DoesNotExist(f"chat {chat.pk} was deleted")
    unfolded = chat.last_seq - watermark
    kept = f"the newest {policy.tail_messages} messages and " if policy.tail_messages else ""
    turns = max(policy.tail_turns, 1)
    kept += f"{turns} turn{'s' if turns > 1 else ''}"
    return (
        f"Nothing to fold yet: the {unfolded} unfolded messages are all in the verbatim tail "
        f"this chat's policy ({chat.policy}) keeps ({kept}). A fold can take a message once "
        "newer messages push it out of that tail."
    )
