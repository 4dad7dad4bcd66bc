"""bench.prompt_cache: what a prefix cache could serve of a chat's consecutive prompts."""

from __future__ import annotations

from bench.cost import build_workload, reply_tag, user_tag
from bench.prompt_cache import (
    TAG,
    cache_figures,
    common_prefix_tokens,
    dropped_without_fold,
    message_tokens,
    not_extending,
)

SYSTEM = {"role": "system", "content": "Answer as a cellist would. " * 300}


def turn(number: int) -> list[dict[str, str]]:
    return [
        {"role": "user", "content": f"question {number}"},
        {"role": "assistant", "content": f"answer {number}"},
    ]


def test_prompts_that_only_grow_at_their_end_are_cached_but_their_last_turn() -> None:
    prompts = [[SYSTEM, *turn(1)[:1]], [SYSTEM, *turn(1), *turn(2)[:1]]]
    figures = cache_figures(prompts)
    common = message_tokens(SYSTEM) + message_tokens(turn(1)[0])
    assert common_prefix_tokens(prompts[0], prompts[1]) == common
    assert figures.common_tokens == common and figures.miss_turns == 0
    assert figures.cached_tokens >= 1024 and (figures.cached_tokens - 1024) % 128 == 0
    assert figures.billed_per_turn < figures.prompt_tokens / figures.turns


def test_a_new_summary_above_the_verbatim_messages_loses_the_prefix_below_it() -> None:
    summary = {"role": "system", "content": "Summary: cello, June recital."}
    changed = {"role": "system", "content": "Summary: cello, June recital, vibrato."}
    prompts = [
        [SYSTEM, summary, *turn(1)[:1]],
        [SYSTEM, summary, *turn(1), *turn(2)[:1]],
        [SYSTEM, changed, *turn(2)[:1]],  # a fold: a new summary, turn 1 folded
    ]
    figures = cache_figures(prompts)
    assert figures.miss_turns == 1
    assert 0 < figures.between_folds_share < 1 and figures.exact_share < 1


def test_a_prompt_that_does_not_begin_with_the_whole_previous_one_is_counted() -> None:
    grown = [[SYSTEM, *turn(1)[:1]], [SYSTEM, *turn(1), *turn(2)[:1]]]
    slid = [*grown, [SYSTEM, *turn(2)]]  # the window's start moved: turn 1 left
    assert not_extending(grown) == 0
    assert not_extending(slid) == 1


def test_a_message_gone_from_the_context_counts_as_dropped_unless_a_summarizer_was_given_it() -> (
    None
):
    turns = build_workload(3, seed=1)
    last = [SYSTEM, {"role": "user", "content": turns[2].user}]
    everything = {user_tag(t.number) for t in turns} | {reply_tag(t.number) for t in turns[:2]}
    gone = everything - {user_tag(3)}
    assert dropped_without_fold(turns, last, folded=set()) == gone
    assert dropped_without_fold(turns, last, folded=gone) == set()
    assert TAG.findall(turns[0].user) == [user_tag(1)]
