"""The pure memory policy engine (docs/design.md, policies): given a chat's state, a policy and
``now``, decide whether to fold and which range. Standard library only, no I/O, deterministic.

Vocabulary (W, unfolded, turn boundary: memory_worker.engine.state):
- ``compress_end``: the last boundary that keeps the policy's verbatim tail (in messages and in
  turns) and, in the background, always the newest turn. Backlog = ``compress_end - W``.
- History: the summary plus every unfolded message. The hard bound limits the history (message
  count and tokens) and the whole prompt; the new user message comes on top, as in seeds 000
  (recent_messages <= K + B) and 001 (context_size counts history messages).
"""

from __future__ import annotations

from bisect import bisect_right
from dataclasses import dataclass
from datetime import datetime
from enum import StrEnum
from math import ceil

from memory_worker.engine.state import (
    ChatState,
    after_boundaries,
    boundaries,
    history_tokens,
    prompt_tokens,
    prompt_total,
)

# A model needs room to answer: the prompt may use at most this share of its context window.
PROMPT_WINDOW_SHARE = 0.9

# Headroom (docs/policies.md): every background threshold sits below its hard bound by a reserve
# for the growth expected while a fold runs, ``headroom_turns`` turns of the chat's recent size
# (engine_state.ChatState.turn_size).
# The floor of a turn's size, as a share of the bound: a chat with few or small turns still
# leaves a few turns' worth of room.
NOMINAL_TURN_SHARE = 1 / 16
# A reserve never takes more than this share of its bound: with very large turns the threshold
# stays above the fold target, so folds stay batched (and a turn that meets the bound waits for
# the fold in flight instead).
MAX_RESERVE_SHARE = 0.5
MESSAGES_PER_TURN = 2  # a user message and its reply: the least a turn adds
# A token fold's default target keeps 1/FOLD_TARGET_SHARE of the bound (beside the summary)
# verbatim: every summarizer call re-sends the summary and its instructions, so fewer, larger
# folds cost less (docs/benchmarks.md, the topology run).
FOLD_TARGET_SHARE = 8


class Trigger(StrEnum):
    """Why a fold ran, as its ledger row names it."""

    # The engine's background triggers, in priority order (TRIGGER_PRIORITY).
    TOKEN_BUDGET = "token_budget"
    OVERFLOW = "overflow"
    HARD_LIMIT = "hard_limit"
    WINDOW = "window"
    SAFETY = "safety"
    CHUNK_SIZE = "chunk_size"
    COOLDOWN = "cooldown"
    # Asked for through the API or the admin.
    MANUAL = "manual"
    # Run by a turn over its hard bound, before the model call; the fallback is the same fold
    # made by the offline summarizer after the configured one failed.
    HARD_BOUND = "hard_bound"
    HARD_BOUND_FALLBACK = "hard_bound_fallback"
    # A background fold made by the offline summarizer after the configured one failed it
    # (MEMORY_SUMMARIZER_FALLBACK=offline).
    SUMMARIZER_FALLBACK = "summarizer_fallback"
    # Not a fold: a person's edit of the summary (memory_worker.folding.summary_edit), fenced like
    # one; its ledger row folds no message (an empty range, from_seq = W + 1, to_seq = W).
    EDIT = "edit"


TRIGGER_PRIORITY = (
    Trigger.TOKEN_BUDGET,
    Trigger.OVERFLOW,
    Trigger.HARD_LIMIT,
    Trigger.WINDOW,
    Trigger.SAFETY,
    Trigger.CHUNK_SIZE,
    Trigger.COOLDOWN,
)


@dataclass(frozen=True, slots=True)
class Policy:
    """Every knob of the engine. ``None`` disables a trigger or a bound. Field names are what
    clients pass as ``policy_overrides``."""

    name: str
    # Each knob's name in the presets' requirements (docs/policies.md) follows its preset's name.
    # Verbatim tail that background folds never touch.
    tail_messages: int = 0  # contract K, sliding-window tail_keep_size
    tail_turns: int = 1  # chunked K, turn-digest FULL_DETAIL_TURNS; at least the newest turn
    # Triggers.
    token_budget_fraction: float | None = None  # contract: prompt > 70% of the model window
    max_tokens: int | None = None  # token-budget: history tokens; also its hard bound
    max_summary_tokens: int = 256  # token-budget: reserved for the summary
    fold_target_tokens: int | None = None  # token folds cut history down to this (low water)
    overflow_buffer: int | None = None  # contract B: fold when unfolded > tail_messages + B
    hard_limit: int | None = None  # sliding-window compression_hard_limit (backlog)
    window: int | None = None  # sliding-window compression_window_size (backlog)
    safety_user_turns: int | None = None  # contract: every N user turns
    chunk_threshold: int | None = None  # chunked: summary + unfolded tokens
    cooldown_seconds: float | None = None  # sliding-window compression_cooldown_sec
    max_fold_turns: int | None = None  # turn-digest: fold one turn at a time
    # Hard bounds (promise 2), enforced before the model call.
    context_size: int | None = None  # history messages (sliding-window context_size, contract K+B)
    max_memory_tokens: int | None = None  # history tokens; max_tokens bounds them too
    summary_token_cap: int = 500
    # Turns of growth every background threshold leaves below its hard bound (headroom): the
    # turn that crosses a threshold and the next one's message fit while the fold runs.
    headroom_turns: int = 1


@dataclass(frozen=True, slots=True)
class Decision:
    trigger: Trigger
    from_seq: int
    to_seq: int

    @property
    def size(self) -> int:
        return self.to_seq - self.from_seq + 1


@dataclass(frozen=True, slots=True)
class PreTurn:
    fold: Decision | None
    fits: bool


def compress_end(state: ChatState, policy: Policy, *, keep_newest_turn: bool = True) -> int:
    """The last boundary that keeps the verbatim tail. Before a turn (``keep_newest_turn=False``)
    the incoming message is the newest turn, so the stored ones only keep the policy's tail."""
    min_turns = max(policy.tail_turns, 1) if keep_newest_turn else max(policy.tail_turns - 1, 0)
    best = state.last_consolidated
    for boundary, after in after_boundaries(state).items():
        if state.last_seq - boundary >= policy.tail_messages and after.users >= min_turns:
            best = boundary
    return best


def _limit_turns(state: ChatState, policy: Policy, end: int) -> int:
    if policy.max_fold_turns is None:
        return end
    table = after_boundaries(state)
    unfolded_users = table[state.last_consolidated].users
    allowed = [
        boundary
        for boundary, after in table.items()
        if boundary <= end and unfolded_users - after.users <= policy.max_fold_turns
    ]
    return max(allowed) if allowed else state.last_consolidated


# --- headroom ---------------------------------------------------------------------------------


@dataclass(frozen=True, slots=True)
class Thresholds:
    """Each hard bound with the background threshold derived below it. History tokens and
    unfolded messages are compared with ``>``: a fold is due past the threshold. ``None``: the
    policy has no such bound or trigger."""

    token_bound: int | None
    token_reserve: int
    token_trigger: int | None
    message_bound: int | None
    message_reserve: int
    message_trigger: int | None
    prompt_bound: int
    prompt_reserve: int
    prompt_trigger: int
    chunk_trigger: int | None
    fold_target: int


def token_bound(policy: Policy) -> int | None:
    """The hard bound on history tokens: ``max_memory_tokens``, and token-budget's ``max_tokens``
    (summary and messages within it), the smaller when both are set."""
    bounds = [b for b in (policy.max_memory_tokens, policy.max_tokens) if b is not None]
    return min(bounds) if bounds else None


def reserve(bound: int, turns: int, turn_size: float, floor: float) -> int:
    """``turns`` turns of ``turn_size`` (at least ``floor``), at most MAX_RESERVE_SHARE of the
    bound."""
    return min(ceil(turns * max(turn_size, floor)), int(bound * MAX_RESERVE_SHARE))


def thresholds(
    policy: Policy,
    model_context_tokens: int,
    turn_tokens: float = 0.0,
    turn_messages: float = 0.0,
) -> Thresholds:
    """The background thresholds for a chat whose turns are typically ``turn_tokens`` tokens and
    ``turn_messages`` messages (0: unknown, the floors apply). Each is at most its hard bound minus
    its reserve; a preset's own trigger knob, when lower, stays the threshold. token-budget's
    ``max_tokens - max_summary_tokens`` is not one: the reserve replaces that fixed offset."""
    turns = policy.headroom_turns
    bound = token_bound(policy)
    token_reserve = 0
    token_trigger = None
    if bound is not None:
        token_reserve = reserve(bound, turns, turn_tokens, bound * NOMINAL_TURN_SHARE)
        token_trigger = bound - token_reserve
    message_reserve = 0
    message_trigger = None
    if policy.context_size is not None:
        per_turn = max(turn_messages, MESSAGES_PER_TURN)
        message_reserve = reserve(policy.context_size, turns, per_turn, MESSAGES_PER_TURN)
        message_trigger = policy.context_size - message_reserve
    if policy.overflow_buffer is not None:
        seed_overflow = policy.tail_messages + policy.overflow_buffer
        message_trigger = (
            seed_overflow if message_trigger is None else min(message_trigger, seed_overflow)
        )
    prompt_bound = int(PROMPT_WINDOW_SHARE * model_context_tokens)
    prompt_reserve = reserve(prompt_bound, turns, turn_tokens, prompt_bound * NOMINAL_TURN_SHARE)
    prompt_trigger = prompt_bound - prompt_reserve
    if policy.token_budget_fraction is not None:
        prompt_trigger = min(
            prompt_trigger, int(policy.token_budget_fraction * model_context_tokens)
        )
    chunk_trigger = policy.chunk_threshold
    if chunk_trigger is not None and bound is not None:
        chunk_trigger = min(chunk_trigger, bound - token_reserve)
    return Thresholds(
        token_bound=bound,
        token_reserve=token_reserve,
        token_trigger=token_trigger,
        message_bound=policy.context_size,
        message_reserve=message_reserve,
        message_trigger=message_trigger,
        prompt_bound=prompt_bound,
        prompt_reserve=prompt_reserve,
        prompt_trigger=prompt_trigger,
        chunk_trigger=chunk_trigger,
        fold_target=fold_target(policy, bound, token_trigger, prompt_trigger),
    )


def fold_target(
    policy: Policy, bound: int | None, token_trigger: int | None, prompt_trigger: int
) -> int:
    """The history a token fold folds down to (the summary at its reserve included): well below
    the threshold, so folds come in batches (hysteresis). ``fold_target_tokens`` when set (at
    most the threshold: above it a fold would fold nothing); else the summary's reserve and an
    eighth of the rest of the token bound, at most half of either threshold: each fold then
    takes most of the verbatim history, and the summary is rewritten less often."""
    trigger = prompt_trigger if token_trigger is None else min(token_trigger, prompt_trigger)
    if policy.fold_target_tokens is not None:
        return min(policy.fold_target_tokens, trigger)
    if bound is None:
        return trigger // 2
    summary = policy.max_summary_tokens if policy.max_tokens is not None else 0
    summary = max(summary, min(policy.summary_token_cap, bound // 2))
    return min(summary + (bound - summary) // FOLD_TARGET_SHARE, trigger // 2)


def chat_thresholds(state: ChatState, policy: Policy) -> Thresholds:
    """The thresholds for this chat now: its reserve sized from its recent turns."""
    return thresholds(policy, state.model_context_tokens, *state.turn_size)


def _fold(state: ChatState, trigger: Trigger, end: int) -> Decision | None:
    if end <= state.last_consolidated:
        return None
    return Decision(trigger, state.last_consolidated + 1, end)


def backlog(state: ChatState, policy: Policy) -> int:
    return compress_end(state, policy) - state.last_consolidated


# --- background decision ---------------------------------------------------------------------


def token_budget_exceeded(state: ChatState, policy: Policy) -> bool:
    return _token_budget_exceeded(state, chat_thresholds(state, policy))


def _token_budget_exceeded(state: ChatState, limits: Thresholds) -> bool:
    if prompt_tokens(state) > limits.prompt_trigger:
        return True
    return limits.token_trigger is not None and history_tokens(state) > limits.token_trigger


def _token_fold_end(state: ChatState, policy: Policy, newest_allowed: int) -> int:
    """Fold the oldest turns until the rest (with a summary at its reserve) fits the low-water
    target, never past ``newest_allowed``. A policy with a verbatim message tail folds down to
    that tail, as the contract preset keeps only the most recent K after a fold."""
    target = chat_thresholds(state, policy).fold_target
    reserve = max(policy.max_summary_tokens, state.summary_tokens) + state.pinned_tokens
    end = newest_allowed
    for boundary, after in after_boundaries(state).items():
        if boundary <= state.last_consolidated:
            # The history may fit the target while the prompt (its overhead too) is over the
            # trigger: a fold that fired takes at least the oldest turn.
            continue
        if boundary > newest_allowed:
            break
        if reserve + after.tokens <= target:
            end = boundary
            break
    if policy.tail_messages:
        end = max(end, compress_end(state, policy))
    return end


def _newest_turn_boundary(state: ChatState) -> int:
    """The boundary before the newest stored turn: background folds stop there."""
    return max(boundaries(state))


@dataclass(frozen=True, slots=True)
class Measure:
    """One background trigger's test: where the chat stands (``value``, in ``quantity``) against
    its threshold, reached past it (``strict``) or at it, and only while ``armed``."""

    trigger: Trigger
    quantity: str
    value: float
    threshold: float
    strict: bool = True
    armed: bool = True

    @property
    def reached(self) -> bool:
        if not self.armed:
            return False
        return self.value > self.threshold if self.strict else self.value >= self.threshold


def measures(state: ChatState, policy: Policy, now: datetime) -> list[Measure]:
    """Each background trigger the policy has, in priority order, measured now: what ``decide``
    tests, and what tells a person when the next fold is due."""
    pending = backlog(state, policy)
    limits = chat_thresholds(state, policy)
    history = history_tokens(state)
    found = [
        Measure(Trigger.TOKEN_BUDGET, "prompt tokens", prompt_tokens(state), limits.prompt_trigger)
    ]
    if limits.token_trigger is not None:
        found.append(Measure(Trigger.TOKEN_BUDGET, "history tokens", history, limits.token_trigger))
    if limits.message_trigger is not None:
        unfolded = len(state.unfolded)
        found.append(
            Measure(Trigger.OVERFLOW, "unfolded messages", unfolded, limits.message_trigger)
        )
    for trigger, knob in ((Trigger.HARD_LIMIT, policy.hard_limit), (Trigger.WINDOW, policy.window)):
        if knob is not None:
            found.append(Measure(trigger, "backlog messages", pending, knob, strict=False))
    if policy.safety_user_turns is not None:
        users = sum(1 for m in state.unfolded if m.role == "user" and m.seq > state.turns_mark)
        found.append(
            Measure(Trigger.SAFETY, "user turns", users, policy.safety_user_turns, strict=False)
        )
    if limits.chunk_trigger is not None:
        found.append(Measure(Trigger.CHUNK_SIZE, "history tokens", history, limits.chunk_trigger))
    if policy.cooldown_seconds is not None:
        since = state.last_consolidated_at
        elapsed = float("inf") if since is None else (now - since).total_seconds()
        cooldown = policy.cooldown_seconds
        found.append(
            Measure(
                Trigger.COOLDOWN,
                "seconds since the last fold",
                elapsed,
                cooldown,
                strict=False,
                armed=pending > 0,
            )
        )
    return found


def _triggered(state: ChatState, policy: Policy, now: datetime) -> Trigger | None:
    reached = {measure.trigger for measure in measures(state, policy, now) if measure.reached}
    for trigger in TRIGGER_PRIORITY:
        if trigger in reached and _range_end(state, policy, trigger) > state.last_consolidated:
            return trigger
    return None


# The triggers that guard a hard bound: max_fold_turns (turn-digest's one turn at a time) paces the
# others, but a chat that fell behind near its bound would only fall further behind by a turn per
# fold, and its turns would fold synchronously.
BOUND_TRIGGERS = frozenset({Trigger.TOKEN_BUDGET, Trigger.OVERFLOW})


def _range_end(state: ChatState, policy: Policy, trigger: Trigger) -> int:
    if trigger == Trigger.TOKEN_BUDGET:
        # Background folds keep the verbatim tail: the bound's own check folds into it when
        # nothing else fits.
        end = _token_fold_end(state, policy, compress_end(state, policy))
    else:
        end = compress_end(state, policy)
    if trigger in BOUND_TRIGGERS:
        return end
    return _limit_turns(state, policy, end)


def decide(state: ChatState, policy: Policy, now: datetime) -> Decision | None:
    """At most one fold, for the highest-priority trigger that has a non-empty range."""
    trigger = _triggered(state, policy, now)
    if trigger is None:
        return None
    return _fold(state, trigger, _range_end(state, policy, trigger))


def decide_manual(state: ChatState, policy: Policy) -> Decision | None:
    return _fold(state, Trigger.MANUAL, _limit_turns(state, policy, compress_end(state, policy)))


# --- request path ----------------------------------------------------------------------------


def _within_bound(
    state: ChatState, policy: Policy, boundary: int, summary_tokens: int, new_tokens: int
) -> bool:
    seqs, suffix_tokens = state.suffix_sums
    first_after = bisect_right(seqs, boundary)
    remaining, remaining_tokens = len(seqs) - first_after, suffix_tokens[first_after]
    if policy.context_size is not None and remaining > policy.context_size:
        return False
    bound = token_bound(policy)
    if bound is not None and summary_tokens + state.pinned_tokens + remaining_tokens > bound:
        return False
    prompt = prompt_total(
        state.system_tokens,
        summary_tokens,
        remaining,
        remaining_tokens,
        new_tokens,
        state.pinned_tokens,
    )
    return prompt <= PROMPT_WINDOW_SHARE * state.model_context_tokens


def decide_before_turn(
    state: ChatState, policy: Policy, new_message_tokens: int, *, opens_turn: bool = True
) -> PreTurn:
    """The turn, step 4 (docs/design.md): if the context with the new message is over the hard
    bound, the fold to run synchronously first. ``fits`` is False when even folding everything
    foldable would not fit.

    ``opens_turn``: the new messages start a turn (a user message), so every stored message is
    foldable. When they continue the newest stored turn instead (tool results answering its
    assistant's calls), that turn is not: folding the call would send its results to the model
    with no call before them, which OpenAI-compatible servers refuse."""
    if _within_bound(
        state, policy, state.last_consolidated, state.summary_tokens, new_message_tokens
    ):
        return PreTurn(None, True)
    # After a fold the summary may grow up to its cap: plan with the cap.
    summary_after = max(state.summary_tokens, policy.summary_token_cap)
    candidates = [*boundaries(state), state.last_seq] if opens_turn else boundaries(state)
    for boundary in sorted(set(candidates)):
        if boundary <= state.last_consolidated:
            continue
        if _within_bound(state, policy, boundary, summary_after, new_message_tokens):
            end = max(boundary, _pre_turn_fold_end(state, policy, opens_turn))
            return PreTurn(Decision(Trigger.HARD_BOUND, state.last_consolidated + 1, end), True)
    return PreTurn(None, False)


def _pre_turn_fold_end(state: ChatState, policy: Policy, opens_turn: bool) -> int:
    """How far a synchronous fold goes once the context fits: down to the policy's verbatim tail
    (the contract preset keeps exactly K) or, for a policy with a token budget and no tail
    (token-budget), to the same low-water target as its background folds. Folding down to the newest
    turn instead left one turn of verbatim history."""
    if policy.tail_messages == 0 and policy.tail_turns <= 1 and _has_token_target(policy):
        return _token_fold_end(state, policy, _newest_turn_boundary(state))
    return compress_end(state, policy, keep_newest_turn=not opens_turn)


def _has_token_target(policy: Policy) -> bool:
    return token_bound(policy) is not None or policy.fold_target_tokens is not None
