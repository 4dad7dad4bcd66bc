"""A ``SummarizationNode`` for LangGraph graphs (docs/policies.md, token-budget), on chatmem's pure
policy engine.

Optional extra: ``pip install chatmem[langgraph]``. No Django here: the node works in any graph.

    from memory_worker.graph_node import SummarizationNode

    graph.add_node("summarize", SummarizationNode(model=summarizer_model, policy="token-budget"))

The node reads ``state[input_messages_key]`` (default ``"messages"``), asks the policy engine
whether and what to fold (the same ``decide`` the Celery workers use: whole turns only, oldest
first), folds with one model call per fold in the service's input format, and writes
``state[output_messages_key]`` (default ``"summarized_messages"``): the leading system messages,
the running summary as a system message, then every unfolded message verbatim. The running
summary is kept in ``state["context"]["running_summary"]``. When the two keys are equal the node
first emits ``RemoveMessage(REMOVE_ALL_MESSAGES)`` so the folded messages leave the state.

A state without a ``context`` key (LangGraph's ``MessagesState``) cannot keep it there: in
equal-keys mode the node then takes the running summary back from its own summary message.
Messages need ids (``add_messages`` gives them), except in equal-keys mode; ids must be unique.

The node runs before the model call, and keeps the service's bound (promise 2) the way a turn does
(docs/design.md, the turn, step 4). Its "new messages" are what a turn would send: the newest human
message (and anything after it), or, inside a tool loop, the tool results after the last assistant
message. After the background folds, ``decide_before_turn`` checks the history with them; when it is
over the policy's hard bound, the node folds synchronously at a turn boundary first (a human message
opens a turn, so everything before it may be folded; tool results continue the newest turn, which is
kept whole), and when even that cannot fit it raises ``ContextOverBound`` (the service's 503
``context_over_bound``) rather than return a history over the bound.
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

from conversations.chat_model.tokens import count_tokens
from memory_worker.engine.policy import Decision, Policy, decide, decide_before_turn
from memory_worker.engine.presets import resolve_policy
from memory_worker.engine.state import ROLE_OVERHEAD_TOKENS, ChatState, Msg
from memory_worker.summaries.contract import (
    FoldMessage,
    SummarizerError,
    format_fold_input,
    shorten_request,
    summary_instructions,
)
from memory_worker.summaries.validation import replaced_tokens, validate_summary

__all__ = [
    "MAX_FOLDS_PER_CALL",
    "SUMMARY_MESSAGE_ID",
    "SUMMARY_PREFIX",
    "ContextOverBound",
    "RunningSummary",
    "SummarizationNode",
    "already_folded",
    "leading_system_messages",
    "message_role",
    "message_text",
]

SUMMARY_MESSAGE_ID = "chatmem-running-summary"
SUMMARY_PREFIX = "Summary of the conversation so far:\n"
MAX_FOLDS_PER_CALL = 10  # one fold per engine decision; a huge backlog converges over calls
DEFAULT_CONTEXT_TOKENS = 128_000
# Synchronous folds before the model call: the first one reaches the bound; another is needed
# only when the new summary came out larger than the cap it was planned with.
SYNC_FOLD_ATTEMPTS = 3


class ContextOverBound(RuntimeError):
    """The history the node would return is over the policy's hard bound, and folding every
    message it may fold (everything before the turn in progress) would not bring it within: the
    node's counterpart of the service's 503 ``context_over_bound``. Nothing was dropped, and the
    running summary in the state is unchanged; a shorter message, a new turn, or a policy with a
    larger bound is needed."""


@dataclass
class RunningSummary:
    """The RunningSummary: the summary text, which messages it covers, and when it was
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
        self._require_ids(messages, history)
        folded = already_folded(history, running)
        tokens = [self.token_counter(message_text(m)) for m in history]
        system_tokens = sum(self.token_counter(message_text(m)) for m in leading)
        # Fail before any summarizer call when no fold could bring the history within the bound.
        self._fold_to_bound(history, tokens, folded, system_tokens, running, fold=False)
        running, folded = self._fold_due(history, tokens, folded, system_tokens, running)
        running, folded = self._fold_to_bound(history, tokens, folded, system_tokens, running)
        output = self._output(leading, history[folded:], running)
        context["running_summary"] = running
        return {self.output_messages_key: output, "context": context}

    def _require_ids(self, messages: Sequence[AnyMessage], history: Sequence[AnyMessage]) -> None:
        """Which messages the summary covers is known by id: without ids, every call would fold
        the same messages again and show them beside their own summary; with an id twice, the
        summary's last message is ambiguous (messages would be folded twice and also shown
        verbatim), and ``add_messages`` would merge the two."""
        seen: set[str] = set()
        for message in messages:
            if not message.id:
                continue
            if message.id in seen:
                raise ValueError(
                    f"message id {message.id!r} appears more than once in "
                    f"state[{self.input_messages_key!r}]; every message needs its own id"
                )
            seen.add(message.id)
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
        tokens: Sequence[int],
        folded: int,
        system_tokens: int,
        running: RunningSummary | None,
    ) -> tuple[RunningSummary | None, int]:
        """The background folds (the workers' ``decide``), at most MAX_FOLDS_PER_CALL."""
        for _ in range(MAX_FOLDS_PER_CALL):
            state = self._state(history, tokens, folded, running, system_tokens)
            now = self.clock()
            decision = decide(state, self.policy, now)
            if decision is None:
                break
            running = self._fold(history, decision, running, now)
            folded = decision.to_seq
        return running, folded

    def _fold_to_bound(
        self,
        history: Sequence[AnyMessage],
        tokens: Sequence[int],
        folded: int,
        system_tokens: int,
        running: RunningSummary | None,
        *,
        fold: bool = True,
    ) -> tuple[RunningSummary | None, int]:
        """The turn's step 4 (docs/design.md), as a turn does it: the history before the new
        messages, with them, within the policy's hard bound, folding synchronously first when it is
        not (``fold``; without it, only the check that some fold could); else ContextOverBound."""
        start, opens_turn = new_messages_start(history, folded)
        new = tokens[start:]
        new_tokens = sum(new) + ROLE_OVERHEAD_TOKENS * (len(new) - 1) if new else 0
        stored = history[:start]
        for _ in range(SYNC_FOLD_ATTEMPTS):
            state = self._state(stored, tokens, folded, running, system_tokens)
            pre_turn = decide_before_turn(state, self.policy, new_tokens, opens_turn=opens_turn)
            if not pre_turn.fits:
                raise ContextOverBound(self._too_big(opens_turn))
            if pre_turn.fold is None or not fold:
                return running, folded
            running = self._fold(history, pre_turn.fold, running, self.clock())
            folded = pre_turn.fold.to_seq
        raise ContextOverBound(
            f"The history could not be brought within policy {self.policy.name!r}'s bound in "
            f"{SYNC_FOLD_ATTEMPTS} synchronous folds (the summary stays over the cap it was "
            "planned with)."
        )

    def _too_big(self, opens_turn: bool) -> str:
        bound = (
            f"policy {self.policy.name!r}: context_size={self.policy.context_size}, "
            f"max_memory_tokens={self.policy.max_memory_tokens}, "
            f"model_context_tokens={self.model_context_tokens}"
        )
        if opens_turn:
            return (
                f"The newest message does not fit the context bound ({bound}) even after folding "
                "the whole history before it into the summary; send a shorter message."
            )
        return (
            f"The turn in progress (a human message, tool calls and their results) does not fit "
            f"the context bound ({bound}) even with everything before it folded, and a turn is "
            "never split by a fold: start a new turn, or use a policy with a larger bound."
        )

    def _state(
        self,
        history: Sequence[AnyMessage],
        tokens: Sequence[int],
        folded: int,
        running: RunningSummary | None,
        system_tokens: int,
    ) -> ChatState:
        summary = running.summary if running else ""
        last_summarized_at = running.last_summarized_at if running else None
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
        """The summarizer contract: a full rewrite under the cap; one stricter retry if over."""
        prompt: list[BaseMessage] = [
            SystemMessage(summary_instructions(self.cap)),
            HumanMessage(format_fold_input(summary, messages)),
        ]
        replaces = replaced_tokens(summary, messages, None)
        draft = self.model.invoke(prompt)
        try:
            return self._validated(draft, replaces)
        except SummarizerError as error:
            if error.kind != "over_cap":
                raise
        retry = [
            *prompt,
            draft,
            HumanMessage(shorten_request(self.token_counter(message_text(draft)), self.cap)),
        ]
        return self._validated(self.model.invoke(retry), replaces)

    @property
    def cap(self) -> int:
        return self.policy.summary_token_cap

    def _validated(self, response: BaseMessage, replaces: int) -> str:
        finish = (response.response_metadata or {}).get("finish_reason")
        return validate_summary(
            message_text(response), finish, self.cap, None, headings=True, replaces=replaces
        )

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


def new_messages_start(history: Sequence[AnyMessage], folded: int) -> tuple[int, bool]:
    """Where the messages a turn would send begin in ``history``, and whether they open a turn.
    As the service's exchange (conversations/services/exchanges.py): every message after the
    last assistant message is new, and they open a turn when the first of them is a human
    message (everything before it may be folded); tool results first continue the newest turn,
    which is kept whole. A history that ends with an assistant message has no new messages; one
    with unanswered tool calls is a turn in progress. Never before ``folded``: folded messages
    are not sent."""
    after_reply = 0
    for index, message in enumerate(history):
        if isinstance(message, AIMessage):
            after_reply = index + 1
    start = max(after_reply, folded)
    if start < len(history):
        return start, isinstance(history[start], HumanMessage)
    last = history[-1] if history else None
    return start, not (isinstance(last, AIMessage) and bool(last.tool_calls))


def already_folded(history: Sequence[AnyMessage], running: RunningSummary | None) -> int:
    """How many of ``history``'s oldest messages the running summary covers. In equal-keys mode
    the folded messages were removed from the state, so none of the ids is found: 0."""
    if running is None or running.last_summarized_message_id is None:
        return 0
    for index, message in enumerate(history):
        if message.id == running.last_summarized_message_id:
            return index + 1
    return 0
