"""The agent state off the request path (memory_worker/agents/summaries.py, the run;
memory_worker/agents/turns.py, what one turn applies; docs/agent-state.md): a turn hands the work to
the dispatcher after commit, each turn is applied once and in order (a stale run is superseded, a
later turn's task may run first, a turn may span batches), a /v1 tool loop is one turn summarised by
its final reply whenever the worker runs and however long the loop, and a backlog is committed turn
by turn under the task's time limit, the rest handed on.

The run is called the way a worker calls it (``summarize_turns``): dispatch is off in unit tests."""

from types import SimpleNamespace
from typing import Any

import pytest
from rest_framework.authtoken.models import Token
from rest_framework.test import APIClient

import tests.support.fake_openai.server as fake_module  # where the server asks requested_tool
from conversations.agent_rules import offline_response_summary
from conversations.models import AgentState, Chat, ResponseSummary
from conversations.services import agent_state as service
from memory_worker.agents import summaries as agent_summaries
from memory_worker.agents.summaries import summarize_turns
from tests.test_agent_state import entity, new_chat, state, turn

pytestmark = pytest.mark.django_db

# ---------------------------------------------------------------------------------------------
# Handed off after the turn


@pytest.fixture
def queued_agent_tasks(settings, monkeypatch) -> list[tuple]:  # type: ignore[no-untyped-def]
    """Celery dispatch on, with the agent-state task's messages kept here instead of sent."""
    queued: list[tuple] = []
    monkeypatch.setattr(
        agent_summaries.SUMMARIZE_AGENT_TURNS,
        "apply_async",
        lambda args, **options: queued.append(args),
    )
    settings.MEMORY_DISPATCH = "celery"
    return queued


def test_the_turn_hands_the_work_to_the_dispatcher_after_commit(  # type: ignore[no-untyped-def]
    api, queued_agent_tasks, django_capture_on_commit_callbacks
) -> None:
    from memory_worker import tasks

    queued = queued_agent_tasks
    plain_chat = new_chat(api)
    agent_chat = new_chat(api)
    digest_chat = new_chat(api, policy="turn-digest")
    with django_capture_on_commit_callbacks(execute=True):
        assert turn(api, plain_chat, "hello").status_code == 201
        assert turn(api, agent_chat, "hi", {"decision": "plan_direct"}).status_code == 201
        assert turn(api, digest_chat, "hey").status_code == 201
    assert queued == [(agent_chat, 1), (digest_chat, 1)]
    assert AgentState.objects.count() == 0  # nothing ran on the request path
    # The task itself (what the worker runs), twice: the second delivery finds nothing to do.
    assert tasks.summarize_agent_turns(agent_chat, 1) == 1
    assert tasks.summarize_agent_turns(agent_chat, 1) == 0
    assert AgentState.objects.get(chat_id=agent_chat).turns == 1
    # Once a chat has agent state, its plain turns are followed too (pending GC keeps time).
    queued.clear()
    with django_capture_on_commit_callbacks(execute=True):
        assert turn(api, agent_chat, "plain").status_code == 201
    assert queued == [(agent_chat, 3)]


def test_openai_compatible_turns_hand_the_work_over_too(  # type: ignore[no-untyped-def]
    user, settings, queued_agent_tasks, django_capture_on_commit_callbacks
) -> None:
    """/v1 turns queue the agent-state task as REST turns do, not only the fold check: a
    turn-digest chat used through them gets its response summaries, so its folds do not send
    the full replies."""
    settings.MEMORY_POLICY = "turn-digest"
    client = APIClient()
    client.credentials(HTTP_AUTHORIZATION=f"Bearer {Token.objects.get_or_create(user=user)[0].key}")
    body = {"model": "default", "user": "digest", "messages": [{"role": "user", "content": "hey"}]}
    with django_capture_on_commit_callbacks(execute=True):
        assert client.post("/v1/chat/completions", body, format="json").status_code == 200
    chat = Chat.objects.get(external_id="digest")
    assert queued_agent_tasks == [(chat.pk, 1)]


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
# Each turn applied once, in order


def test_a_stale_run_is_superseded_and_applies_nothing(api) -> None:  # type: ignore[no-untyped-def]
    chat_id = new_chat(api)
    response = turn(api, chat_id, "x", {"decision": "clarify", "clarification_questions": ["?"]})
    assert response.status_code == 201, response.content
    stale = agent_summaries._state_for(chat_id, 1)
    assert stale is not None
    turns = agent_summaries.pending_turns(chat_id, stale.processed_seq)
    assert summarize_turns(chat_id) == 1
    draft = agent_summaries.compute(stale, turns, agent_summaries.limits())
    assert agent_summaries.commit(stale, turns, draft) is False
    assert ResponseSummary.objects.filter(chat_id=chat_id).count() == 1
    assert AgentState.objects.get(chat_id=chat_id).turns == 1


def test_a_later_turns_task_running_first_does_not_skip_the_first_agent_turn(api) -> None:  # type: ignore[no-untyped-def]
    """Two workers (or a lost enqueue) can run turn B's task before turn A's: the state starts
    at the chat's first agent turn (A), not at B's, so A's entities reach it."""
    chat_id = new_chat(api)
    assert turn(api, chat_id, "plain, before any agent turn").status_code == 201
    recipe = entity("r1", "Spicy Rice Bowl", "generate", state="PENDING")
    first = turn(
        api,
        chat_id,
        "A",
        {"decision": "propose", "proposal_message": "Rice bowl?", "entities": [recipe]},
    )
    assert first.status_code == 201
    second = turn(api, chat_id, "B", {"decision": "plan_direct"})
    assert second.status_code == 201
    assert summarize_turns(chat_id, from_seq=second.json()["user_message"]["seq"]) == 2
    saved = AgentState.objects.get(chat_id=chat_id)
    assert saved.processed_seq == 6 and saved.turns == 2  # from turn A (seq 3), not B (seq 5)
    assert "r1" in saved.entity_registry  # turn A's entity


def test_turns_are_applied_in_order_across_batches(api, monkeypatch) -> None:  # type: ignore[no-untyped-def]
    monkeypatch.setattr(agent_summaries, "BATCH_MESSAGES", 3)  # a turn is cut at every batch edge
    chat_id = new_chat(api)
    for number, decision in enumerate(["clarify", "propose", "plan_direct"]):
        agent: dict[str, Any] = {"decision": decision, "step_results": [f"step {number}"]}
        if decision == "clarify":
            agent["clarification_questions"] = ["?"]
        if decision == "propose":
            agent["proposal_message"] = "ok?"
        assert turn(api, chat_id, f"turn {number}", agent).status_code == 201
    assert summarize_turns(chat_id, 1) == 3
    body = state(api, chat_id)
    assert (body["processed_seq"], body["turns"]) == (6, 3)
    assert [s["seq"] for s in body["response_summaries"]] == [2, 4]
    assert body["pending_clarification"] is None  # plan_direct came last
    assert [s["result"] for s in body["recent_steps"]] == ["step 0", "step 1", "step 2"]


# ---------------------------------------------------------------------------------------------
# Tool loops through /v1

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
    """A reply that calls a tool does not close the turn: a worker running between the two
    requests leaves the watermark before the tool call, and the final reply (seq 4) is the one
    summarised, as when the worker runs only after the last request."""
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
    """Once the first exchange is applied, the loop's 62 later messages have no user message:
    a batch of 60 of them holds no complete turn, and is applied as far as it goes so that the
    watermark keeps moving, through the loop and the turns after it."""
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
# The task's time limit


def test_a_backlog_is_committed_turn_by_turn_and_the_rest_handed_on(  # type: ignore[no-untyped-def]
    api, use_fake_openai, settings, monkeypatch
) -> None:
    """A backlog of long replies, each one model call, under a soft time limit that fits about
    three calls: each turn commits on its own (a batch committed at the end would lose all of
    it to the limit, and every later task would redo the same calls), no call starts that
    cannot finish before the deadline, and the rest is handed to a fresh task."""
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
    monkeypatch.setattr("memory_worker.coordination.deadlines.time", fake_time)
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
        "memory_worker.agents.summaries.request_agent_summary", request_agent_summary
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
