"""Property tests of the pure engine: random conversations (sizes, tool calls, unanswered calls),
every preset with random valid overrides, clock jumps, failed folds, the offline fallback of a
failed fold, and a fold whose lock lapsed committing after another (the fence: the version and
W it read). After every step: W never decreases, every fold starts at W + 1 and ends on a turn
boundary, every message is either verbatim (seq > W) or folded (seq <= W) exactly once (a
superseded fold writes nothing), and a turn that is accepted sees a context within the policy's
bound."""

import os
from datetime import UTC, datetime, timedelta
from math import inf

import pytest
from hypothesis import HealthCheck, assume, given, settings
from hypothesis import strategies as st
from hypothesis.stateful import RuleBasedStateMachine, initialize, invariant, precondition, rule

from memory_worker.engine.policy import (
    PROMPT_WINDOW_SHARE,
    Decision,
    Policy,
    PreTurn,
    chat_thresholds,
    compress_end,
    decide,
    decide_before_turn,
    thresholds,
    token_budget_exceeded,
)
from memory_worker.engine.presets import PRESETS, PolicyError, resolve_policy, synchronous_only
from memory_worker.engine.state import (
    ChatState,
    Msg,
    after_boundaries,
    history_tokens,
    prompt_tokens,
)
from memory_worker.pinned import pin_room

EXAMPLES = int(os.environ.get("HYPOTHESIS_POLICY_EXAMPLES", "200"))
START = datetime(2026, 1, 1, tzinfo=UTC)
SUMMARY_CAP = 500

OVERRIDES: dict[str, st.SearchStrategy[dict[str, object]]] = {
    "contract": st.fixed_dictionaries(
        {},
        optional={
            "tail_messages": st.integers(0, 8),
            "overflow_buffer": st.integers(1, 6),
            "safety_user_turns": st.integers(1, 12),
        },
    ),
    "sliding-window": st.fixed_dictionaries(
        {},
        optional={
            "tail_messages": st.integers(0, 20),
            "window": st.integers(1, 15),
            "hard_limit": st.integers(1, 40),
            "cooldown_seconds": st.floats(0, 2000),
        },
    ),
    "token-budget": st.fixed_dictionaries(
        {}, optional={"fold_target_tokens": st.integers(0, 3000)}
    ),
    "chunked": st.fixed_dictionaries(
        {}, optional={"tail_turns": st.integers(1, 5), "chunk_threshold": st.integers(500, 8000)}
    ),
    "turn-digest": st.fixed_dictionaries({}, optional={"tail_turns": st.integers(1, 5)}),
}


def history_within_bound(state: ChatState, policy: Policy, new_tokens: int) -> bool:
    if policy.context_size is not None and len(state.unfolded) > policy.context_size:
        return False
    history = state.summary_tokens + state.pinned_tokens + sum(m.tokens for m in state.unfolded)
    bounds = [b for b in (policy.max_memory_tokens, policy.max_tokens) if b is not None]
    if bounds and history > min(bounds):
        return False
    return prompt_tokens(state, new_tokens) <= PROMPT_WINDOW_SHARE * state.model_context_tokens


def all_folded(state: ChatState, policy: Policy) -> ChatState:
    """The smallest context a turn can get: every stored message folded (a new user message
    opens a turn, so all of them are foldable) and the summary at its cap, as the engine plans."""
    return ChatState(
        last_consolidated=state.last_seq,
        last_seq=state.last_seq,
        unfolded=(),
        summary_tokens=max(state.summary_tokens, policy.summary_token_cap),
        system_tokens=state.system_tokens,
        turns_mark=state.turns_mark,
        last_consolidated_at=state.last_consolidated_at,
        model_context_tokens=state.model_context_tokens,
        pinned_tokens=state.pinned_tokens,
    )


def pending_backlog(messages: list[Msg], w: int, policy: Policy) -> int:
    """compress_end - W by its definition (policy.py), recounted here: the last turn boundary
    after W that keeps ``tail_messages`` messages and at least ``max(tail_turns, 1)`` turns."""
    last_seq = len(messages)
    min_turns = max(policy.tail_turns, 1)
    users_after = 0
    end = w
    for message in reversed(messages[w:]):
        if message.role != "user":
            continue
        users_after += 1
        boundary = message.seq - 1
        if last_seq - boundary >= policy.tail_messages and users_after >= min_turns:
            end = boundary
            break
    return end - w


def triggers_holding(
    state: ChatState, messages: list[Msg], policy: Policy, now: datetime
) -> list[str]:
    """The background triggers (policy.py's definitions) whose condition holds with something
    to fold: each would make decide() return a fold. Every trigger but the token budget folds up
    to compress_end, a range once the backlog is positive (max_fold_turns >= 1 always allows
    the oldest turn: W is a turn boundary). The token budget folds toward its low-water target,
    which the whole unfolded history is over whenever the budget is exceeded in these policies
    and windows, and a positive backlog means two unfolded turns: a range too."""
    pending = pending_backlog(messages, state.last_consolidated, policy)
    if pending <= 0:
        return []
    last_at = state.last_consolidated_at
    limits = chat_thresholds(state, policy)
    checks = {
        "token_budget": token_budget_exceeded(state, policy),
        "overflow": limits.message_trigger is not None
        and len(state.unfolded) > limits.message_trigger,
        "hard_limit": policy.hard_limit is not None and pending >= policy.hard_limit,
        "window": policy.window is not None and pending >= policy.window,
        "safety": policy.safety_user_turns is not None
        and sum(1 for m in state.unfolded if m.role == "user" and m.seq > state.turns_mark)
        >= policy.safety_user_turns,
        "chunk_size": limits.chunk_trigger is not None
        and history_tokens(state) > limits.chunk_trigger,
        "cooldown": policy.cooldown_seconds is not None
        and (last_at is None or (now - last_at).total_seconds() >= policy.cooldown_seconds),
    }
    return [trigger for trigger, holds in checks.items() if holds]


class Conversation(RuleBasedStateMachine):
    def __init__(self) -> None:
        super().__init__()
        self.messages: list[Msg] = []
        self.w = 0
        self.summary_tokens = 0
        self.turns_mark = 0
        self.now = START
        self.last_at: datetime | None = None
        self.policy = PRESETS["sliding-window"]
        self.window = 100_000
        self.highest_w = 0
        # Every seq a fold carried to the summarizer, kept apart from W: what the engine's
        # ranges actually covered, not what W implies.
        self.folded: set[int] = set()
        # The brief's fencing token, and whether its summary is the offline fallback's.
        self.version = 0
        self.fallback = False
        # A fold decided and started whose lock then lapsed: (decision, version and W it read).
        self.stale: tuple[Decision, int, int] | None = None
        # The pinned block's tokens: in every context, counted in the bound like the summary.
        self.pinned = 0

    @initialize(data=st.data(), name=st.sampled_from(sorted(PRESETS)))
    def choose_policy(self, data: st.DataObject, name: str) -> None:
        overrides: dict[str, object] = data.draw(OVERRIDES[name])
        self.policy = resolve_policy(name, overrides)
        self.window = data.draw(st.sampled_from([4_000, 16_000, 128_000]))

    def state(self) -> ChatState:
        return ChatState(
            last_consolidated=self.w,
            last_seq=len(self.messages),
            unfolded=tuple(m for m in self.messages if m.seq > self.w),
            summary_tokens=self.summary_tokens,
            system_tokens=30,
            turns_mark=self.turns_mark,
            last_consolidated_at=self.last_at or START,
            model_context_tokens=self.window,
            pinned_tokens=self.pinned,
        )

    def check_fold(self, decision: Decision, *, pre_turn: bool) -> None:
        assert decision.from_seq == self.w + 1
        assert decision.from_seq <= decision.to_seq <= len(self.messages)
        if decision.to_seq < len(self.messages):
            assert self.messages[decision.to_seq].role == "user", "a fold split a turn"
        else:
            assert pre_turn, "a background fold took the newest turn"

    def apply(self, decision: Decision, *, fallback: bool = False) -> None:
        """A fold decided on the current state, committed (by the model, or by the offline
        summarizer after the model failed it: the same range)."""
        assert self.commit(decision, self.version, self.w, fallback=fallback)

    def commit(self, decision: Decision, version: int, w: int, *, fallback: bool) -> bool:
        """folding.commit's fenced UPDATE: only a fold that read this version and W commits."""
        if (version, w) != (self.version, self.w):
            return False
        carried = set(range(decision.from_seq, decision.to_seq + 1))
        assert not carried & self.folded, "a message was folded twice"
        self.folded |= carried
        self.w = decision.to_seq
        self.version += 1
        self.fallback = fallback
        self.summary_tokens = SUMMARY_CAP // 2 + len(self.messages) % (SUMMARY_CAP // 2)
        self.turns_mark = len(self.messages)
        self.last_at = self.now
        return True

    @rule(
        user_tokens=st.integers(1, 1500),
        reply_tokens=st.integers(1, 1500),
        tool_calls=st.integers(0, 2),
        unanswered=st.booleans(),
        fold_fails=st.booleans(),
        fallback_fails=st.booleans(),
    )
    def turn(
        self,
        user_tokens: int,
        reply_tokens: int,
        tool_calls: int,
        unanswered: bool,
        fold_fails: bool,
        fallback_fails: bool,
    ) -> None:
        state = self.state()
        pre = decide_before_turn(state, self.policy, user_tokens)
        if not pre.fits:
            # Refused with a 503 (nothing stored, nothing dropped): only when even folding
            # everything foldable, the summary at its cap, leaves no room for the new message.
            # A machine that refuses every turn fails here on its first one.
            assert not history_within_bound(state, self.policy, user_tokens), "refused, fits"
            assert not history_within_bound(
                all_folded(state, self.policy), self.policy, user_tokens
            ), "refused a turn that fits once everything is folded"
            return
        if pre.fold is not None:
            self.check_fold(pre.fold, pre_turn=True)
            if fold_fails and fallback_fails:
                return  # the model and the offline fallback both failed: the turn is refused
            # A failed model fold falls back to the offline summarizer over the same range.
            self.apply(pre.fold, fallback=fold_fails)
        assert history_within_bound(self.state(), self.policy, user_tokens)
        seq = len(self.messages)
        turn_messages = [Msg(seq + 1, "user", user_tokens)]
        for _ in range(tool_calls):
            turn_messages.append(Msg(seq + len(turn_messages) + 1, "assistant", 20))
            turn_messages.append(Msg(seq + len(turn_messages) + 1, "tool", 40))
        if unanswered:
            turn_messages.append(Msg(seq + len(turn_messages) + 1, "assistant", 20))
        else:
            turn_messages.append(Msg(seq + len(turn_messages) + 1, "assistant", reply_tokens))
        self.messages.extend(turn_messages)

    @rule(tokens=st.integers(1, 3000))
    def pin(self, tokens: int) -> None:
        """A pin the service takes only within the room the policy keeps for pins."""
        if self.pinned + tokens <= pin_room(self.state(), self.policy):
            self.pinned += tokens

    @rule()
    def unpin_everything(self) -> None:
        self.pinned = 0

    @rule(fails=st.booleans(), falls_back=st.booleans())
    def background(self, fails: bool, falls_back: bool) -> None:
        """A background fold; one the model failed commits the offline summary of the same
        range when the operator's fallback is on (``falls_back``), else nothing."""
        state = self.state()
        decision = decide(state, self.policy, self.now)
        if decision is None:
            holding = triggers_holding(state, self.messages, self.policy, self.now)
            assert not holding, f"no fold, yet {holding} hold(s) with a backlog"
            return
        self.check_fold(decision, pre_turn=False)
        if not fails or falls_back:
            self.apply(decision, fallback=fails)

    @precondition(lambda self: self.stale is None)
    @rule()
    def start_fold_whose_lock_lapses(self) -> None:
        """A background fold reads the state and starts summarizing; its lock lapses (a stuck
        worker), so other folds may commit before it comes back."""
        decision = decide(self.state(), self.policy, self.now)
        if decision is not None:
            self.check_fold(decision, pre_turn=False)
            self.stale = (decision, self.version, self.w)

    @precondition(lambda self: self.stale is not None)
    @rule(fallback=st.booleans())
    def lapsed_fold_commits(self, fallback: bool) -> None:
        """The fold whose lock lapsed commits at last: only if nothing committed since it read
        (then its range still starts at W + 1); otherwise the fence refuses it, and nothing of
        it is written."""
        assert self.stale is not None
        decision, version, w = self.stale
        self.stale = None
        moved = version != self.version
        before = (self.w, self.version, set(self.folded))
        committed = self.commit(decision, version, w, fallback=fallback)
        assert committed is not moved
        if not committed:
            assert (self.w, self.version, self.folded) == before, "a superseded fold wrote"

    @precondition(lambda self: self.messages)
    @rule(seconds=st.integers(0, 3600))
    def clock(self, seconds: int) -> None:
        self.now += timedelta(seconds=seconds)

    @invariant()
    def every_message_is_verbatim_or_folded(self) -> None:
        """Exactly one of: in the context (the unfolded messages the engine judged), or carried
        by a fold that was applied. A range that skipped a message (a gap) or that ended past
        W would show here."""
        state = self.state()
        verbatim = {m.seq for m in state.unfolded}
        for message in self.messages:
            assert (message.seq in verbatim) != (message.seq in self.folded), message

    @invariant()
    def a_fallback_summary_covers_what_a_fold_committed(self) -> None:
        assert not self.fallback or (self.version > 0 and self.w > 0)

    @invariant()
    def watermark_never_decreases(self) -> None:
        assert self.w >= self.highest_w
        self.highest_w = self.w

    @invariant()
    def watermark_is_a_turn_boundary(self) -> None:
        assert 0 <= self.w <= len(self.messages)
        if 0 < self.w < len(self.messages):
            assert self.messages[self.w].role == "user"


@pytest.mark.parametrize("name", sorted(PRESETS))
def test_a_small_first_turn_is_accepted_as_it_is(name: str) -> None:
    """An engine that refuses turns is no safer: a new chat's short first message fits every
    preset, with nothing to fold."""
    empty = ChatState(
        last_consolidated=0,
        last_seq=0,
        unfolded=(),
        summary_tokens=0,
        system_tokens=30,
        turns_mark=0,
        last_consolidated_at=None,
        model_context_tokens=4_000,
    )
    assert decide_before_turn(empty, PRESETS[name], 10) == PreTurn(None, True)


Conversation.TestCase.settings = settings(
    max_examples=EXAMPLES,
    stateful_step_count=50,
    deadline=None,
    suppress_health_check=[HealthCheck.too_slow],
)
TestConversation = Conversation.TestCase


@st.composite
def chat_states(draw: st.DrawFn) -> ChatState:
    """Unfolded messages after W with any roles (a chat may open with a non-user message, turns
    may hold tool calls), listed in any order."""
    watermark = draw(st.integers(0, 30))
    roles = draw(st.lists(st.sampled_from(["user", "assistant", "tool", "system"]), max_size=40))
    messages = [
        Msg(watermark + offset, role, draw(st.integers(0, 900)))
        for offset, role in enumerate(roles, start=1)
    ]
    return ChatState(
        last_consolidated=watermark,
        last_seq=watermark + len(messages),
        unfolded=tuple(draw(st.permutations(messages))),
        summary_tokens=0,
        system_tokens=0,
        turns_mark=0,
        last_consolidated_at=None,
        model_context_tokens=128_000,
    )


@settings(max_examples=EXAMPLES, deadline=None)
@given(chat_states())
def test_after_boundaries_is_the_recount_at_every_boundary(state: ChatState) -> None:
    """The one-pass table equals the definition: boundaries are W and the seq before every user
    message; after each, the user messages and tokens with a greater seq."""
    watermark = state.last_consolidated
    expected_boundaries = sorted(
        {watermark} | {m.seq - 1 for m in state.unfolded if m.role == "user"}
    )
    table = after_boundaries(state)
    assert list(table) == expected_boundaries
    for boundary, after in table.items():
        later = [m for m in state.unfolded if m.seq > boundary]
        assert after.users == sum(1 for m in later if m.role == "user")
        assert after.tokens == sum(m.tokens for m in later)


# --- headroom (docs/policies.md) -------------------------------------------------------------

HEADROOM_OVERRIDES: dict[str, st.SearchStrategy[dict[str, object]]] = {
    **OVERRIDES,
    "token-budget": st.fixed_dictionaries(
        {},
        optional={
            "max_tokens": st.integers(1000, 20_000),
            "max_summary_tokens": st.integers(64, 900),
            "fold_target_tokens": st.integers(0, 6000),
        },
    ),
}


@st.composite
def accepted_policies(draw: st.DrawFn) -> Policy:
    """A policy chat creation accepts: valid, and with headroom below every bound."""
    name = draw(st.sampled_from(sorted(PRESETS)))
    overrides: dict[str, object] = {**draw(HEADROOM_OVERRIDES[name])}
    overrides["headroom_turns"] = draw(st.integers(1, 6))
    try:
        policy = resolve_policy(name, overrides)
    except PolicyError:
        assume(False)
        raise
    assume(synchronous_only(policy) is None)
    return policy


@settings(max_examples=EXAMPLES, deadline=None)
@given(
    policy=accepted_policies(),
    turn_tokens=st.floats(0, 20_000),
    turn_messages=st.floats(0, 12),
    window=st.sampled_from([4_000, 16_000, 128_000]),
)
def test_each_background_threshold_lies_below_its_bound_by_the_reserve(
    policy: Policy, turn_tokens: float, turn_messages: float, window: int
) -> None:
    """The reserve is headroom_turns turns of the chat's size (a floor of 1/16 of the bound
    each), at most half the bound; every threshold sits at least the reserve below its bound,
    and the fold target below the thresholds (hysteresis)."""
    limits = thresholds(policy, window, turn_tokens, turn_messages)
    turns = policy.headroom_turns
    if limits.token_bound is not None:
        bound = limits.token_bound
        wanted = turns * max(turn_tokens, bound / 16)
        assert limits.token_reserve >= min(wanted, bound // 2)
        assert limits.token_trigger is not None
        assert limits.token_trigger <= bound - limits.token_reserve
        assert limits.chunk_trigger is None or limits.chunk_trigger <= bound - limits.token_reserve
        assert limits.fold_target <= limits.token_trigger
    if limits.message_bound is not None:
        wanted_messages = turns * max(turn_messages, 2)
        assert limits.message_reserve >= min(wanted_messages, limits.message_bound // 2)
        assert limits.message_trigger is not None
        assert limits.message_trigger <= limits.message_bound - limits.message_reserve
    assert limits.prompt_trigger <= limits.prompt_bound - limits.prompt_reserve
    assert limits.fold_target <= limits.prompt_trigger
    if policy.fold_target_tokens is None:
        assert limits.fold_target <= min(limits.prompt_trigger, limits.token_trigger or inf) // 2


@st.composite
def conversations(draw: st.DrawFn, policy: Policy) -> ChatState:
    """Whole turns (a user message and a reply, sometimes tool calls) after W, with a summary."""
    watermark = draw(st.integers(0, 20)) * 2
    messages: list[Msg] = []
    for _ in range(draw(st.integers(0, 40))):
        seq = watermark + len(messages)
        messages.append(Msg(seq + 1, "user", draw(st.integers(1, 900))))
        if draw(st.booleans()):
            messages.append(Msg(seq + 2, "assistant", 20))
            messages.append(Msg(seq + 3, "tool", draw(st.integers(1, 400))))
        messages.append(Msg(watermark + len(messages) + 1, "assistant", draw(st.integers(1, 2500))))
    return ChatState(
        last_consolidated=watermark,
        last_seq=watermark + len(messages),
        unfolded=tuple(messages),
        summary_tokens=draw(st.integers(0, policy.summary_token_cap)) if watermark else 0,
        system_tokens=30,
        turns_mark=watermark,
        last_consolidated_at=START,
        model_context_tokens=draw(st.sampled_from([16_000, 128_000])),
    )


@settings(max_examples=EXAMPLES, deadline=None)
@given(data=st.data(), policy=accepted_policies())
def test_a_background_token_fold_leaves_the_history_at_or_under_its_target(
    data: st.DataObject, policy: Policy
) -> None:
    """Hysteresis: a token-budget fold takes the oldest turns until the rest, with the summary
    at its reserve, fits the fold target; only the verbatim tail (the newest turn at least)
    may keep it above, never max_fold_turns (a pace, not a limit near the bound)."""
    state = data.draw(conversations(policy))
    decision = decide(state, policy, START)
    assume(decision is not None and decision.trigger == "token_budget")
    assert decision is not None
    rest = sum(m.tokens for m in state.unfolded if m.seq > decision.to_seq)
    reserve = max(policy.max_summary_tokens, state.summary_tokens)
    target = chat_thresholds(state, policy).fold_target
    assert reserve + rest <= target or decision.to_seq == compress_end(state, policy)


@settings(max_examples=EXAMPLES, deadline=None)
@given(data=st.data(), policy=accepted_policies())
def test_a_chat_under_its_thresholds_takes_a_turn_within_its_reserve_without_folding(
    data: st.DataObject, policy: Policy
) -> None:
    """What the headroom is for: while no threshold is passed, a new message that fits in the
    reserve needs no synchronous fold (the turn that comes while a fold runs still fits)."""
    state = data.draw(conversations(policy))
    limits = chat_thresholds(state, policy)
    assume(prompt_tokens(state) <= limits.prompt_trigger)
    assume(limits.token_trigger is None or history_tokens(state) <= limits.token_trigger)
    assume(limits.message_trigger is None or len(state.unfolded) <= limits.message_trigger)
    new_tokens = data.draw(st.integers(1, max(1, limits.prompt_reserve - 4)))
    assume(new_tokens + 4 <= limits.prompt_reserve)
    assert decide_before_turn(state, policy, new_tokens) == PreTurn(None, True)


def test_a_token_fold_whose_history_fits_its_target_while_the_prompt_is_over_still_folds() -> None:
    """Found by the state machine: a target a user set just under the trigger (2,435 against a
    prompt trigger of 2,498) is met by the history alone while the prompt, with its overhead,
    is over the trigger. The fold that fired takes the oldest turn instead of nothing."""
    machine = Conversation()
    machine.policy = resolve_policy("token-budget", {"fold_target_tokens": 2435})
    machine.window = 4_000
    for _ in range(4):
        machine.background(fails=False, falls_back=False)
    sizes = [(388, 1, 1, False), (1500, 403, 0, False)]
    for user_tokens, reply_tokens, tool_calls, unanswered in sizes:
        machine.turn(
            fallback_fails=False,
            fold_fails=False,
            reply_tokens=reply_tokens,
            tool_calls=tool_calls,
            unanswered=unanswered,
            user_tokens=user_tokens,
        )
    machine.background(fails=False, falls_back=False)
    machine.turn(
        fallback_fails=False,
        fold_fails=False,
        reply_tokens=1,
        tool_calls=1,
        unanswered=True,
        user_tokens=196,
    )
    before = machine.w
    machine.background(fails=False, falls_back=False)  # asserted a fold before the fix
    assert machine.w > before
