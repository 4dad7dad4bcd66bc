"""Table tests for the pure policy engine, replaying the examples of the requirement each preset
follows (docs/policies.md)."""

from datetime import UTC, datetime, timedelta

import pytest

from memory_worker.engine.policy import (
    Decision,
    Policy,
    Trigger,
    chat_thresholds,
    decide,
    decide_before_turn,
    decide_manual,
    thresholds,
)
from memory_worker.engine.presets import PRESETS, PolicyError, policy_parameters, resolve_policy
from memory_worker.engine.state import ChatState, Msg, prompt_tokens
from memory_worker.engine.turn_groups import split_for_summarizer

NOW = datetime(2026, 11, 22, 12, 0, tzinfo=UTC)
BIG_WINDOW = 1_000_000


def alternating(count: int, tokens: int = 10, start: int = 1) -> list[Msg]:
    return [
        Msg(seq, "user" if seq % 2 == 1 else "assistant", tokens)
        for seq in range(start, start + count)
    ]


def state_of(
    messages: list[Msg],
    w: int = 0,
    *,
    summary_tokens: int = 0,
    turns_mark: int = 0,
    last_at: datetime | None = NOW,
    window: int = BIG_WINDOW,
) -> ChatState:
    return ChatState(
        last_consolidated=w,
        last_seq=messages[-1].seq if messages else w,
        unfolded=tuple(m for m in messages if m.seq > w),
        summary_tokens=summary_tokens,
        system_tokens=20,
        turns_mark=turns_mark,
        last_consolidated_at=last_at,
        model_context_tokens=window,
    )


def replay(policy: Policy, total: int, tokens: int = 10) -> list[tuple[int, Decision]]:
    """Add alternating messages one at a time, deciding after each and applying every fold;
    returns (message count, decision) for each fold."""
    messages: list[Msg] = []
    w, folds = 0, []
    for seq in range(1, total + 1):
        messages.append(Msg(seq, "user" if seq % 2 else "assistant", tokens))
        decision = decide(state_of(messages, w), policy, NOW)
        if decision is not None:
            folds.append((seq, decision))
            w = decision.to_seq
    return folds


# --- sliding-window -------------------------------------------------------------------------


def test_seed_001_window_rhythm_12_then_reset_then_12() -> None:
    folds = replay(PRESETS["sliding-window"], 90)
    assert [(at, d.trigger, d.from_seq, d.to_seq) for at, d in folds] == [
        (52, "window", 1, 12),
        (64, "window", 13, 24),
        (76, "window", 25, 36),
        (88, "window", 37, 48),
    ]


def test_seed_001_hard_limit_30_when_the_window_is_off() -> None:
    policy = resolve_policy("sliding-window", {"window": None, "cooldown_seconds": None})
    folds = replay(policy, 80)
    assert [(at, d.trigger, d.from_seq, d.to_seq) for at, d in folds] == [(70, "hard_limit", 1, 30)]


def test_seed_001_cooldown_900_seconds() -> None:
    policy = PRESETS["sliding-window"]
    messages = alternating(42)  # backlog 2 beyond the 40-message tail
    due = decide(state_of(messages, last_at=NOW - timedelta(seconds=900)), policy, NOW)
    assert due == Decision(Trigger.COOLDOWN, 1, 2)
    early = state_of(messages, last_at=NOW - timedelta(seconds=899))
    assert decide(early, policy, NOW) is None
    nothing_to_fold = state_of(alternating(40), last_at=NOW - timedelta(days=1))
    assert decide(nothing_to_fold, policy, NOW) is None


def test_seed_001_bound_is_context_size_75() -> None:
    policy = PRESETS["sliding-window"]
    behind = state_of(alternating(76))  # background folding fell behind
    pre = decide_before_turn(behind, policy, new_message_tokens=10)
    assert pre.fits and pre.fold is not None
    assert pre.fold.trigger == "hard_bound"
    assert pre.fold.from_seq == 1
    assert 76 - pre.fold.to_seq <= 75
    within = decide_before_turn(state_of(alternating(75)), policy, new_message_tokens=10)
    assert within.fold is None and within.fits


# --- contract: K + B ------------------------------------------------------------------------


def test_seed_000_overflow_folds_and_keeps_exactly_k() -> None:
    """K + B = 10 is the bound; the overflow fold starts one turn below it (the preset's
    headroom), so the turn that comes while it runs still fits, and keeps exactly K."""
    policy = PRESETS["contract"]
    assert decide(state_of(alternating(8)), policy, NOW) is None
    folded = decide(state_of(alternating(10)), policy, NOW)
    assert folded == Decision(Trigger.OVERFLOW, 1, 4)  # 10 - 4 = exactly K = 6 remain verbatim
    # The 9th message is a user message: keeping exactly 6 would split its turn, so the cut
    # moves back to the turn boundary and 7 (>= K) stay.
    assert decide(state_of(alternating(9)), policy, NOW) == Decision(Trigger.OVERFLOW, 1, 2)
    # Without the headroom (the seed's literal rule) the fold would wait for 11: K + B less one
    # turn of two messages.
    assert thresholds(policy, BIG_WINDOW).message_trigger == 10 - 2


def test_seed_000_priority_token_over_overflow_over_safety() -> None:
    policy = PRESETS["contract"]
    messages = alternating(24, tokens=100)  # 12 user turns: overflow and safety both true
    assert decide(state_of(messages), policy, NOW).trigger == "overflow"  # type: ignore[union-attr]
    small_window = state_of(messages, window=2000)  # prompt > 70 % of 2,000 tokens
    assert decide(small_window, policy, NOW).trigger == "token_budget"  # type: ignore[union-attr]
    no_overflow = resolve_policy("contract", {"overflow_buffer": 100, "context_size": None})
    assert decide(state_of(messages), no_overflow, NOW).trigger == "safety"  # type: ignore[union-attr]


def test_seed_000_safety_counts_user_messages_only() -> None:
    policy = resolve_policy("contract", {"overflow_buffer": 1000, "context_size": None})
    ten_users = alternating(20)  # 10 user turns = 20 messages
    assert decide(state_of(ten_users), policy, NOW) == Decision(Trigger.SAFETY, 1, 14)
    nine_users = alternating(18)
    assert decide(state_of(nine_users), policy, NOW) is None
    # Tool traffic adds messages, not user turns.
    with_tools = [
        *alternating(18),
        Msg(19, "assistant", 5),
        Msg(20, "tool", 5),
        Msg(21, "assistant", 5),
    ]
    assert decide(state_of(with_tools), policy, NOW) is None
    # Only user messages after the last fold's mark count.
    assert decide(state_of(ten_users, turns_mark=2), policy, NOW) is None


# --- token-budget ---------------------------------------------------------------------------


def test_seed_002_folds_below_its_bound_down_to_its_target() -> None:
    """token-budget's history bound is max_tokens; the fold starts a turn of the chat's size below
    it (at least 1/16 of the bound: the fixed max_summary_tokens offset is replaced) and folds the
    oldest turns until the rest, the summary's reserve with it, fits the fold target (hysteresis:
    the next fold is several turns away)."""
    policy = PRESETS["token-budget"]  # max_tokens 4000, max_summary_tokens 256
    five = alternating(10, tokens=250)  # 2,500 tokens
    limits = chat_thresholds(state_of(five), policy)
    assert limits.token_trigger == 4000 - (500 + 8)  # a turn of 508 tokens
    small_turns = chat_thresholds(state_of(alternating(4, tokens=100)), policy)
    assert small_turns.token_trigger == 4000 - 4000 // 16  # the floor: turns of 208 < 250
    assert decide(state_of(five), policy, NOW) is None
    seven = alternating(14, tokens=250)  # 3,500 tokens > 3,492
    decision = decide(state_of(seven), policy, NOW)
    assert decision is not None and decision.trigger == "token_budget"
    rest = sum(m.tokens for m in seven if m.seq > decision.to_seq)
    target = limits.fold_target
    assert rest + 256 <= target
    # The oldest are folded first, and no more than needed (one turn less would not fit).
    assert rest + 500 + 256 > target


def test_seed_002_fold_target_is_a_knob() -> None:
    policy = resolve_policy("token-budget", {"fold_target_tokens": 1000})
    decision = decide(state_of(alternating(16, tokens=250)), policy, NOW)
    assert decision is not None
    assert sum(m.tokens for m in alternating(16, 250) if m.seq > decision.to_seq) + 256 <= 1000


# --- chunked, turn based --------------------------------------------------------------------


def test_seed_003_k_three_turns_with_threshold() -> None:
    policy = PRESETS["chunked"]  # K = 3 turns, threshold 6,000
    under = alternating(12, tokens=450)  # 6 turns, 5,400 tokens
    assert decide(state_of(under), policy, NOW) is None
    over = alternating(14, tokens=450)  # 7 turns, 6,300 tokens
    assert decide(state_of(over), policy, NOW) == Decision(Trigger.CHUNK_SIZE, 1, 8)  # keep 3 turns
    # Over the threshold but only K turns buffered: olderPart is empty, nothing to fold.
    three_big = alternating(6, tokens=1100)
    assert decide(state_of(three_big), policy, NOW) is None


# --- turn-digest ----------------------------------------------------------------------------


def test_seed_004_one_turn_at_a_time_beyond_three() -> None:
    policy = PRESETS["turn-digest"]
    messages = alternating(10)  # 5 turns
    first = decide(state_of(messages), policy, NOW)
    assert first == Decision(Trigger.WINDOW, 1, 2)
    second = decide(state_of(messages, w=2), policy, NOW)
    assert second == Decision(Trigger.WINDOW, 3, 4)
    assert decide(state_of(messages, w=4), policy, NOW) is None  # 3 full-detail turns remain


# --- turn boundaries ------------------------------------------------------------------------


def test_tool_calls_are_never_split_from_their_turn() -> None:
    policy = resolve_policy("sliding-window", {"tail_messages": 2, "window": 1})
    messages = [
        Msg(1, "user", 5),
        Msg(2, "assistant", 5),  # tool call
        Msg(3, "tool", 5),
        Msg(4, "assistant", 5),
        Msg(5, "user", 5),
        Msg(6, "assistant", 5),  # tool call never answered
        Msg(7, "user", 5),
        Msg(8, "assistant", 5),
    ]
    decision = decide(state_of(messages), policy, NOW)
    assert decision == Decision(Trigger.WINDOW, 1, 6)
    keep_four = resolve_policy("sliding-window", {"tail_messages": 4})
    assert decide_manual(state_of(messages), keep_four) == Decision(Trigger.MANUAL, 1, 4)
    # Keeping 5 would need a cut inside the tool turn (after seq 3): nothing is folded instead.
    keep_five = resolve_policy("sliding-window", {"tail_messages": 5})
    assert decide_manual(state_of(messages), keep_five) is None


def test_decide_before_turn_refuses_what_cannot_fit() -> None:
    policy = PRESETS["contract"]
    state = state_of(alternating(4), window=1000)
    assert not decide_before_turn(state, policy, new_message_tokens=950).fits
    assert decide_before_turn(state, policy, new_message_tokens=100).fits


def test_prompt_tokens_counts_everything() -> None:
    state = state_of(alternating(2, tokens=10), summary_tokens=30)
    # priming 3 + system (20 + 4) + summary (30 + 4) + 2 messages (10 + 4) + new (7 + 4)
    assert prompt_tokens(state, 7) == 3 + 24 + 34 + 28 + 11


def test_split_for_summarizer_cuts_at_turns_and_never_trims() -> None:
    messages = [*alternating(6, tokens=100), Msg(7, "user", 900), Msg(8, "assistant", 900)]
    assert split_for_summarizer(messages, 400) == [(1, 4), (5, 6), (7, 8)]
    assert split_for_summarizer(messages, 10_000) == [(1, 8)]
    assert split_for_summarizer([], 100) == []


# --- presets and overrides ------------------------------------------------------------------


def test_presets_carry_the_seeds_defaults() -> None:
    contract = policy_parameters(PRESETS["contract"])
    assert (contract["tail_messages"], contract["overflow_buffer"]) == (6, 4)
    assert (contract["token_budget_fraction"], contract["safety_user_turns"]) == (0.7, 10)
    window = policy_parameters(PRESETS["sliding-window"])
    assert (window["context_size"], window["tail_messages"], window["window"]) == (75, 40, 12)
    assert (window["cooldown_seconds"], window["hard_limit"]) == (900.0, 30)
    assert policy_parameters(PRESETS["token-budget"])["max_summary_tokens"] == 256
    assert (PRESETS["chunked"].tail_turns, PRESETS["chunked"].chunk_threshold) == (3, 6000)
    assert (PRESETS["turn-digest"].tail_turns, PRESETS["turn-digest"].max_fold_turns) == (3, 1)


@pytest.mark.parametrize(
    ("name", "overrides", "message"),
    [
        ("nope", {}, 'Unknown policy "nope"'),
        ("contract", {"K": 3}, 'Unknown knob "K"'),
        ("contract", {"tail_messages": "6"}, "must be an integer"),
        ("contract", {"tail_messages": True}, "got a boolean"),
        ("contract", {"tail_messages": 2.5}, "must be an integer"),
        ("contract", {"tail_messages": -1}, "at least 0"),
        ("contract", {"window": 0}, "at least 1"),
        ("contract", {"token_budget_fraction": 1.5}, "(0, 1]"),
        ("sliding-window", {"tail_messages": 75}, "must be less than context_size"),
        ("token-budget", {"max_summary_tokens": 4000}, "must be less than max_tokens"),
        ("sliding-window", {"summary_token_cap": None}, "cannot be null"),
    ],
)
def test_resolve_policy_explains_what_is_wrong(
    name: str, overrides: dict[str, object], message: str
) -> None:
    with pytest.raises(PolicyError, match=message.replace("(", r"\(").replace(")", r"\)")):
        resolve_policy(name, overrides)


def test_overrides_apply() -> None:
    policy = resolve_policy("sliding-window", {"window": 6, "cooldown_seconds": 60})
    assert (policy.window, policy.cooldown_seconds, policy.tail_messages) == (6, 60.0, 40)


def tool_loop(turns: int, calls: int, tokens: int) -> list[Msg]:
    """``turns`` plain turns, then a user message answered by ``calls`` rounds of an assistant's
    tool call and its result, ending on an assistant call still waiting for its result."""
    messages = alternating(2 * turns, tokens)
    seq = len(messages) + 1
    messages.append(Msg(seq, "user", tokens))
    for _ in range(calls):
        messages += [Msg(seq + 1, "assistant", tokens), Msg(seq + 2, "tool", tokens)]
        seq += 2
    messages.append(Msg(seq + 1, "assistant", tokens))
    return messages


@pytest.mark.parametrize("preset", sorted(PRESETS))
def test_a_fold_before_tool_results_keeps_the_turn_they_continue(preset: str) -> None:
    """The new messages are tool results for the newest stored turn's last call: folding that
    turn (its calls) would send the results with no call before them, which the model refuses.
    When even that turn alone does not fit, the turn cannot be taken (503), where a user
    message could still go ahead with everything stored folded."""
    messages = tool_loop(turns=40, calls=3, tokens=60)  # the newest turn: 8 messages, 480 tokens
    newest_user = max(m.seq for m in messages if m.role == "user")
    policy = PRESETS[preset]
    # 1,980 tokens of prompt: the newest turn fits beside a full summary, the history does not.
    state = state_of(messages, window=2200)
    pre = decide_before_turn(state, policy, new_message_tokens=60, opens_turn=False)
    assert pre.fits and pre.fold is not None
    assert pre.fold.to_seq < newest_user
    # 900 tokens: not even the newest turn fits beside a full summary.
    small = state_of(messages, window=1000)
    assert not decide_before_turn(small, policy, new_message_tokens=60, opens_turn=False).fits
    opening = decide_before_turn(small, policy, new_message_tokens=60)
    assert opening.fold is not None and opening.fold.to_seq == messages[-1].seq


def test_a_token_budget_fold_before_a_turn_stops_at_its_low_water_mark() -> None:
    """A synchronous fold of token-budget goes down to the same fold target as a background one;
    folding only down to the newest turn left one turn of verbatim history."""
    policy = PRESETS["token-budget"]  # bound 4,000 tokens of history
    messages = alternating(40, tokens=102)  # 4,080 tokens
    pre = decide_before_turn(state_of(messages), policy, new_message_tokens=10)
    assert pre.fold is not None
    kept = sum(m.tokens for m in messages if m.seq > pre.fold.to_seq)
    target = chat_thresholds(state_of(messages), policy).fold_target
    assert target - 2 * 102 < kept + policy.max_summary_tokens <= target
