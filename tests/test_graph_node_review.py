"""Review of the LangGraph SummarizationNode: it keeps the service's hard bound (DESIGN promise 2:
a synchronous fold before the model call, else a clear refusal, never an over-bound history), and
refuses duplicated message ids (exactly-once folding rests on them).

Needs the ``langgraph`` extra, as tests/test_graph_node.py."""

from __future__ import annotations

from typing import Any

import pytest

from tests.conftest import require

try:
    from langchain_core.language_models import BaseChatModel
    from langchain_core.messages import (
        AIMessage,
        BaseMessage,
        HumanMessage,
        SystemMessage,
        ToolMessage,
    )
    from langchain_core.outputs import ChatGeneration, ChatResult

    from memory_worker import graph_node
    from memory_worker.graph_node import SUMMARY_MESSAGE_ID, SummarizationNode, message_text
    from memory_worker.presets import resolve_policy
    from memory_worker.tokens import count_tokens

    HAVE_LANGGRAPH = True
except ImportError as error:  # pragma: no cover - depends on the installed extras
    HAVE_LANGGRAPH = False
    MISSING = str(error)


@pytest.fixture(autouse=True)
def _langgraph_installed() -> None:
    if not HAVE_LANGGRAPH:
        require("the langgraph extra", MISSING)


if HAVE_LANGGRAPH:

    class Summarizer(BaseChatModel):
        """Answers every fold with a short valid summary and keeps each fold's input."""

        inputs: list[str] = []

        def _generate(self, messages: list[BaseMessage], *args: Any, **kwargs: Any) -> ChatResult:
            self.inputs.append(str(messages[-1].content))
            text = (
                f"## Facts / Constraints\n- fold {len(self.inputs)}\n"
                "## Goals / Preferences\n- None\n## Decisions\n- None"
            )
            return ChatResult(generations=[ChatGeneration(message=AIMessage(text))])

        @property
        def _llm_type(self) -> str:
            return "review-summarizer"

    BUDGET = {
        "max_tokens": 400,
        "max_summary_tokens": 60,
        "max_memory_tokens": 400,
        "summary_token_cap": 64,
    }


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
    """The repro: a ReAct turn under token-budget with max_memory_tokens 400 came out as 1,008
    tokens with no error. The turn in progress cannot be split, so nothing can fit: the node
    raises the service's context_over_bound counterpart, before any summarizer call."""
    summarizer = Summarizer(inputs=[])
    node = SummarizationNode(model=summarizer, policy="token-budget", overrides=BUDGET)
    assert "ContextOverBound" in graph_node.__all__
    with pytest.raises(graph_node.ContextOverBound, match="turn in progress"):
        node.invoke({"messages": react_turn(12), "context": {}})
    assert summarizer.inputs == []


def test_a_tool_loop_folds_the_turns_before_it_synchronously() -> None:
    """sliding-window keeps a 40-message tail, so no background fold is due; the hard bound
    (max_memory_tokens 300) is over. The synchronous fold takes the earlier turn only: the turn
    in progress (human message, call) stays whole before its new tool result."""
    summarizer = Summarizer(inputs=[])
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
    summarizer = Summarizer(inputs=[])
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
        model=Summarizer(inputs=[]), policy="token-budget", model_context_tokens=200
    )
    with pytest.raises(graph_node.ContextOverBound, match="newest message does not fit"):
        node.invoke({"messages": [HumanMessage("word " * 300, id="h1")], "context": {}})


def test_a_backlog_over_ten_folds_still_ends_within_context_size() -> None:
    """The repro: turn-digest folds one turn per decision, at most 10 per call; a 30-turn
    backlog came out as 41 messages against context_size 24. Past its bound's threshold the
    overflow fold is not paced by max_fold_turns: one fold takes the backlog down to the
    policy's full-detail turns (the new one and two before it)."""
    summarizer = Summarizer(inputs=[])
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
    """The repro: the id of the summary's last message reappeared earlier in the list; the
    node took the first one as the watermark, folded messages a second time and showed them
    verbatim too."""
    summarizer = Summarizer(inputs=[])
    node = SummarizationNode(model=summarizer, policy="token-budget", overrides=BUDGET)
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
        model=Summarizer(inputs=[]), policy="token-budget", output_messages_key="messages"
    )
    messages = [HumanMessage("one", id="x"), AIMessage("two", id="y"), HumanMessage("3", id="x")]
    with pytest.raises(ValueError, match="message id 'x' appears more than once"):
        node.invoke({"messages": messages, "context": {}})


def test_equal_keys_without_ids_do_not_show_folded_messages_again() -> None:
    """In equal-keys mode ids are optional; the folded count came from the last folded id, so
    without ids the folded messages were returned verbatim beside their own summary."""
    summarizer = Summarizer(inputs=[])
    node = SummarizationNode(
        model=summarizer, policy="token-budget", overrides=BUDGET, output_messages_key="messages"
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
    """As the service's exchange takes them: every message after the last reply is new. Only
    the newest was, so the first of two could be folded without its answer-to-be (a fold of
    just "[u3a]" here) while the second went on verbatim."""
    summarizer = Summarizer(inputs=[])
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
