"""What a provider's prefix cache could serve of a chat's prompts, measured on the requests the
fake model server recorded: for each turn's prompt, its longest prefix in common with the same
chat's previous prompt (whole messages while they match, then the matching start of the first
that differs), in tokens counted as bench.cost counts them; how much of that OpenAI's rule
caches (1,024 tokens up, in steps of 128: ``tests.support.fake_openai.cacheable``); the turns whose
prompt changed above its verbatim messages (a fold's new summary, a pin), which lose the cached
prefix; and what input is billed at a stated price for a cached token."""

from __future__ import annotations

import itertools
import re
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

from bench.cost import MESSAGE_OVERHEAD_TOKENS, Turn, reply_tag, tokens, user_tag
from tests.support.fake_openai import cacheable, common_start, content_text

# The price of a cached input token, as a share of an uncached one: OpenAI's current small models
# and Anthropic's cache reads (a cache write, 1.25x on Anthropic, is not counted).
CACHED_PRICE = 0.1
TAG = re.compile(r"\[t\d+[ua]\]")  # bench.cost's user_tag and reply_tag

Prompt = Sequence[dict[str, Any]]


def message_tokens(message: dict[str, Any]) -> int:
    return tokens(content_text(message.get("content"))) + MESSAGE_OVERHEAD_TOKENS


def common_prefix_tokens(earlier: Prompt, later: Prompt) -> int:
    total = 0
    for old, new in zip(earlier, later, strict=False):
        if old == new:
            total += message_tokens(new)
            continue
        if old.get("role") != new.get("role"):
            break
        a, b = content_text(old.get("content")), content_text(new.get("content"))
        same = common_start(a, b)
        return total + MESSAGE_OVERHEAD_TOKENS + (tokens(a[:same]) if same else 0)
    return total


def leading_system_tokens(prompt: Prompt) -> int:
    """The prompt's leading system messages: system prompt, pins, summary."""
    total = 0
    for message in prompt:
        if message.get("role") != "system":
            break
        total += message_tokens(message)
    return total


@dataclass(frozen=True)
class CacheFigures:
    prompt_tokens: int  # every turn's prompt
    common_tokens: int  # the exact common prefix with the previous prompt
    cached_tokens: int  # of that, what OpenAI's rule caches
    turns: int
    # Turns whose prompt changed above its verbatim messages (a new summary adopted, a pin):
    # the cache serves them at most the part above the change.
    miss_turns: int
    miss_prompt_tokens: int
    miss_cached_tokens: int

    @property
    def cached_share(self) -> float:
        return self.cached_tokens / self.prompt_tokens if self.prompt_tokens else 0.0

    @property
    def exact_share(self) -> float:
        return self.common_tokens / self.prompt_tokens if self.prompt_tokens else 0.0

    @property
    def between_folds_share(self) -> float:
        """The cached share of the turns that kept their prefix (every turn but the misses and
        the first)."""
        prompt = self.prompt_tokens - self.miss_prompt_tokens
        return (self.cached_tokens - self.miss_cached_tokens) / prompt if prompt else 0.0

    @property
    def billed_per_turn(self) -> float:
        """Input billed per turn, in uncached-token units, a cached token at CACHED_PRICE."""
        uncached = self.prompt_tokens - self.cached_tokens
        billed = uncached + CACHED_PRICE * self.cached_tokens
        return billed / self.turns if self.turns else 0.0


def cache_figures(prompts: Sequence[Prompt]) -> CacheFigures:
    """``prompts``: one chat's turn prompts, in the order they were sent."""
    prompt_total = common_total = cached_total = 0
    misses = miss_prompt = miss_cached = 0
    previous: Prompt = ()
    for prompt in prompts:
        size = sum(message_tokens(m) for m in prompt)
        common = common_prefix_tokens(previous, prompt) if previous else 0
        cached = cacheable(common)
        prompt_total, common_total, cached_total = (
            prompt_total + size,
            common_total + common,
            cached_total + cached,
        )
        if previous and common < leading_system_tokens(previous):
            misses, miss_prompt, miss_cached = misses + 1, miss_prompt + size, miss_cached + cached
        previous = prompt
    first = sum(message_tokens(m) for m in prompts[0]) if prompts else 0
    return CacheFigures(
        prompt_tokens=prompt_total,
        common_tokens=common_total,
        cached_tokens=cached_total,
        turns=len(prompts),
        miss_turns=misses,
        # The first prompt has nothing before it: counted with the misses' prompt tokens so
        # the between-folds share is over the turns that had a prefix to keep.
        miss_prompt_tokens=miss_prompt + first,
        miss_cached_tokens=miss_cached,
    )


def pooled(figures: Sequence[CacheFigures]) -> CacheFigures:
    return CacheFigures(
        *(sum(getattr(f, name) for f in figures) for name in CacheFigures.__dataclass_fields__)
    )


def not_extending(prompts: Sequence[Prompt]) -> int:
    """Turns whose prompt does not begin with the whole previous prompt: the cache serves them
    at most the part before the change (bench.prompt_cache's miss turns count only changes
    above chatmem's verbatim messages, which a peer's prompt may not have)."""
    return sum(
        common_prefix_tokens(before, after) < sum(message_tokens(m) for m in before)
        for before, after in itertools.pairwise(prompts)
    )


def dropped_without_fold(turns: Sequence[Turn], last_prompt: Prompt, folded: set[str]) -> set[str]:
    """The messages neither in the last prompt nor ever given to the summarizer: gone from the
    context without being folded (the last reply, never sent, is not counted)."""
    tags = {user_tag(t.number) for t in turns} | {reply_tag(t.number) for t in turns[:-1]}
    shown = set(TAG.findall("\n".join(str(m["content"]) for m in last_prompt)))
    return tags - shown - folded
