"""The SummarizationNode (docs/policies.md) in a real LangGraph graph, with fake chat models (no
network). It keeps the service's hard bound (promise 2, docs/design.md: a synchronous fold before
the model call, else a clear refusal, never an over-bound history), and refuses duplicated message
ids (exactly-once folding rests on them).

Needs the ``langgraph`` extra (``pip install -e '.[test,langgraph]'``, as scripts/test.sh does):
skipped loudly without it, and a failure under CI=true."""

from __future__ import annotations

from typing import Annotated, Any, TypedDict

import pytest

from tests.conftest import require
from tests.support.fake_openai import read_fold_input

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

    from conversations.chat_model.tokens import count_tokens
    from memory_worker import graph_node
    from memory_worker.engine.presets import resolve_policy
    from memory_worker.graph_node import (
        SUMMARY_MESSAGE_ID,
        RunningSummary,
        SummarizationNode,
        message_text,
    )

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
        def inputs(self) -> list[str]:
            """Each fold's input: the last message of its prompt."""
            return [str(prompt[-1].content) for prompt in self.prompts]

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
    return [read_fold_input(str(prompt[-1].content))[0] for prompt in summarizer.prompts]


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
    assert existing[0] == ""  # NONE
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
    from memory_worker.engine.presets import PRESETS

    with pytest.raises(ValueError, match="overrides apply to a preset name"):
        SummarizationNode(
            model=RecordingSummarizer(prompts=[]),
            policy=PRESETS["token-budget"],
            overrides={"max_tokens": 100},
        )


# The hard bound (a synchronous fold before the model call, else a clear refusal) and message
# ids (exactly-once folding rests on them).


def history_of(output: list[Any]) -> list[Any]:
    """The output without its leading system messages and summary message."""
    return [m for m in output if not isinstance(m, SystemMessage)]


def tokens_of(messages: list[Any]) -> int:
    return sum(count_tokens(message_text(m)) for m in messages)


def tight_window_node(summarizer: Any) -> Any:
    """sliding-window (no background fold due for 40 messages) under a 300-token hard bound."""
    return SummarizationNode(
        model=summarizer,
        policy="sliding-window",
        overrides={"max_memory_tokens": 300, "summary_token_cap": 64},
    )


def long_turns(count: int) -> list[Any]:
    """``count`` complete turns of about 130 tokens, tagged [u1] [a1] ..."""
    messages: list[Any] = []
    for number in range(1, count + 1):
        messages += [
            HumanMessage(f"[u{number}] " + "detail " * 60, id=f"h{number}"),
            AIMessage(f"[a{number}] " + "ok " * 60, id=f"a{number}"),
        ]
    return messages


def react_turn(calls: int) -> list[Any]:
    """One earlier turn, then a human message and ``calls`` tool calls with their results."""
    messages: list[Any] = [
        HumanMessage("[u1] " + "detail " * 40, id="h1"),
        AIMessage("[a1] " + "ok " * 40, id="a1"),
        HumanMessage("[u2] research this", id="h2"),
    ]
    for number in range(calls):
        call = {"name": "search", "args": {"q": f"q{number}"}, "id": f"t{number}"}
        messages += [
            AIMessage("", tool_calls=[call], id=f"c{number}"),
            ToolMessage("result " * 60, tool_call_id=f"t{number}", id=f"r{number}"),
        ]
    return messages


def test_a_tool_loop_over_the_bound_is_refused_not_returned_over_it() -> None:
    """A ReAct turn under token-budget with max_memory_tokens 400 is over the bound by itself,
    and the turn in progress cannot be split, so nothing can fit: rather than return a history
    over the bound, the node raises the service's context_over_bound counterpart, before any
    summarizer call."""
    summarizer = RecordingSummarizer(prompts=[])
    node = SummarizationNode(model=summarizer, policy="token-budget", overrides=SMALL_BUDGET)
    assert "ContextOverBound" in graph_node.__all__
    with pytest.raises(graph_node.ContextOverBound, match="turn in progress"):
        node.invoke({"messages": react_turn(12), "context": {}})
    assert summarizer.prompts == []


def test_a_tool_loop_folds_the_turns_before_it_synchronously() -> None:
    """sliding-window keeps a 40-message tail, so no background fold is due; the hard bound
    (max_memory_tokens 300) is over. The synchronous fold takes the earlier turn only: the turn
    in progress (human message, call) stays whole before its new tool result."""
    summarizer = RecordingSummarizer(prompts=[])
    node = SummarizationNode(
        model=summarizer,
        policy="sliding-window",
        overrides={"max_memory_tokens": 300, "summary_token_cap": 64},
    )
    messages = react_turn(1)
    messages[0] = HumanMessage("[u1] " + "detail " * 300, id="h1")
    assert tokens_of(messages[:-1]) > 300
    result = node.invoke({"messages": messages, "context": {}})
    output = result["summarized_messages"]
    assert output[0].id == SUMMARY_MESSAGE_ID
    assert [m.id for m in output[1:]] == ["h2", "c0", "r0"]
    assert len(summarizer.inputs) == 1
    assert "[u1]" in summarizer.inputs[0] and "[a1]" in summarizer.inputs[0]
    assert "[u2]" not in summarizer.inputs[0]
    running = result["context"]["running_summary"]
    assert running.last_summarized_message_id == "a1"
    assert running.summarized_message_ids == {"h1", "a1"}
    assert tokens_of(output[:-1]) <= 300  # the history; the new tool result comes on top


def test_a_new_message_over_the_bound_folds_the_whole_history_before_it() -> None:
    """A human message opens a turn: everything before it may be folded, as a REST turn does."""
    summarizer = RecordingSummarizer(prompts=[])
    node = tight_window_node(summarizer)
    messages = long_turns(3)
    messages.append(HumanMessage("[u4] and now?", id="h4"))
    result = node.invoke({"messages": [SystemMessage("Be brief."), *messages], "context": {}})
    output = result["summarized_messages"]
    assert output[1].id == SUMMARY_MESSAGE_ID
    kept = history_of(output)
    assert [m.id for m in kept] == ["h3", "a3", "h4"]  # folded just enough, in one call
    assert len(summarizer.inputs) == 1
    assert tokens_of(kept[:-1]) + count_tokens(result["context"]["running_summary"].summary) <= 300
    # Gap-free and exactly once: each earlier message is verbatim or was folded once.
    folded_input = " ".join(summarizer.inputs)
    for number in range(1, 4):
        for tag in (f"[u{number}]", f"[a{number}]"):
            verbatim = any(tag in str(m.content) for m in kept)
            assert (verbatim, folded_input.count(tag)) in ((True, 0), (False, 1)), tag


def test_a_message_too_large_for_the_prompt_is_refused() -> None:
    node = SummarizationNode(
        model=RecordingSummarizer(prompts=[]), policy="token-budget", model_context_tokens=200
    )
    with pytest.raises(graph_node.ContextOverBound, match="newest message does not fit"):
        node.invoke({"messages": [HumanMessage("word " * 300, id="h1")], "context": {}})


def test_a_backlog_over_ten_folds_still_ends_within_context_size() -> None:
    """turn-digest folds one turn per decision, at most 10 per call: paced that way, a 30-turn
    backlog would stay over context_size 24. Past its bound's threshold the overflow fold is not
    paced by max_fold_turns: one fold takes the backlog down to the policy's full-detail turns
    (the new one and two before it)."""
    summarizer = RecordingSummarizer(prompts=[])
    node = SummarizationNode(model=summarizer, policy="turn-digest")
    policy = resolve_policy("turn-digest", {})
    assert policy.context_size is not None
    messages: list[Any] = []
    for number in range(30):
        messages += [
            HumanMessage(f"[u{number}]", id=f"h{number}"),
            AIMessage(f"[a{number}]", id=f"a{number}"),
        ]
    messages.append(HumanMessage("[new]", id="hn"))
    result = node.invoke({"messages": messages, "context": {}})
    kept = history_of(result["summarized_messages"])
    assert len(kept) - 1 <= policy.context_size  # the new message comes on top of the bound
    assert [m.id for m in kept] == ["h28", "a28", "h29", "a29", "hn"]
    assert len(summarizer.inputs) == 1
    folded_input = " ".join(summarizer.inputs)
    for number in range(28):
        assert folded_input.count(f"[u{number}]") == 1, number
    assert result["context"]["running_summary"].last_summarized_message_id == "a27"


def test_a_duplicated_id_is_refused_before_anything_is_folded() -> None:
    """The id of the summary's last message reappears earlier in the list: with the first of
    the two as the watermark, messages would be folded a second time and shown verbatim too."""
    summarizer = RecordingSummarizer(prompts=[])
    node = SummarizationNode(model=summarizer, policy="token-budget", overrides=SMALL_BUDGET)
    messages: list[Any] = []
    for number in range(6):
        messages += [
            HumanMessage(f"[u{number}] " + "detail " * 90, id=f"h{number}"),
            AIMessage(f"[a{number}] ok", id=f"a{number}"),
        ]
    messages.append(HumanMessage("[u6] now", id="h6"))
    first = node.invoke({"messages": messages, "context": {}})
    last = first["context"]["running_summary"].last_summarized_message_id
    assert last is not None and last != "a0"
    calls = len(summarizer.inputs)
    reused = [AIMessage("[a0] ok", id=last) if m.id == "a0" else m for m in messages]
    later = [*reused, AIMessage("x", id="a6"), HumanMessage("[u7]", id="h7")]
    with pytest.raises(ValueError, match=f"message id '{last}' appears more than once"):
        node.invoke({"messages": later, "context": first["context"]})
    assert len(summarizer.inputs) == calls  # nothing folded again


def test_a_duplicated_id_is_refused_in_equal_keys_mode_too() -> None:
    """add_messages would merge the two: one of them would leave the state unfolded."""
    node = SummarizationNode(
        model=RecordingSummarizer(prompts=[]), policy="token-budget", output_messages_key="messages"
    )
    messages = [HumanMessage("one", id="x"), AIMessage("two", id="y"), HumanMessage("3", id="x")]
    with pytest.raises(ValueError, match="message id 'x' appears more than once"):
        node.invoke({"messages": messages, "context": {}})


def test_equal_keys_without_ids_do_not_show_folded_messages_again() -> None:
    """In equal-keys mode ids are optional: without them there is no last folded id to count
    the folded messages from, and they must still not come back verbatim beside their own
    summary."""
    summarizer = RecordingSummarizer(prompts=[])
    node = SummarizationNode(
        model=summarizer,
        policy="token-budget",
        overrides=SMALL_BUDGET,
        output_messages_key="messages",
    )
    messages: list[Any] = []
    for number in range(6):
        messages += [
            HumanMessage(f"[u{number}] " + "detail " * 60),
            AIMessage(f"[a{number}] ok"),
        ]
    messages.append(HumanMessage("[u6] now"))
    output = node.invoke({"messages": messages, "context": {}})["messages"]
    assert summarizer.inputs
    folded_input = " ".join(summarizer.inputs)
    for number in range(7):
        tag = f"[u{number}]"
        verbatim = any(tag in str(m.content) for m in output if m.id != SUMMARY_MESSAGE_ID)
        assert (verbatim, folded_input.count(tag)) in ((True, 0), (False, 1)), tag


def test_two_human_messages_after_the_last_reply_are_both_new() -> None:
    """As the service's exchange takes them: every message after the last reply is new. With
    only the newest taken as new, the first of two could be folded without its answer-to-be (a
    fold of just "[u3a]" here) while the second went on verbatim."""
    summarizer = RecordingSummarizer(prompts=[])
    node = tight_window_node(summarizer)
    messages = long_turns(2)
    messages += [
        HumanMessage("[u3a] " + "first half " * 150, id="h3a"),
        HumanMessage("[u3b] second half", id="h3b"),
    ]
    result = node.invoke({"messages": messages, "context": {}})
    kept = history_of(result["summarized_messages"])
    assert [m.id for m in kept][-2:] == ["h3a", "h3b"]
    assert not any("[u3a]" in text for text in summarizer.inputs)
