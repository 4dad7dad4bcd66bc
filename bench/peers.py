"""The peers' prompts on chatmem's workload, measured as bench.prompt_cache measures chatmem's:
what a provider's prefix cache could serve of each turn's prompt (OpenAI's 1,024/128 rule), the
turns that lose the cached prefix, and the input billed per turn with a cached token at 0.1 of
an uncached one. The peers are the libraries themselves, run in this process as their users run
them: LangChain's SummarizationMiddleware (its ``before_model`` on the agent's state) and
ConversationSummaryBufferMemory, LlamaIndex's ChatSummaryMemoryBuffer, langmem's
summarize_messages, and a plain sliding window. Each is configured at the peers' bound (4,500
tokens: 4,000 verbatim and a 500-token summary, seed002@4500+500 in bench.topology) and counts
tokens as chatmem's benches do (cl100k_base, 4 a message). Their summarizer is a stand-in that
writes a summary of about the size chatmem's padded summaries have (up to SUMMARY_TOKENS),
different at every call, as a model's rewrite is.

This is a unit-level run (one process, no server): the peers are libraries, so what they send
to the model does not depend on a topology. chatmem's own figures come from bench.topology.

    pip install -e '.[peers]'
    python -m bench.peers [--turns 600] [--chats 8] [--seed 7] [--out FILE]
"""

from __future__ import annotations

import argparse
import shlex
import sys
import time
import uuid
import warnings
from collections.abc import Callable, Iterable, Sequence
from datetime import UTC, datetime
from typing import Any

from langchain.agents.middleware import SummarizationMiddleware
from langchain_classic.memory import ConversationSummaryBufferMemory
from langchain_core.language_models.chat_models import BaseChatModel
from langchain_core.messages import AIMessage, BaseMessage, HumanMessage, SystemMessage
from langchain_core.outputs import ChatGeneration, ChatResult
from langgraph.graph.message import add_messages
from langmem.short_term import RunningSummary, summarize_messages
from llama_index.core.base.llms.types import ChatMessage, CompletionResponse, LLMMetadata
from llama_index.core.base.llms.types import MessageRole as LlamaRole
from llama_index.core.llms import CustomLLM
from llama_index.core.memory import ChatSummaryMemoryBuffer

from bench import cost
from bench.common import machine_line, save_report
from bench.prompt_cache import (
    TAG,
    CacheFigures,
    Prompt,
    cache_figures,
    dropped_without_fold,
    not_extending,
    pooled,
)
from bench.topology_measures import code_revision

BOUND = 4500  # the peers' bound: 4,000 verbatim and the summary's 500
SUMMARY_RESERVE = 500
SUMMARY_TOKENS = 470  # what chatmem's padded summaries reach under their 500-token cap
SYSTEM_PROMPT = "You are a helpful assistant."  # chatmem's default (CHATMEM_DEFAULT_SYSTEM_PROMPT)
WORDS_PER_LINE = 12
# SummarizationMiddleware alone can batch (trigger and keep are separate knobs): it keeps 2,000
# tokens, so its verbatim history between summaries averages about chatmem's at this bound
# (2,300 tokens). Keeping 4,000 summarized on nearly every turn.
MIDDLEWARE_KEEP = 2000


def count(texts: Iterable[str]) -> int:
    return sum(cost.tokens(text) + cost.MESSAGE_OVERHEAD_TOKENS for text in texts)


def text_of(message: Any) -> str:
    content = message.content if not isinstance(message, str) else message
    return content if isinstance(content, str) else str(content)


def count_messages(messages: Iterable[Any]) -> int:
    return count(text_of(m) for m in messages)


def token_list(text: str) -> list[int]:
    """LlamaIndex counts what its tokenizer returns: as many items as bench.cost counts."""
    return [0] * cost.tokens(text)


class Summaries:
    """The stand-in summarizer shared by every peer: a line of the first words of each line it
    is given, the newest lines that fit SUMMARY_TOKENS. Counts its calls and input tokens."""

    def __init__(self) -> None:
        self.calls = 0
        self.input_tokens = 0
        self.folded: set[str] = set()  # the workload's message tags any call was given

    def __call__(self, prompt_text: str) -> str:
        self.calls += 1
        self.input_tokens += cost.tokens(prompt_text)
        self.folded.update(TAG.findall(prompt_text))
        lines = [line.split() for line in prompt_text.splitlines() if line.strip()]
        kept: list[str] = []
        used = 0
        for words in reversed(lines):
            line = "- " + " ".join(words[:WORDS_PER_LINE])
            size = cost.tokens(line) + 1
            if used + size > SUMMARY_TOKENS:
                break
            kept.append(line)
            used += size
        return "\n".join(reversed(kept))


class StandInChatModel(BaseChatModel):
    """LangChain's side of the stand-in (SummarizationMiddleware, the buffer memory, langmem)."""

    summaries: Any

    @property
    def _llm_type(self) -> str:
        return "stand-in-summarizer"

    def _generate(
        self, messages: list[BaseMessage], stop: Any = None, run_manager: Any = None, **_: Any
    ) -> ChatResult:
        summary = self.summaries("\n".join(text_of(m) for m in messages))
        return ChatResult(generations=[ChatGeneration(message=AIMessage(content=summary))])

    def get_num_tokens_from_messages(self, messages: list[BaseMessage], tools: Any = None) -> int:
        return count_messages(messages)

    def get_num_tokens(self, text: str) -> int:
        return cost.tokens(text)


class StandInLlamaLLM(CustomLLM):
    """LlamaIndex's side of the stand-in (ChatSummaryMemoryBuffer)."""

    summaries: Any

    @property
    def metadata(self) -> LLMMetadata:
        return LLMMetadata(context_window=128_000, num_output=SUMMARY_RESERVE)

    def complete(self, prompt: str, formatted: bool = False, **_: Any) -> CompletionResponse:
        return CompletionResponse(text=self.summaries(prompt))

    def stream_complete(self, prompt: str, formatted: bool = False, **_: Any) -> Any:
        yield self.complete(prompt)


def as_prompt(messages: Sequence[Any]) -> Prompt:
    """LangChain or LlamaIndex messages as the OpenAI dicts bench.prompt_cache measures."""
    roles = {"human": "user", "ai": "assistant", "system": "system"}
    prompt = []
    for message in messages:
        role = getattr(message, "type", None) or getattr(message, "role", "user")
        role = roles.get(str(role), str(getattr(role, "value", role)))
        prompt.append({"role": role, "content": text_of(message)})
    return prompt


Peer = Callable[[Sequence[cost.Turn], Summaries], list[Prompt]]


def sliding_window(turns: Sequence[cost.Turn], summaries: Summaries) -> list[Prompt]:
    """The newest messages that fit the bound, nothing summarized."""
    history: list[dict[str, str]] = []
    prompts: list[Prompt] = []
    for turn in turns:
        history.append({"role": "user", "content": turn.user})
        while count(m["content"] for m in history) > BOUND - count([SYSTEM_PROMPT]):
            history.pop(0)
        prompts.append([{"role": "system", "content": SYSTEM_PROMPT}, *history])
        history.append({"role": "assistant", "content": turn.reply})
    return prompts


def merged(state: list[Any], update: Sequence[Any]) -> list[Any]:
    """The agent state after a node's update, as LangGraph's reducer makes it."""
    return list(add_messages(state, list(update)))  # type: ignore[arg-type]


def summarization_middleware(turns: Sequence[cost.Turn], summaries: Summaries) -> list[Prompt]:
    """LangChain 1.x's agent middleware: over ``trigger`` tokens, everything but the newest
    ``keep`` tokens becomes one summary message at the head of the state."""
    middleware = SummarizationMiddleware(
        StandInChatModel(summaries=summaries),
        trigger=("tokens", BOUND),
        keep=("tokens", MIDDLEWARE_KEEP),
        token_counter=count_messages,
    )
    state: list[Any] = []
    prompts = []
    for turn in turns:
        state = merged(state, [HumanMessage(turn.user, id=uuid.uuid4().hex)])
        update = middleware.before_model({"messages": state}, None)  # type: ignore[arg-type]
        if update:
            state = merged(state, update["messages"])
        prompts.append(as_prompt([SystemMessage(SYSTEM_PROMPT), *state]))
        state = merged(state, [AIMessage(turn.reply, id=uuid.uuid4().hex)])
    return prompts


def summary_buffer_memory(turns: Sequence[cost.Turn], summaries: Summaries) -> list[Prompt]:
    """LangChain's ConversationSummaryBufferMemory (langchain-classic): the buffer pruned to
    ``max_token_limit`` after each exchange, what leaves it folded into a moving summary."""
    memory = ConversationSummaryBufferMemory(
        llm=StandInChatModel(summaries=summaries),
        max_token_limit=BOUND - SUMMARY_RESERVE,
        return_messages=True,
    )
    prompts = []
    for turn in turns:
        history = memory.load_memory_variables({})["history"]
        prompts.append(as_prompt([SystemMessage(SYSTEM_PROMPT), *history, HumanMessage(turn.user)]))
        memory.save_context({"input": turn.user}, {"output": turn.reply})
    return prompts


def chat_summary_buffer(turns: Sequence[cost.Turn], summaries: Summaries) -> list[Prompt]:
    """LlamaIndex's ChatSummaryMemoryBuffer: over ``token_limit``, the older messages are
    summarized into one system message before the newest ones."""
    memory = ChatSummaryMemoryBuffer.from_defaults(
        llm=StandInLlamaLLM(summaries=summaries),
        token_limit=BOUND,
        tokenizer_fn=token_list,
    )
    prompts = []
    for turn in turns:
        memory.put(ChatMessage(role=LlamaRole.USER, content=turn.user))
        prompts.append(
            as_prompt([ChatMessage(role=LlamaRole.SYSTEM, content=SYSTEM_PROMPT), *memory.get()])
        )
        memory.put(ChatMessage(role=LlamaRole.ASSISTANT, content=turn.reply))
    return prompts


def langmem_summarize(turns: Sequence[cost.Turn], summaries: Summaries) -> list[Prompt]:
    """langmem's summarize_messages with seed 002's two knobs (max_tokens, max_summary_tokens),
    its running summary carried from turn to turn."""
    model = StandInChatModel(summaries=summaries)
    messages: list[BaseMessage] = []
    running: RunningSummary | None = None
    prompts = []
    for turn in turns:
        messages.append(HumanMessage(turn.user, id=uuid.uuid4().hex))
        result = summarize_messages(
            messages,
            running_summary=running,
            model=model,
            max_tokens=BOUND,
            max_summary_tokens=SUMMARY_RESERVE,
            token_counter=count_messages,
        )
        running = result.running_summary
        prompts.append(as_prompt([SystemMessage(SYSTEM_PROMPT), *result.messages]))
        messages.append(AIMessage(turn.reply, id=uuid.uuid4().hex))
    return prompts


PEERS: dict[str, Peer] = {
    "LangChain SummarizationMiddleware": summarization_middleware,
    "LangChain ConversationSummaryBufferMemory": summary_buffer_memory,
    "LlamaIndex ChatSummaryMemoryBuffer": chat_summary_buffer,
    "langmem summarize_messages": langmem_summarize,
    "plain sliding window": sliding_window,
}


def measure(name: str, peer: Peer, workloads: Sequence[Sequence[cost.Turn]]) -> dict[str, Any]:
    figures: list[CacheFigures] = []
    calls = input_tokens = changed = dropped = unseen = 0
    started = time.monotonic()
    for turns in workloads:
        summaries = Summaries()
        prompts = peer(turns, summaries)
        unseen += sum(
            prompt[-1] != {"role": "user", "content": turn.user}
            for prompt, turn in zip(prompts, turns, strict=True)
        )
        figures.append(cache_figures(prompts))
        changed += not_extending(prompts)
        dropped += len(dropped_without_fold(turns, prompts[-1], summaries.folded))
        calls, input_tokens = calls + summaries.calls, input_tokens + summaries.input_tokens
    total = pooled(figures)
    turns_count = sum(len(turns) for turns in workloads)
    return {
        "peer": name,
        "turns": turns_count,
        "summarizer_calls": calls,
        "calls_per_100_turns": round(100 * calls / turns_count, 1),
        "summarizer_input_tokens": input_tokens,
        "dropped_without_fold": dropped,
        # Turns whose prompt does not end with the turn's own message, verbatim.
        "newest_not_verbatim": unseen,
        "cached_share": round(total.cached_share, 4),
        "cached_share_exact": round(total.exact_share, 4),
        "turns_not_extending": changed,
        "prompt_tokens_mean": round(total.prompt_tokens / total.turns, 1),
        "billed_input_per_turn": round(total.billed_per_turn, 1),
        "seconds": round(time.monotonic() - started, 1),
    }


def markdown(results: Sequence[dict[str, Any]]) -> str:
    lines = [
        "| peer | summarizer calls / 100 turns | cached share: OpenAI's rule / exact "
        "| turns not extending the previous prompt | prompt tokens mean "
        "| billed input per turn (cached at 0.1) | messages dropped without a fold "
        "| turns without their own message |",
        "|---|---:|---|---:|---:|---:|---:|---:|",
    ]
    for r in results:
        lines.append(
            f"| {r['peer']} | {r['calls_per_100_turns']} | {100 * r['cached_share']:.1f} % / "
            f"{100 * r['cached_share_exact']:.1f} % | {r['turns_not_extending']:,} "
            f"| {r['prompt_tokens_mean']:,.0f} | {r['billed_input_per_turn']:,.0f} "
            f"| {r['dropped_without_fold']:,} | {r['newest_not_verbatim']:,} |"
        )
    return "\n".join(lines)


def parse_args(argv: Sequence[str] | None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--turns", type=int, default=cost.DEFAULT_TURNS)
    parser.add_argument("--chats", type=int, default=8, help="chats, seeds --seed and up")
    parser.add_argument("--seed", type=int, default=cost.DEFAULT_SEED)
    parser.add_argument("--peers", default=",".join(PEERS), help="comma-separated names")
    parser.add_argument("--out", default="bench/results/peers-cache.json")
    return parser.parse_args(argv)


def main(argv: Sequence[str] | None = None) -> int:
    args = parse_args(argv)
    chosen = [name.strip() for name in args.peers.split(",") if name.strip()]
    unknown = [name for name in chosen if name not in PEERS]
    if unknown:
        print(f"unknown peers: {', '.join(unknown)}; known: {', '.join(PEERS)}", file=sys.stderr)
        return 2
    # The libraries' deprecation notices (ConversationSummaryBufferMemory) are not results.
    warnings.simplefilter("ignore")
    workloads = [cost.build_workload(args.turns, args.seed + i) for i in range(args.chats)]
    given = list(sys.argv[1:] if argv is None else argv)
    results = []
    for name in chosen:
        results.append(measure(name, PEERS[name], workloads))
        print(f"  {name}: {results[-1]['seconds']} s", file=sys.stderr, flush=True)
    report = {
        "command": shlex.join(["python", "-m", "bench.peers", *given]),
        "date": datetime.now(UTC).strftime("%Y-%m-%d %H:%M UTC"),
        "code": code_revision(),
        "machine": machine_line(),
        "workload": {
            "turns_per_chat": args.turns,
            "seeds": [args.seed + i for i in range(args.chats)],
        },
        "bound": {"tokens": BOUND, "summary": SUMMARY_RESERVE},
        "results": results,
    }
    print(markdown(results))
    print(f"\nwrote {save_report(report, args.out)}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
