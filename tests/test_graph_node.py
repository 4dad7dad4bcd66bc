"""Seed 002's SummarizationNode in a real LangGraph graph, with fake chat models (no network).

Needs the ``langgraph`` extra (``pip install -e '.[test,langgraph]'``, as scripts/test.sh does):
skipped loudly without it, and a failure under CI=true."""

from __future__ import annotations

from typing import Annotated, Any, TypedDict

import pytest

from tests.conftest import require

try:
    from langchain_core.language_models import BaseChatModel
    from langchain_core.messages import (
        AIMessage,
        AnyMessage,
        BaseMessage,
        HumanMessage,
        SystemMessage,
        ToolMessage,
    )
    from langchain_core.outputs import ChatGeneration, ChatResult
    from langgraph.graph import END, START, StateGraph
    from langgraph.graph.message import add_messages

    from memory_worker.graph_node import SUMMARY_MESSAGE_ID, RunningSummary, SummarizationNode

    HAVE_LANGGRAPH = True
except ImportError as error:  # pragma: no cover - depends on the installed extras
    HAVE_LANGGRAPH = False
    MISSING = str(error)


@pytest.fixture(autouse=True)
def _langgraph_installed() -> None:
    if not HAVE_LANGGRAPH:
        require("the langgraph extra", MISSING)


if HAVE_LANGGRAPH:

    class RecordingSummarizer(BaseChatModel):
        """Answers every fold with a short summary naming the fold, and keeps every prompt."""

        prompts: list[list[BaseMessage]] = []

        def _generate(self, messages: list[BaseMessage], *args: Any, **kwargs: Any) -> ChatResult:
            self.prompts.append(list(messages))
            text = (
                f"## Facts / Constraints\n- fold {len(self.prompts)}\n"
                "## Goals / Preferences\n- None\n## Decisions\n- None"
            )
            return ChatResult(generations=[ChatGeneration(message=AIMessage(text))])

        @property
        def _llm_type(self) -> str:
            return "recording-summarizer"

    class Echo(BaseChatModel):
        """The graph's chat model: says how many messages it was given."""

        seen: list[list[BaseMessage]] = []

        def _generate(self, messages: list[BaseMessage], *args: Any, **kwargs: Any) -> ChatResult:
            self.seen.append(list(messages))
            reply = f"reply {len(self.seen)}: " + "words " * 30
            return ChatResult(generations=[ChatGeneration(message=AIMessage(reply))])

        @property
        def _llm_type(self) -> str:
            return "echo"

    class State(TypedDict, total=False):
        messages: Annotated[list[AnyMessage], add_messages]
        summarized_messages: list[AnyMessage]
        context: dict[str, Any]

    SMALL_BUDGET = {
        "max_tokens": 400,
        "max_summary_tokens": 60,
        "max_memory_tokens": 400,
        "summary_token_cap": 64,
    }


def build_graph(summarizer: Any, chat: Any, *, same_keys: bool = False) -> Any:
    output_key = "messages" if same_keys else "summarized_messages"
    node = SummarizationNode(
        model=summarizer,
        policy="token-budget",
        overrides=SMALL_BUDGET,
        output_messages_key=output_key,
    )

    def call_model(state: State) -> dict[str, Any]:
        return {"messages": [chat.invoke(state[output_key])]}  # type: ignore[literal-required]

    return summarize_then_call(State, node, call_model)


def summarize_then_call(state_type: Any, node: Any, call_model: Any) -> Any:
    """START -> the summarization node -> the chat model -> END."""
    graph = StateGraph(state_type)
    graph.add_node("summarize", node)
    graph.add_node("call_model", call_model)
    graph.add_edge(START, "summarize")
    graph.add_edge("summarize", "call_model")
    graph.add_edge("call_model", END)
    return graph.compile()


def user_text(number: int) -> str:
    return f"[u{number}] " + "detail " * 25


def test_every_message_is_verbatim_or_folded_once() -> None:
    summarizer, chat = RecordingSummarizer(prompts=[]), Echo(seen=[])
    graph = build_graph(summarizer, chat)
    state: dict[str, Any] = {"messages": [SystemMessage("You are helpful.")], "context": {}}
    for number in range(1, 21):
        state["messages"] = [*state["messages"], HumanMessage(user_text(number))]
        state = graph.invoke(state)
    running: RunningSummary = state["context"]["running_summary"]
    assert len(summarizer.prompts) >= 2  # the budget forced several folds
    folded_inputs = [prompt[-1].content for prompt in summarizer.prompts]
    for number in range(1, 21):
        tag = f"[u{number}]"
        sent_to_summarizer = sum(str(text).count(tag) for text in folded_inputs)
        verbatim = any(tag in str(m.content) for m in state["summarized_messages"])
        # Exactly one of: still verbatim in what the model sees, or folded exactly once.
        assert (verbatim, sent_to_summarizer) in ((True, 0), (False, 1)), tag
    # What the model saw last: system prompt, then the running summary, then unfolded messages.
    last = chat.seen[-1]
    assert last[0].content == "You are helpful."
    assert last[1].id == SUMMARY_MESSAGE_ID and running.summary in str(last[1].content)
    assert running.last_summarized_message_id in running.summarized_message_ids
    assert isinstance(last[-1], HumanMessage) and "[u20]" in str(last[-1].content)


def test_equal_keys_remove_the_folded_messages_from_state() -> None:
    summarizer, chat = RecordingSummarizer(prompts=[]), Echo(seen=[])
    graph = build_graph(summarizer, chat, same_keys=True)
    state: dict[str, Any] = {"messages": [], "context": {}}
    for number in range(1, 16):
        state["messages"] = [*state["messages"], HumanMessage(user_text(number))]
        state = graph.invoke(state)
    assert summarizer.prompts, "no fold happened"
    messages = state["messages"]
    assert messages[0].id == SUMMARY_MESSAGE_ID
    assert "[u1]" not in " ".join(str(m.content) for m in messages)  # folded, removed
    assert "[u15]" in str(messages[-2].content)  # the newest turn stays verbatim
    # No message was sent to the summarizer twice, although each run re-reads the state.
    inputs = " ".join(str(prompt[-1].content) for prompt in summarizer.prompts)
    assert all(inputs.count(f"[u{n}]") <= 1 for n in range(1, 16))


def test_a_fold_never_separates_a_tool_call_from_its_result() -> None:
    summarizer = RecordingSummarizer(prompts=[])
    node = SummarizationNode(model=summarizer, policy="token-budget", overrides=SMALL_BUDGET)
    messages: list[Any] = []
    for number in range(1, 9):
        call = {"name": "lookup", "args": {"q": str(number)}, "id": f"call{number}"}
        messages += [
            HumanMessage(user_text(number), id=f"u{number}"),
            AIMessage("", tool_calls=[call], id=f"a{number}"),
            ToolMessage("result " * 20, tool_call_id=f"call{number}", id=f"t{number}"),
        ]
    result = node.invoke({"messages": messages, "context": {}})
    running: RunningSummary = result["context"]["running_summary"]
    assert summarizer.prompts
    assert running.last_summarized_message_id is not None
    assert running.last_summarized_message_id.startswith("t")  # a turn ends at its tool result
    first_kept = result["summarized_messages"][1]  # after the summary message
    assert isinstance(first_kept, HumanMessage)


def existing_summaries(summarizer: Any) -> list[str]:
    return [
        str(prompt[-1].content)
        .split("=== EXISTING_SUMMARY ===")[1]
        .split("=== END_EXISTING_SUMMARY ===")[0]
        .strip()
        for prompt in summarizer.prompts
    ]


def test_equal_keys_in_messages_state_keep_the_summary_across_calls() -> None:
    """LangGraph's MessagesState has no "context" key and drops the node's update to it: every
    fold started from no summary, so everything folded before was lost."""
    from langgraph.graph import MessagesState

    summarizer, chat = RecordingSummarizer(prompts=[]), Echo(seen=[])
    node = SummarizationNode(
        model=summarizer,
        policy="token-budget",
        overrides=SMALL_BUDGET,
        output_messages_key="messages",
    )

    def call_model(state: MessagesState) -> dict[str, Any]:
        return {"messages": [chat.invoke(state["messages"])]}

    graph = summarize_then_call(MessagesState, node, call_model)
    state: dict[str, Any] = {"messages": []}
    for number in range(1, 16):
        state = graph.invoke({"messages": [*state["messages"], HumanMessage(user_text(number))]})
    existing = existing_summaries(summarizer)
    assert len(existing) >= 2
    assert existing[0] == "NONE"
    # Every later fold rewrites the previous one: "fold 1" is carried into fold 2, and so on.
    for number, text in enumerate(existing[1:], start=1):
        assert f"fold {number}" in text, (number, text)


def test_a_running_summary_given_back_as_a_mapping_is_read() -> None:
    """LangGraph's strict msgpack mode gives an unregistered dataclass back as a dict."""
    summarizer = RecordingSummarizer(prompts=[])
    node = SummarizationNode(model=summarizer, policy="token-budget", overrides=SMALL_BUDGET)
    messages = [HumanMessage(user_text(n), id=f"u{n}") for n in range(1, 4)]
    running = {
        "summary": "## Facts / Constraints\n- earlier",
        "summarized_message_ids": ["u1"],
        "last_summarized_message_id": "u1",
    }
    result = node.invoke({"messages": messages, "context": {"running_summary": running}})
    output = result["summarized_messages"]
    assert output[0].id == SUMMARY_MESSAGE_ID and "- earlier" in str(output[0].content)
    assert [m.id for m in output[1:]] == ["u2", "u3"]  # u1 is covered by the summary
    assert isinstance(result["context"]["running_summary"], RunningSummary)


def test_tool_call_arguments_count_toward_the_bound() -> None:
    """An assistant message with tool calls and no text counted as 0 tokens: a tool-heavy agent
    never folded, however large its calls' arguments."""
    summarizer = RecordingSummarizer(prompts=[])
    node = SummarizationNode(model=summarizer, policy="token-budget", overrides=SMALL_BUDGET)
    messages: list[Any] = []
    for number in range(1, 5):
        call = {"name": "write_file", "args": {"text": "data " * 150}, "id": f"c{number}"}
        messages += [
            HumanMessage(f"[u{number}] save it", id=f"u{number}"),
            AIMessage("", tool_calls=[call], id=f"a{number}"),
            ToolMessage("ok", tool_call_id=f"c{number}", id=f"t{number}"),
        ]
    node.invoke({"messages": messages, "context": {}})
    assert summarizer.prompts, "the calls' arguments are far over the 400-token bound"
    assert "write_file" in str(summarizer.prompts[0][-1].content)  # the summarizer sees them


def test_a_cooldown_counts_from_the_last_fold() -> None:
    """sliding-window with a small tail: with no time of the last fold, every turn past the
    tail found the cooldown elapsed and folded one turn (a summarizer call per turn)."""
    from datetime import UTC, datetime

    summarizer = RecordingSummarizer(prompts=[])
    now = datetime(2026, 1, 1, tzinfo=UTC)
    node = SummarizationNode(
        model=summarizer,
        policy="sliding-window",
        overrides={"tail_messages": 4, "window": 12},
        clock=lambda: now,
    )
    messages: list[Any] = []
    context: dict[str, Any] = {}
    for number in range(1, 13):
        messages += [
            HumanMessage(f"[u{number}]", id=f"u{number}"),
            AIMessage(f"[a{number}]", id=f"a{number}"),
        ]
        context = node.invoke({"messages": messages, "context": context})["context"]
    # tail_messages 4 keeps the newest two turns, so the backlog after turn n is turns
    # 1..n-2. Turn 3: the first fold, of turn 1 (the cooldown has no start yet). Then the clock
    # stands still (no cooldown) and the window of 12 messages is reached at turn 9: turns 2-7.
    # The next would be due at turn 15.
    assert len(summarizer.prompts) == 2, len(summarizer.prompts)
    folded_per_prompt = [
        [n for n in range(1, 13) if f"[u{n}]" in str(prompt[-1].content)]
        for prompt in summarizer.prompts
    ]
    assert folded_per_prompt == [[1], [2, 3, 4, 5, 6, 7]]
    running = context["running_summary"]
    assert running.last_summarized_message_id == "a7"
    assert running.summarized_message_ids == {f"{r}{n}" for r in "ua" for n in range(1, 8)}


def test_messages_without_ids_are_refused_clearly() -> None:
    node = SummarizationNode(model=RecordingSummarizer(prompts=[]), policy="token-budget")
    with pytest.raises(ValueError, match="needs an id"):
        node.invoke({"messages": [HumanMessage("no id")], "context": {}})


def test_overrides_with_a_policy_object_are_refused() -> None:
    from memory_worker.presets import PRESETS

    with pytest.raises(ValueError, match="overrides apply to a preset name"):
        SummarizationNode(
            model=RecordingSummarizer(prompts=[]),
            policy=PRESETS["token-budget"],
            overrides={"max_tokens": 100},
        )
