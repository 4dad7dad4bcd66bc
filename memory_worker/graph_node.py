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
"""

from __future__ import annotations

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
    """Seed 002's RunningSummary: the summary text and which messages it covers."""

    summary: str
    summarized_message_ids: set[str] = field(default_factory=set)
    last_summarized_message_id: str | None = None


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
    content = message.content
    if isinstance(content, str):
        return content
    parts = [part if isinstance(part, str) else str(part.get("text", "")) for part in content]
    return "".join(parts)


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
        self.policy = resolve_policy(policy, overrides or {}) if isinstance(policy, str) else policy
        self.input_messages_key = input_messages_key
        self.output_messages_key = output_messages_key
        self.model_context_tokens = model_context_tokens
        self.token_counter = token_counter
        self.clock = clock

    def _run(self, state: Mapping[str, Any]) -> dict[str, Any]:
        messages: list[AnyMessage] = list(state[self.input_messages_key])
        context = dict(state.get("context") or {})
        running: RunningSummary | None = context.get("running_summary")
        # Our own summary message (equal-keys mode) is memory, not history to fold again.
        messages = [m for m in messages if m.id != SUMMARY_MESSAGE_ID]
        leading = leading_system_messages(messages)
        history = messages[len(leading) :]
        folded = already_folded(history, running)
        running = self._fold_due(history, folded, leading, running)
        new_folded = already_folded(history, running)
        output = self._output(leading, history[new_folded:], running)
        context["running_summary"] = running
        return {self.output_messages_key: output, "context": context}

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
            state = self._state(history, tokens, folded, summary, system_tokens)
            decision = decide(state, self.policy, self.clock())
            if decision is None:
                return running
            running = self._fold(history, decision, running)
            folded = decision.to_seq
        return running

    def _state(
        self,
        history: Sequence[AnyMessage],
        tokens: Sequence[int],
        folded: int,
        summary: str,
        system_tokens: int,
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
            last_consolidated_at=None,
            model_context_tokens=self.model_context_tokens,
        )

    def _fold(
        self, history: Sequence[AnyMessage], decision: Decision, running: RunningSummary | None
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
