"""Seed 002's ``SummarizationNode`` for LangGraph graphs, on chatmem's pure policy engine.

Optional extra: ``pip install chatmem[langgraph]``. No Django here: the node works in any graph.

    from memory_worker.graph_node import SummarizationNode

    graph.add_node("summarize", SummarizationNode(model=summarizer_model, policy="token-budget"))

The node reads ``state[input_messages_key]`` (default ``"messages"``), asks the policy engine
whether and what to fold (the same ``decide`` the Celery workers use: whole turns only, oldest
first), folds with one model call per fold in seed 003's input format, and writes
``state[output_messages_key]`` (default ``"summarized_messages"``): the leading system messages,
the running summary as a system message, then every unfolded message verbatim. The running
summary is kept in ``state["context"]["running_summary"]``. When the two keys are equal the node
first emits ``RemoveMessage(REMOVE_ALL_MESSAGES)`` so the folded messages leave the state.

A state without a ``context`` key (LangGraph's ``MessagesState``) cannot keep it there: in
equal-keys mode the node then takes the running summary back from its own summary message.
Messages need ids (``add_messages`` gives them), except in equal-keys mode.
"""

from __future__ import annotations

import json
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass, field, replace
from datetime import UTC, datetime
from typing import Any

from langchain_core.language_models import BaseChatModel
from langchain_core.messages import (
    AIMessage,
    AnyMessage,
    BaseMessage,
    HumanMessage,
    RemoveMessage,
    SystemMessage,
    ToolMessage,
)
from langchain_core.runnables import RunnableLambda
from langgraph.graph.message import REMOVE_ALL_MESSAGES

from memory_worker.policy import ChatState, Decision, Msg, Policy, decide
from memory_worker.presets import resolve_policy
from memory_worker.summarizers import (
    FoldMessage,
    SummarizerError,
    format_fold_input,
    shorten_request,
    summary_instructions,
    validate_summary,
)
from memory_worker.tokens import count_tokens

SUMMARY_MESSAGE_ID = "chatmem-running-summary"
SUMMARY_PREFIX = "Summary of the conversation so far:\n"
MAX_FOLDS_PER_CALL = 10  # one fold per engine decision; a huge backlog converges over calls
DEFAULT_CONTEXT_TOKENS = 128_000


@dataclass
class RunningSummary:
    """Seed 002's RunningSummary: the summary text, which messages it covers, and when it was
    last rewritten (ISO 8601: policies with a cooldown count from it)."""

    summary: str
    summarized_message_ids: set[str] = field(default_factory=set)
    last_summarized_message_id: str | None = None
    last_summarized_at: str | None = None

    @classmethod
    def from_state(cls, value: Any) -> RunningSummary | None:
        """As a checkpointer gives it back: the dataclass, or a plain mapping (LangGraph's
        strict msgpack mode, which will not rebuild an unregistered class)."""
        if value is None or isinstance(value, RunningSummary):
            return value
        if isinstance(value, Mapping):
            return cls(
                summary=str(value.get("summary") or ""),
                summarized_message_ids=set(value.get("summarized_message_ids") or ()),
                last_summarized_message_id=value.get("last_summarized_message_id"),
                last_summarized_at=value.get("last_summarized_at"),
            )
        raise TypeError(f"context['running_summary'] is a {type(value).__name__}")


def message_role(message: BaseMessage) -> str:
    if isinstance(message, HumanMessage):
        return "user"
    if isinstance(message, AIMessage):
        return "assistant"
    if isinstance(message, ToolMessage):
        return "tool"
    if isinstance(message, SystemMessage):
        return "system"
    return message.type


def message_text(message: BaseMessage) -> str:
    """The text a message gives the model: its content, and an assistant message's tool calls
    (their arguments are prompt tokens too, and what the summarizer needs to know was done)."""
    content = message.content
    if isinstance(content, str):
        text = content
    else:
        text = "".join(
            part if isinstance(part, str) else str(part.get("text", "")) for part in content
        )
    calls = getattr(message, "tool_calls", None)
    if calls:
        named = [{"name": call.get("name"), "args": call.get("args")} for call in calls]
        text += ("\n" if text else "") + "Tool calls: " + json.dumps(named, ensure_ascii=False)
    return text


class SummarizationNode(RunnableLambda):  # type: ignore[type-arg]
    def __init__(
        self,
        *,
        model: BaseChatModel,
        policy: str | Policy = "token-budget",
        overrides: Mapping[str, Any] | None = None,
        input_messages_key: str = "messages",
        output_messages_key: str = "summarized_messages",
        model_context_tokens: int = DEFAULT_CONTEXT_TOKENS,
        token_counter: Callable[[str], int] = count_tokens,
        clock: Callable[[], datetime] = lambda: datetime.now(UTC),
        name: str = "summarization",
    ) -> None:
        super().__init__(self._run, name=name)
        self.model = model
        if not isinstance(policy, str) and overrides:
            raise ValueError(
                "overrides apply to a preset name; give a Policy with its knobs already set"
            )
        self.policy = resolve_policy(policy, overrides or {}) if isinstance(policy, str) else policy
        self.input_messages_key = input_messages_key
        self.output_messages_key = output_messages_key
        self.model_context_tokens = model_context_tokens
        self.token_counter = token_counter
        self.clock = clock

    def _run(self, state: Mapping[str, Any]) -> dict[str, Any]:
        messages: list[AnyMessage] = list(state[self.input_messages_key])
        context = dict(state.get("context") or {})
        running = RunningSummary.from_state(context.get("running_summary"))
        # Our own summary message (equal-keys mode) is memory, not history to fold again; with
        # no "context" in the state's schema, LangGraph dropped the running summary, and the
        # message is where it still is.
        own = [m for m in messages if m.id == SUMMARY_MESSAGE_ID]
        if running is None and own:
            running = RunningSummary(message_text(own[-1]).removeprefix(SUMMARY_PREFIX))
        messages = [m for m in messages if m.id != SUMMARY_MESSAGE_ID]
        leading = leading_system_messages(messages)
        history = messages[len(leading) :]
        self._require_ids(history)
        folded = already_folded(history, running)
        running = self._fold_due(history, folded, leading, running)
        new_folded = already_folded(history, running)
        output = self._output(leading, history[new_folded:], running)
        context["running_summary"] = running
        return {self.output_messages_key: output, "context": context}

    def _require_ids(self, history: Sequence[AnyMessage]) -> None:
        """Which messages the summary covers is known by id: without ids, every call would fold
        the same messages again and show them beside their own summary."""
        if self.input_messages_key == self.output_messages_key:
            return  # the folded messages leave the state: nothing to recognise
        if any(not m.id for m in history):
            raise ValueError(
                f"every message in state[{self.input_messages_key!r}] needs an id "
                "(declare the key with add_messages, which assigns them)"
            )

    def _fold_due(
        self,
        history: Sequence[AnyMessage],
        folded: int,
        leading: Sequence[AnyMessage],
        running: RunningSummary | None,
    ) -> RunningSummary | None:
        tokens = [self.token_counter(message_text(m)) for m in history]
        system_tokens = sum(self.token_counter(message_text(m)) for m in leading)
        for _ in range(MAX_FOLDS_PER_CALL):
            summary = running.summary if running else ""
            last_at = running.last_summarized_at if running else None
            state = self._state(history, tokens, folded, summary, system_tokens, last_at)
            now = self.clock()
            decision = decide(state, self.policy, now)
            if decision is None:
                return running
            running = self._fold(history, decision, running, now)
            folded = decision.to_seq
        return running

    def _state(
        self,
        history: Sequence[AnyMessage],
        tokens: Sequence[int],
        folded: int,
        summary: str,
        system_tokens: int,
        last_summarized_at: str | None,
    ) -> ChatState:
        unfolded = tuple(
            Msg(seq, message_role(history[seq - 1]), tokens[seq - 1])
            for seq in range(folded + 1, len(history) + 1)
        )
        return ChatState(
            last_consolidated=folded,
            last_seq=len(history),
            unfolded=unfolded,
            summary_tokens=self.token_counter(summary) if summary else 0,
            system_tokens=system_tokens,
            turns_mark=folded,
            # A cooldown counts from the last fold (None before the first: elapsed, as the
            # node has no creation time to count from).
            last_consolidated_at=(
                datetime.fromisoformat(last_summarized_at) if last_summarized_at else None
            ),
            model_context_tokens=self.model_context_tokens,
        )

    def _fold(
        self,
        history: Sequence[AnyMessage],
        decision: Decision,
        running: RunningSummary | None,
        now: datetime,
    ) -> RunningSummary:
        chunk = history[decision.from_seq - 1 : decision.to_seq]
        fold_messages = [
            FoldMessage(decision.from_seq + i, message_role(m), message_text(m))
            for i, m in enumerate(chunk)
        ]
        previous = running or RunningSummary("")
        text = self._summarize(previous.summary, fold_messages)
        ids = {m.id for m in chunk if m.id}
        return replace(
            previous,
            summary=text,
            summarized_message_ids=previous.summarized_message_ids | ids,
            last_summarized_message_id=chunk[-1].id,
            last_summarized_at=now.isoformat(),
        )

    def _summarize(self, summary: str, messages: Sequence[FoldMessage]) -> str:
        """Seed 000 §8-9: a full rewrite under the cap; one stricter retry when over it."""
        prompt: list[BaseMessage] = [
            SystemMessage(summary_instructions(self.cap)),
            HumanMessage(format_fold_input(summary, messages)),
        ]
        draft = self.model.invoke(prompt)
        try:
            return self._validated(draft)
        except SummarizerError as error:
            if error.kind != "over_cap":
                raise
        retry = [
            *prompt,
            draft,
            HumanMessage(shorten_request(self.token_counter(message_text(draft)), self.cap)),
        ]
        return self._validated(self.model.invoke(retry))

    @property
    def cap(self) -> int:
        return self.policy.summary_token_cap

    def _validated(self, response: BaseMessage) -> str:
        finish = (response.response_metadata or {}).get("finish_reason")
        return validate_summary(message_text(response), finish, self.cap, None, headings=True)

    def _output(
        self,
        leading: Sequence[AnyMessage],
        unfolded: Sequence[AnyMessage],
        running: RunningSummary | None,
    ) -> list[BaseMessage]:
        output: list[BaseMessage] = []
        if self.input_messages_key == self.output_messages_key:
            output.append(RemoveMessage(id=REMOVE_ALL_MESSAGES))
        output.extend(leading)
        if running and running.summary:
            output.append(SystemMessage(SUMMARY_PREFIX + running.summary, id=SUMMARY_MESSAGE_ID))
        output.extend(unfolded)
        return output


def leading_system_messages(messages: Sequence[AnyMessage]) -> list[AnyMessage]:
    leading: list[AnyMessage] = []
    for message in messages:
        if not isinstance(message, SystemMessage):
            break
        leading.append(message)
    return leading


def already_folded(history: Sequence[AnyMessage], running: RunningSummary | None) -> int:
    """How many of ``history``'s oldest messages the running summary covers. In equal-keys mode
    the folded messages were removed from the state, so none of the ids is found: 0."""
    if running is None or running.last_summarized_message_id is None:
        return 0
    for index, message in enumerate(history):
        if message.id == running.last_summarized_message_id:
            return index + 1
    return 0
