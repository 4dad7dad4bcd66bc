"""Seed 004's agent state (docs/agent-state.md) against the review's findings: tool loops through
/v1 (the final reply is summarised, the state does not depend on when the worker runs, a long
loop does not stall it), a backlog under the task's time limit, and the token bound of the
agent-state block."""

from types import SimpleNamespace
from typing import Any

import pytest
from rest_framework.authtoken.models import Token
from rest_framework.test import APIClient

import tests.fake_openai as fake_module
from conversations.agent_state import offline_response_summary
from conversations.models import AgentState, Chat, ResponseSummary
from conversations.services import agent_state as service
from memory_worker import agent_summaries
from memory_worker.agent_summaries import summarize_turns
from memory_worker.tokens import count_tokens

pytestmark = pytest.mark.django_db

FINAL = "Done! I saved the recipes Spicy Rice Bowl and Miso Salmon Bowl to your cookbook. " + (
    "More details about the cookbook follow here. " * 12
)
TOOLS = [{"type": "function", "function": {"name": "save", "parameters": {"type": "object"}}}]


@pytest.fixture
def v1(user, use_fake_openai, settings) -> APIClient:  # type: ignore[no-untyped-def]
    """A /v1 client on a turn-digest chat (agent state for plain turns), with replies long
    enough to be summarised, offline so that only the turns reach the fake model."""
    settings.MEMORY_POLICY = "turn-digest"
    settings.AGENT_SUMMARY_BACKEND = "offline"
    use_fake_openai.reply_fn = lambda body: FINAL
    client = APIClient()
    client.credentials(HTTP_AUTHORIZATION=f"Bearer {Token.objects.get_or_create(user=user)[0].key}")
    return client


def exchange(client: APIClient, chat: str, message: dict[str, Any]) -> dict[str, Any]:
    body = {"model": "default", "user": chat, "tools": TOOLS, "messages": [message]}
    response = client.post("/v1/chat/completions", body, format="json")
    assert response.status_code == 200, response.content
    return dict(response.json()["choices"][0])


def tool_result(choice: dict[str, Any]) -> dict[str, Any]:
    call_id = choice["message"]["tool_calls"][0]["id"]
    return {"role": "tool", "tool_call_id": call_id, "content": '{"ok": true}'}


def chat_id_of(name: str) -> int:
    return int(Chat.objects.get(external_id=name).pk)


def agent_state_of(chat_id: int) -> dict[str, Any]:
    stored = AgentState.objects.get(chat_id=chat_id)
    summaries = ResponseSummary.objects.filter(chat_id=chat_id).order_by("seq")
    return {
        "processed_seq": stored.processed_seq,
        "turns": stored.turns,
        "summaries": list(summaries.values_list("seq", "summary", "source")),
        "theme": stored.engagement_summary,
    }


# ---------------------------------------------------------------------------------------------
# Tool loops (findings 1 and 2)


def tool_round(client: APIClient, name: str, run_worker_between: bool) -> int:
    """One /v1 tool round: the user's request answered by a tool call, then the tool result
    answered by the final reply, in two requests; the worker runs after each request, or only
    after the last (it was busy)."""
    first = exchange(client, name, {"role": "user", "content": "CALL_TOOL:save the recipes"})
    assert first["finish_reason"] == "tool_calls"
    chat_id = chat_id_of(name)
    if run_worker_between:
        summarize_turns(chat_id, 1)
    final = exchange(client, name, tool_result(first))
    assert final["finish_reason"] == "stop"
    summarize_turns(chat_id)
    return chat_id


def test_a_v1_tool_round_is_summarised_by_its_final_reply_whenever_the_worker_runs(v1) -> None:  # type: ignore[no-untyped-def]
    """The turn closed at the tool call: when the worker ran between the two requests, the
    final reply (seq 4) was never summarised and the watermark stayed at the tool call."""
    prompt = tool_round(v1, "worker-prompt", run_worker_between=True)
    late = tool_round(v1, "worker-late", run_worker_between=False)
    expected = [(4, offline_response_summary(FINAL, []), "offline")]
    assert agent_state_of(prompt) == agent_state_of(late)
    assert agent_state_of(prompt)["summaries"] == expected
    assert agent_state_of(prompt)["processed_seq"] == 4
    assert agent_state_of(prompt)["turns"] == 1


def test_an_unanswered_tool_call_waits_for_the_rest_of_the_turn(v1) -> None:  # type: ignore[no-untyped-def]
    exchange(v1, "waiting", {"role": "user", "content": "CALL_TOOL:save the recipes"})
    chat_id = chat_id_of("waiting")
    assert summarize_turns(chat_id, 1) == 0
    assert agent_state_of(chat_id)["processed_seq"] == 0


@pytest.fixture
def long_tool_loop(monkeypatch, settings) -> dict[str, int]:  # type: ignore[no-untyped-def]
    """The fake model answers each tool result with another tool call, ``rounds`` times. The
    sliding-window preset's bound holds a 62-message turn (a turn is never split by a fold);
    the agent state follows the chat all the same (the task is run by hand here)."""
    settings.MEMORY_POLICY = "sliding-window"
    budget = {"rounds": 30}
    plain = fake_module.requested_tool

    def requested_tool(body: dict[str, Any]) -> str | None:
        messages = body.get("messages") or []
        answers_a_tool = bool(messages) and messages[-1].get("role") == "tool"
        if body.get("tools") and answers_a_tool and budget["rounds"] > 0:
            budget["rounds"] -= 1
            return "save"
        return plain(body)

    monkeypatch.setattr(fake_module, "requested_tool", requested_tool)
    return budget


def run_tool_loop(client: APIClient, name: str, run_worker_each_time: bool) -> int:
    choice = exchange(client, name, {"role": "user", "content": "CALL_TOOL:save research this"})
    chat_id = chat_id_of(name)
    summarize_turns(chat_id, 1)
    while choice["finish_reason"] == "tool_calls":
        choice = exchange(client, name, tool_result(choice))
        if run_worker_each_time:
            summarize_turns(chat_id)  # the task each exchange queues
    summarize_turns(chat_id)
    return chat_id


def test_a_thirty_round_tool_loop_does_not_stall_the_agent_state(v1, long_tool_loop) -> None:  # type: ignore[no-untyped-def]
    """Once the first exchange was applied, the loop's 62 later messages had no user message:
    a batch of 60 of them held no complete turn, nothing was applied, and the watermark never
    moved again, even after new turns."""
    chat_id = run_tool_loop(v1, "long-loop", run_worker_each_time=True)
    last_seq = Chat.objects.get(pk=chat_id).last_seq
    assert last_seq == 64  # the user's message, 31 tool calls and their results, the final reply
    after_loop = agent_state_of(chat_id)
    assert after_loop["processed_seq"] == last_seq
    assert after_loop["turns"] == 1  # one user turn, however many batches it took
    assert [seq for seq, *_ in after_loop["summaries"]] == [last_seq]  # the final reply
    # The user carries on: the state keeps following.
    exchange(v1, "long-loop", {"role": "user", "content": "thanks"})
    assert summarize_turns(chat_id) == 1
    assert agent_state_of(chat_id)["processed_seq"] == last_seq + 2
    assert agent_state_of(chat_id)["turns"] == 2


def test_a_long_tool_loop_gives_the_same_state_whenever_the_worker_runs(v1, long_tool_loop) -> None:  # type: ignore[no-untyped-def]
    each_time = run_tool_loop(v1, "loop-each", run_worker_each_time=True)
    long_tool_loop["rounds"] = 30
    at_the_end = run_tool_loop(v1, "loop-end", run_worker_each_time=False)
    assert agent_state_of(each_time) == agent_state_of(at_the_end)


# ---------------------------------------------------------------------------------------------
# The task's time limit (finding 3)


def test_a_backlog_is_committed_turn_by_turn_and_the_rest_handed_on(  # type: ignore[no-untyped-def]
    api, use_fake_openai, settings, monkeypatch
) -> None:
    """A backlog of long replies, each one model call, under a soft time limit that fits about
    three calls: the whole batch was committed at the end, so the limit lost all of it and
    every later task redid the same calls. Now each turn commits, no call starts that cannot
    finish before the deadline, and the rest is handed to a fresh task."""
    use_fake_openai.reply_fn = lambda body: "Here is the full plan for the week. " * 20
    chat_id = api.post("/api/v1/chats/", {"policy": "turn-digest"}, format="json").json()["id"]
    for number in range(8):
        response = api.post(
            f"/api/v1/chats/{chat_id}/turns/", {"content": f"turn {number}"}, format="json"
        )
        assert response.status_code == 201
    clock = {"now": 1000.0}
    # The task's clock only (the module-level name): the HTTP client keeps the real one.
    fake_time = SimpleNamespace(monotonic=lambda: clock["now"])
    monkeypatch.setattr(agent_summaries, "time", fake_time)
    monkeypatch.setattr("memory_worker.folds.time", fake_time)
    settings.LLM_TIMEOUT_SECONDS = settings.MEMORY_LLM_TIMEOUT_SECONDS = 10.0
    settings.MEMORY_TASK_SOFT_TIME_LIMIT = 50  # the deadline: 45 s after the start
    complete = service.get_chat_model().__class__.complete

    def slow_complete(model, messages, *args, **kwargs):  # type: ignore[no-untyped-def]
        clock["now"] += 10.0  # each summary call takes 10 s
        return complete(model, messages, *args, **kwargs)

    monkeypatch.setattr(service.get_chat_model().__class__, "complete", slow_complete)
    handed_on: list[int] = []

    def request_agent_summary(chat_id: int, from_seq: int | None = None) -> bool:
        handed_on.append(chat_id)
        return True

    monkeypatch.setattr(
        "memory_worker.agent_summaries.request_agent_summary", request_agent_summary
    )
    calls_before = len(use_fake_openai.requests)
    started = clock["now"]
    applied = summarize_turns(chat_id, 1, started=started)
    # Calls start at 0, 10, 20 and 30 s (each ends by 45 s); the fifth would end at 50 s.
    assert applied == 4
    assert len(use_fake_openai.requests) - calls_before == 4
    assert AgentState.objects.get(chat_id=chat_id).processed_seq == 8
    assert ResponseSummary.objects.filter(chat_id=chat_id).count() == 4
    assert handed_on == [chat_id]
    # The next task carries on from there; nothing is summarised twice.
    assert summarize_turns(chat_id, 1, started=clock["now"]) == 4
    assert AgentState.objects.get(chat_id=chat_id).processed_seq == 16
    assert len(use_fake_openai.requests) - calls_before == 8


def test_the_task_passes_its_start_to_the_service(monkeypatch) -> None:  # type: ignore[no-untyped-def]
    from memory_worker import tasks

    seen: list[tuple[int, int | None, float | None]] = []

    def summarize_turns(
        chat_id: int, from_seq: int | None = None, started: float | None = None
    ) -> int:
        seen.append((chat_id, from_seq, started))
        return 0

    monkeypatch.setattr(agent_summaries, "summarize_turns", summarize_turns)
    tasks.summarize_agent_turns(7, 3)
    assert seen and seen[0][:2] == (7, 3) and seen[0][2] is not None


# ---------------------------------------------------------------------------------------------
# The token bound of the block (finding 4)

ZH = "请确认这个方案中的每一个细节以及相关的假设条件和约束"


def huge_agent() -> dict[str, Any]:
    """The largest agent object validation accepts, in ordinary Chinese text."""
    return {
        "decision": "propose",
        "goal": (ZH * 30)[:500],
        "proposal_message": (ZH * 200)[:4000],
        "assumptions": [(ZH * 30)[:500] for _ in range(20)],
        "entities": [
            {
                "id": f"r{i}",
                "type": "recipe",
                "label": (ZH * 10)[:200],
                "state": "ACTIVE",
                "source": "db_read",
            }
            for i in range(20)
        ],
    }


def test_a_valid_agent_object_cannot_make_the_chat_unusable(api, settings) -> None:  # type: ignore[no-untyped-def]
    """The block rendered 17,451 tokens, counted with the system prompt that folding cannot
    shrink: with an 8k model every later turn was a 503, even the one clearing the proposal."""
    settings.CHAT_MODEL_CONTEXT_TOKENS = 8192
    chat_id = api.post("/api/v1/chats/", {}, format="json").json()["id"]
    url = f"/api/v1/chats/{chat_id}/turns/"
    response = api.post(url, {"content": "plan it", "agent": huge_agent()}, format="json")
    assert response.status_code == 201, response.content
    summarize_turns(chat_id)
    stored = AgentState.objects.get(chat_id=chat_id)
    assert 0 < stored.context_tokens <= settings.AGENT_CONTEXT_MAX_TOKENS == 1000
    assert stored.context_tokens == count_tokens(stored.context_block)
    # What matters most for the next turn survives: the pending proposal and its goal.
    assert "Pending proposal" in stored.context_block and "- Goal: " in stored.context_block
    assert api.post(url, {"content": "yes"}, format="json").status_code == 201
    clear = {"content": "go ahead", "agent": {"decision": "plan_direct"}}
    assert api.post(url, clear, format="json").status_code == 201


def test_the_bound_drops_the_least_important_parts_first() -> None:
    from conversations import agent_state as rules

    def words(text: str) -> int:
        return len(text.split())

    entities = [
        {"id": f"r{i}", "type": "recipe", "label": f"Bowl {i}", "source": "db_read"}
        for i in range(5)
    ]
    pending = {
        "decision": "propose",
        "goal": "meal prep",
        "proposal_message": "Save five bowls?",
        "assumptions": ["serves two", "no nuts"],
    }
    full = rules.render_context("Planning meals.", entities, pending)
    assert rules.render_context("Planning meals.", entities, pending, 1000, words) == full
    # Without both assumptions (4 words each) it is still one word over: one entity line goes.
    bound = words(full) - 9
    bounded = rules.render_context("Planning meals.", entities, pending, bound, words)
    assert words(bounded) <= bound
    assert "Assumption" not in bounded  # the assumptions went first
    assert "Bowl 3" in bounded and "Bowl 4" not in bounded  # then the least recent entity
    assert "Proposal: Save five bowls?" in bounded and "Session theme" in bounded
    tiny = rules.render_context("Planning meals.", entities, pending, 5, words)
    assert 0 < words(tiny) <= 5
    assert rules.render_context("Planning meals.", entities, pending, 0, words) == ""


def test_a_block_stored_before_the_bound_is_cut_when_the_context_is_built(api, settings) -> None:  # type: ignore[no-untyped-def]
    """A chat whose oversized block was stored before AGENT_CONTEXT_MAX_TOKENS existed answered
    every turn with a 503 storing nothing, so no agent-state run came to render it again."""
    settings.CHAT_MODEL_CONTEXT_TOKENS = 8192
    chat_id = api.post("/api/v1/chats/", {}, format="json").json()["id"]
    block = "Pending proposal: " + "梨子和苹果。" * 6000
    AgentState.objects.create(
        chat_id=chat_id, context_block=block, context_tokens=count_tokens(block)
    )
    assert count_tokens(block) > 8192
    url = f"/api/v1/chats/{chat_id}/turns/"
    assert api.post(url, {"content": "hi"}, format="json").status_code == 201
    sent = api.get(f"/api/v1/chats/{chat_id}/context/").json()["messages"]
    agent_message = next(m for m in sent if m["content"].startswith("Pending proposal"))
    assert count_tokens(agent_message["content"]) <= settings.AGENT_CONTEXT_MAX_TOKENS
