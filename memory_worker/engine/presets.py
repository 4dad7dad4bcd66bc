"""The named presets, one per requirement seed, and validation of per-chat overrides.
Pure: standard library only. ``docs/policies.md`` documents each preset against its seed."""

from __future__ import annotations

import dataclasses
from collections.abc import Mapping
from types import MappingProxyType

from memory_worker.engine.policy import MESSAGES_PER_TURN, Policy, thresholds, token_bound

DEFAULT_PRESET = "sliding-window"

PRESETS: Mapping[str, Policy] = MappingProxyType(
    {
        # The presets and the requirement each follows: docs/policies.md.
        # K = 6, B = 4, token trigger 70 %, safety every 10 user turns.
        "contract": Policy(
            name="contract",
            tail_messages=6,
            overflow_buffer=4,
            token_budget_fraction=0.7,
            safety_user_turns=10,
            context_size=10,
        ),
        # Context 75, tail 40, window 12, cooldown 900 s, hard limit 30.
        "sliding-window": Policy(
            name="sliding-window",
            tail_messages=40,
            window=12,
            hard_limit=30,
            cooldown_seconds=900.0,
            context_size=75,
        ),
        # Summary and messages within max_tokens (the hard bound); folds start below
        # it by the headroom and go down to the fold target (docs/policies.md).
        "token-budget": Policy(
            name="token-budget",
            max_tokens=4000,
            max_summary_tokens=256,
        ),
        # K = 3 turns, chunk threshold 6000, prompt memory budget 3000 (adapted: the
        # whole unfolded buffer is shown, so the bound is threshold + budget, see docs).
        "chunked": Policy(
            name="chunked",
            tail_turns=3,
            chunk_threshold=6000,
            max_memory_tokens=9000,
        ),
        # 3 full-detail turns; older turns folded one at a time.
        "turn-digest": Policy(
            name="turn-digest",
            tail_turns=3,
            window=1,
            max_fold_turns=1,
            token_budget_fraction=0.7,
            context_size=24,
        ),
    }
)


class PolicyError(ValueError):
    """A preset name or an override that cannot be used; the message says why."""


_FIELDS = {field.name: field for field in dataclasses.fields(Policy) if field.name != "name"}
# No knob means anything beyond this (tokens, messages, turns, seconds: 31 years); a bound also
# keeps every value a finite float and a plain jsonb number.
MAX_KNOB = 10**9
# Five headings with "- None" under each need about 30 tokens; below this, a cap leaves no room
# (the offline summarizer refuses it).
MIN_SUMMARY_TOKEN_CAP = 64
# A summary is a few hundred tokens (chunked: 400-500, hard cap 500). Far above this, the
# summarizer's output limit (1.5 x the cap) passes what models accept (16,384 for gpt-4o-mini),
# and every fold is refused.
MAX_SUMMARY_TOKEN_CAP = 8000
_FLOAT_KNOBS = {"token_budget_fraction", "cooldown_seconds"}
_AT_LEAST_ONE = {
    "tail_turns",
    "max_tokens",
    "overflow_buffer",
    "hard_limit",
    "window",
    "safety_user_turns",
    "chunk_threshold",
    "max_fold_turns",
    "context_size",
    "max_memory_tokens",
}
# Integer knobs with bounds of their own (the others: 0 or 1 up to MAX_KNOB).
# More than a few turns of headroom only lowers every threshold: folds get smaller, not safer.
MAX_HEADROOM_TURNS = 20
_INT_BOUNDS = {
    "summary_token_cap": (MIN_SUMMARY_TOKEN_CAP, MAX_SUMMARY_TOKEN_CAP),
    "headroom_turns": (1, MAX_HEADROOM_TURNS),
}


# Which preset for which use, in a sentence each: GET /api/v1/policies/ and the README's
# "Choosing a policy" (calls per 100 turns as measured in docs/benchmarks.md).
DESCRIPTIONS: Mapping[str, str] = MappingProxyType(
    {
        "contract": (
            "Small prompts, frequent folds: 6 messages verbatim, a fold every 2-3 turns (about "
            "33 summarizer calls per 100 turns). For models with a short context window."
        ),
        "sliding-window": (
            "The default: the last 40 messages verbatim, about 30 folded at a time (about 6.5 "
            "calls per 100 turns); long prompts, most of them cacheable. For general chat."
        ),
        "token-budget": (
            "Summary and messages within 4,000 tokens, folded down to a target below it (about "
            "15 calls per 100 turns). For a fixed cost per turn in tokens."
        ),
        "chunked": (
            "The last 3 turns verbatim, the rest folded in chunks once past 6,000 tokens (about "
            "7 calls per 100 turns). For long messages and documents."
        ),
        "turn-digest": (
            "3 full-detail turns, older turns folded one at a time (about 22 calls per 100 "
            "turns), with the agent state (docs/agent-state.md). For agent loops."
        ),
    }
)


def knob_names() -> tuple[str, ...]:
    return tuple(_FIELDS)


def _optional(name: str) -> bool:
    return _FIELDS[name].default is None


def _int_bounds(name: str) -> tuple[int, int]:
    """The smallest and largest value of integer knob ``name``: what _coerce enforces and
    knob_json_schema publishes."""
    return _INT_BOUNDS.get(name, (1 if name in _AT_LEAST_ONE else 0, MAX_KNOB))


def _coerce(name: str, value: object) -> object:
    if value is None:
        if _optional(name):
            return None
        raise PolicyError(f'Knob "{name}" cannot be null.')
    if isinstance(value, bool):
        raise PolicyError(f'Knob "{name}" must be a number, got a boolean.')
    if name in _FLOAT_KNOBS:
        if not isinstance(value, int | float):
            raise PolicyError(f'Knob "{name}" must be a number, got {value!r}.')
        # Also refuses NaN, 1e400 (parsed as inf, which jsonb cannot store) and 10**400 (no
        # float at all).
        if not 0 <= value <= MAX_KNOB:
            raise PolicyError(
                f'Knob "{name}" must be a number from 0 to {MAX_KNOB}, got {value!r}.'
            )
        return float(value)
    if isinstance(value, float) and value.is_integer():
        value = int(value)  # 12.0 is an integer to JSON Schema, as the published schema says
    if not isinstance(value, int):
        raise PolicyError(f'Knob "{name}" must be an integer, got {value!r}.')
    minimum, maximum = _int_bounds(name)
    if value < minimum:
        raise PolicyError(f'Knob "{name}" must be at least {minimum}, got {value}.')
    if value > maximum:
        raise PolicyError(f'Knob "{name}" must be at most {maximum}, got {value}.')
    return value


def _check_consistency(policy: Policy) -> None:
    if policy.token_budget_fraction is not None and not 0 < policy.token_budget_fraction <= 1:
        raise PolicyError('Knob "token_budget_fraction" must be in (0, 1].')
    if policy.context_size is not None and policy.tail_messages >= policy.context_size:
        raise PolicyError(
            f"tail_messages ({policy.tail_messages}) must be less than context_size "
            f"({policy.context_size})."
        )
    if policy.max_tokens is not None and policy.max_summary_tokens >= policy.max_tokens:
        raise PolicyError(
            f"max_summary_tokens ({policy.max_summary_tokens}) must be less than max_tokens "
            f"({policy.max_tokens})."
        )
    bound = token_bound(policy)
    if bound is not None and policy.summary_token_cap >= bound:
        raise PolicyError(
            f"summary_token_cap ({policy.summary_token_cap}) must be less than the token bound "
            f"({bound}: max_memory_tokens, or max_tokens)."
        )


# The model's window is the chat's variant's, checked apart (conversations.services.chats): the
# token and message thresholds below do not depend on it.
ANY_WINDOW = MAX_KNOB


def synchronous_only(policy: Policy) -> str | None:
    """Why the policy leaves its background folds no headroom below its hard bound (most folds
    would then run synchronously, in a turn), or None. Judged on the floors of the reserves
    (policy.thresholds with no turns yet). Not a reason to refuse the policy everywhere: chats
    already stored with it keep working, and chat creation refuses only overrides that cause it
    (memory_worker.folding.effective_policy)."""
    limits = thresholds(policy, ANY_WINDOW)
    bound = limits.token_bound
    if bound is not None and policy.chunk_threshold is not None and policy.chunk_threshold > bound:
        return (
            f"chunk_threshold ({policy.chunk_threshold}) must be at most the token bound "
            f"({bound}); raise max_memory_tokens with it."
        )
    trigger = limits.token_trigger
    target = limits.fold_target if policy.fold_target_tokens is None else policy.fold_target_tokens
    if trigger is not None and target >= trigger:
        return (
            f"the fold target ({target} tokens) must be below the background "
            f"threshold ({trigger}: the token bound less {policy.headroom_turns} turn(s) of "
            "headroom); lower fold_target_tokens or headroom_turns, or raise the bound."
        )
    return _message_problem(policy, limits.message_trigger, limits.message_reserve)


def _message_problem(policy: Policy, trigger: int | None, reserve: int) -> str | None:
    if trigger is None or policy.context_size is None:
        return None
    kept = max(policy.tail_messages, policy.tail_turns * MESSAGES_PER_TURN)
    if trigger <= kept:
        return (
            f"context_size less {reserve} message(s) of headroom ({trigger}) must be more than "
            f"the verbatim tail ({kept} messages); raise context_size or lower the tail."
        )
    if policy.window is not None and policy.tail_messages + policy.window > trigger:
        return (
            f"tail_messages + window ({policy.tail_messages} + {policy.window}) must be at most "
            f"context_size less {reserve} message(s) of headroom ({trigger}); raise "
            "context_size with them."
        )
    return None


def resolve_policy(name: str, overrides: Mapping[str, object] | None = None) -> Policy:
    if name not in PRESETS:
        known = ", ".join(sorted(PRESETS))
        raise PolicyError(f'Unknown policy "{name}". Known policies: {known}.')
    changes: dict[str, object] = {}
    for knob, value in (overrides or {}).items():
        if knob not in _FIELDS:
            raise PolicyError(f'Unknown knob "{knob}". Known knobs: {", ".join(knob_names())}.')
        changes[knob] = _coerce(knob, value)
    policy = dataclasses.replace(PRESETS[name], **changes)  # type: ignore[arg-type]
    _check_consistency(policy)
    return policy


def policy_parameters(policy: Policy, model_context_tokens: int | None = None) -> dict[str, object]:
    """The knobs; with the model's window, also ``thresholds``: the bounds and the background
    thresholds derived below them for a chat whose turns are not known yet (the reserves'
    floors; a chat's own turns size its reserves as it goes, docs/policies.md)."""
    parameters = dataclasses.asdict(policy)
    if model_context_tokens is not None:
        parameters["thresholds"] = dataclasses.asdict(thresholds(policy, model_context_tokens))
    return parameters


def knob_json_schema() -> dict[str, dict[str, object]]:
    """Each knob's type and bounds as JSON Schema (for the API's OpenAPI description), from the
    bounds _coerce and _check_consistency enforce. The rules between knobs (for example
    max_summary_tokens < max_tokens) are checked by resolve_policy and cannot be written in JSON
    Schema."""
    schemas: dict[str, dict[str, object]] = {}
    for name in knob_names():
        schema: dict[str, object]
        if name == "token_budget_fraction":
            schema = {"type": "number", "minimum": 0, "exclusiveMinimum": True, "maximum": 1}
        elif name in _FLOAT_KNOBS:
            schema = {"type": "number", "minimum": 0, "maximum": MAX_KNOB}
        else:
            minimum, maximum = _int_bounds(name)
            schema = {"type": "integer", "minimum": minimum, "maximum": maximum}
        if _optional(name):
            schema["nullable"] = True
        schemas[name] = schema
    return schemas
