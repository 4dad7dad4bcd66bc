"""The agent state (docs/agent-state.md), replayed through the API: its requirement's own examples
for response summaries, entity promotion and garbage collection, decision context tracking, strict
validation, the context the model receives and the token bound of its agent-state block, the
turn-digest fold, and where the state is shown. The run that applies the turns off the request path
has its own file, tests/test_agent_summaries.py.

The off-request step is run the way a worker runs it (``summarize_turns``), like the
consolidation tests call ``fold_once``: dispatch is off in unit tests."""

import dataclasses
from typing import Any

import pytest

from conversations.agent_rules import PROPOSED_SUMMARY
from conversations.chat_model.tokens import count_tokens
from conversations.models import AgentState, Chat, Message, ResponseSummary
from memory_worker.agents.summaries import summarize_turns
from memory_worker.coordination.dispatch import RequestReason
from memory_worker.engine import policy as engine
from memory_worker.engine.state import ROLE_OVERHEAD_TOKENS, prompt_tokens
from memory_worker.folding.execute import fold_once
from memory_worker.folding.snapshot import engine_state, load_snapshot

pytestmark = pytest.mark.django_db

RESPONSE_SUMMARY_MARK = "one-sentence summary of what an assistant's reply accomplished"
FILLER = " ".join(["The details follow in the usual format for your kitchen notes."] * 8)


def new_chat(api, **body: Any) -> int:  # type: ignore[no-untyped-def]
    response = api.post("/api/v1/chats/", body, format="json")
    assert response.status_code == 201, response.content
    return int(response.json()["id"])


def turn(api, chat_id: int, content: str, agent: dict[str, Any] | None = None):  # type: ignore[no-untyped-def]
    body: dict[str, Any] = {"content": content}
    if agent is not None:
        body["agent"] = agent
    return api.post(f"/api/v1/chats/{chat_id}/turns/", body, format="json")


def agent_turn(api, chat_id: int, content: str, agent: dict[str, Any]) -> None:  # type: ignore[no-untyped-def]
    response = turn(api, chat_id, content, agent)
    assert response.status_code == 201, response.content
    summarize_turns(chat_id)  # what the worker does after the reply


def state(api, chat_id: int) -> dict[str, Any]:  # type: ignore[no-untyped-def]
    response = api.get(f"/api/v1/chats/{chat_id}/state/")
    assert response.status_code == 200, response.content
    return dict(response.json())


def entity(id: str, label: str, source: str, state: str = "ACTIVE", type: str = "recipe") -> dict:
    return {"id": id, "type": type, "label": label, "state": state, "source": source}


def replies_with(fake, text: str) -> None:  # type: ignore[no-untyped-def]
    """The fake model answers turns with ``text`` and records any other request."""

    def reply(body: dict[str, Any]) -> str:
        system = " ".join(str(m["content"]) for m in body["messages"] if m["role"] == "system")
        if RESPONSE_SUMMARY_MARK in system:
            return "Saved recipes: Spicy Rice Bowl."
        if "one-sentence theme" in system:
            return "Planning rice bowl meal prep."
        return text

    fake.reply_fn = reply


# ---------------------------------------------------------------------------------------------
# Response summaries (AssistantResponseSummary)


def test_propose_is_summarised_deterministically_without_any_model_call(  # type: ignore[no-untyped-def]
    api, use_fake_openai
) -> None:
    reply = f"I'll save the recipes Spicy Rice Bowl and Miso Salmon Bowl once you confirm. {FILLER}"
    assert len(reply) > 400  # the seed's LLM path would apply to this length
    replies_with(use_fake_openai, reply)
    chat_id = new_chat(api)
    agent = {
        "decision": "propose",
        "complexity": "low",
        "proposal_message": "Save both recipes to your cookbook?",
        "assumptions": ["Both recipes serve two"],
    }
    response = turn(api, chat_id, "save the rice bowl recipes", agent)
    assert response.status_code == 201, response.content
    assert response.json()["user_message"]["metadata"]["agent"]["decision"] == "propose"
    requests_after_turn = len(use_fake_openai.requests)
    assert summarize_turns(chat_id) == 1
    # The V3 safeguard: no summarize request and no extra chat request for this turn.
    assert len(use_fake_openai.requests) == requests_after_turn == 1
    assert use_fake_openai.summarize_requests() == []
    stored = ResponseSummary.objects.get(chat_id=chat_id, seq=2)
    assert (stored.summary, stored.source, stored.decision) == (
        PROPOSED_SUMMARY,
        "deterministic",
        "propose",
    )
    assert state(api, chat_id)["response_summaries"] == [
        {"seq": 2, "decision": "propose", "summary": PROPOSED_SUMMARY, "source": "deterministic"}
    ]


def test_offline_summary_keeps_proposals_apart_from_completed_actions(  # type: ignore[no-untyped-def]
    api, use_fake_openai, settings
) -> None:
    settings.AGENT_SUMMARY_BACKEND = "offline"
    chat_id = new_chat(api)
    recipes = [
        entity("r1", "Spicy Rice Bowl", "db_write"),
        entity("r2", "Miso Salmon Bowl", "db_write"),
        entity("r3", "Never Mentioned Stew", "db_read"),
    ]
    # The seed's first example, even when the client calls it plan_direct.
    replies_with(use_fake_openai, f"I'll save the recipes when you say so. {FILLER}")
    agent_turn(api, chat_id, "can you keep these?", {"decision": "plan_direct"})
    # The seed's second example: exact names from the text, none invented.
    replies_with(
        use_fake_openai,
        "Done! I saved the recipes. Spicy Rice Bowl is in Weeknights and Miso Salmon Bowl is "
        f"in Favourites. {FILLER}",
    )
    agent_turn(api, chat_id, "yes, save them", {"decision": "plan_direct", "entities": recipes})
    summaries = dict(ResponseSummary.objects.filter(chat_id=chat_id).values_list("seq", "summary"))
    assert summaries[2] == "Proposed to save recipes when you say so; awaiting confirmation."
    assert summaries[4] == "Saved recipes: Spicy Rice Bowl, Miso Salmon Bowl."
    assert len(use_fake_openai.requests) == 2  # only the two turns: the offline path
    assert set(ResponseSummary.objects.values_list("source", flat=True)) == {"offline"}


def test_llm_summary_only_for_long_replies(api, use_fake_openai) -> None:  # type: ignore[no-untyped-def]
    chat_id = new_chat(api)
    replies_with(use_fake_openai, "Done! I saved Spicy Rice Bowl.")  # under the threshold
    agent_turn(api, chat_id, "save it", {"decision": "plan_direct"})
    assert len(use_fake_openai.requests) == 1
    assert not ResponseSummary.objects.filter(chat_id=chat_id).exists()

    replies_with(use_fake_openai, f"Done! I saved Spicy Rice Bowl. {FILLER}")
    labels = [entity("r1", "Spicy Rice Bowl", "db_write")]
    agent_turn(api, chat_id, "save it", {"decision": "plan_direct", "entities": labels})
    summary_call = use_fake_openai.chat_requests()[-1]["body"]
    assert len(use_fake_openai.requests) == 3  # turn, turn, one summary call
    assert RESPONSE_SUMMARY_MARK in summary_call["messages"][0]["content"]
    assert "Known entity names: Spicy Rice Bowl" in summary_call["messages"][1]["content"]
    stored = ResponseSummary.objects.get(chat_id=chat_id, seq=4)
    assert (stored.summary, stored.source) == ("Saved recipes: Spicy Rice Bowl.", "llm")


def test_clarify_summary_names_the_question(api) -> None:  # type: ignore[no-untyped-def]
    chat_id = new_chat(api)
    agent_turn(
        api,
        chat_id,
        "plan my meals",
        {
            "decision": "clarify",
            "goal": "weekly meal prep",
            "clarification_questions": ["How many servings?", "Any allergies?"],
        },
    )
    summary = ResponseSummary.objects.get(chat_id=chat_id, seq=2)
    assert summary.summary == (
        "Asked the user to clarify about weekly meal prep: How many servings? (and 1 more); "
        "awaiting an answer."
    )
    assert summary.source == "deterministic"


# ---------------------------------------------------------------------------------------------
# Entities


def test_generate_and_analyze_entities_are_never_promoted(api) -> None:  # type: ignore[no-untyped-def]
    chat_id = new_chat(api)
    entities = [
        entity("tmp-1", "Draft Bowl", "generate", state="PENDING"),
        entity("tmp-2", "Macro Analysis", "analyze", state="ACTIVE", type="report"),
        entity("r9", "Teriyaki Bowl", "db_read"),
    ]
    agent_turn(api, chat_id, "design a bowl", {"decision": "plan_direct", "entities": entities})
    agent_turn(
        api,
        chat_id,
        "tweak the draft",
        {"decision": "plan_direct", "entities": [entities[0]]},  # referenced again, still temp
    )
    body = state(api, chat_id)
    assert [e["id"] for e in body["active_entities"]] == ["r9"]
    statuses = {record["id"]: record["status"] for record in body["entity_registry"]}
    assert statuses == {"tmp-1": "tracked", "tmp-2": "tracked", "r9": "active"}
    assert "tmp-1" not in body["context_block"] and "r9" in body["context_block"]


def test_pending_entities_are_collected_after_three_turns_without_reference(api) -> None:  # type: ignore[no-untyped-def]
    chat_id = new_chat(api)
    first = [
        entity("p-gen", "Draft Bowl", "generate", state="PENDING"),
        entity("p-db", "Half-saved Bowl", "db_read", state="PENDING"),
        entity("a-db", "Saved Bowl", "db_write", state="ACTIVE"),
        entity("p-kept", "Kept Draft", "generate", state="PENDING"),
    ]
    agent_turn(api, chat_id, "turn 1", {"decision": "plan_direct", "entities": first})

    def statuses() -> dict[str, str]:
        return {r["id"]: r["status"] for r in state(api, chat_id)["entity_registry"]}

    agent_turn(api, chat_id, "turn 2", {"decision": "plan_direct"})
    agent_turn(api, chat_id, "turn 3", {"decision": "plan_direct", "entities": [first[3]]})
    assert statuses()["p-gen"] == "tracked"  # two turns without reference: not yet
    assert [e["id"] for e in state(api, chat_id)["active_entities"]] == ["a-db", "p-db"]
    agent_turn(api, chat_id, "turn 4", {"decision": "plan_direct"})
    assert statuses() == {
        "p-gen": "inactive",  # three turns (2, 3, 4) without reference
        "p-db": "inactive",  # promoted, but PENDING: collected and dropped from active
        "a-db": "active",  # ACTIVE entities are not collected
        "p-kept": "tracked",  # referenced in turn 3
    }
    assert [e["id"] for e in state(api, chat_id)["active_entities"]] == ["a-db"]


def test_the_registry_is_bounded_keeping_the_most_useful_records(api, settings) -> None:  # type: ignore[no-untyped-def]
    """It kept every entity ever named: rewritten with every turn, its labels sent to the
    response-summary model, it grew until that call failed."""
    settings.AGENT_MAX_REGISTRY_ENTITIES = 4
    chat_id = new_chat(api)
    saved = [entity("a-db", "Saved Bowl", "db_write", state="ACTIVE")]
    agent_turn(api, chat_id, "turn 1", {"decision": "plan_direct", "entities": saved})
    for number in range(2, 8):  # a new draft every turn, each collected three turns later
        draft = [entity(f"d{number}", f"Draft {number}", "generate", state="PENDING")]
        agent_turn(api, chat_id, f"turn {number}", {"decision": "plan_direct", "entities": draft})
    registry = {r["id"]: r["status"] for r in state(api, chat_id)["entity_registry"]}
    # 7 named, 4 kept: the database-backed one, then the drafts still tracked (d5..d7); the
    # collected ones went first, the oldest first.
    assert registry == {"a-db": "active", "d5": "tracked", "d6": "tracked", "d7": "tracked"}
    assert [e["id"] for e in state(api, chat_id)["active_entities"]] == ["a-db"]


# ---------------------------------------------------------------------------------------------
# Decision context, theme, steps


def test_pending_clarification_set_by_clarify_and_propose_cleared_by_plan_direct(api) -> None:  # type: ignore[no-untyped-def]
    chat_id = new_chat(api)
    agent_turn(
        api,
        chat_id,
        "plan meals",
        {"decision": "clarify", "goal": "meal prep", "clarification_questions": ["For whom?"]},
    )
    assert state(api, chat_id)["pending_clarification"] == {
        "decision": "clarify",
        "seq": 2,
        "goal": "meal prep",
        "clarification_questions": ["For whom?"],
    }
    agent_turn(
        api,
        chat_id,
        "for two",
        {
            "decision": "propose",
            "goal": "meal prep",
            "proposal_message": "Five rice bowls for two?",
            "assumptions": ["No allergies"],
        },
    )
    pending = state(api, chat_id)["pending_clarification"]
    assert pending["decision"] == "propose"
    assert pending["proposal_message"] == "Five rice bowls for two?"
    assert "clarification_questions" not in pending
    turn(api, chat_id, "an unrelated plain turn")  # no agent context: leaves it alone
    summarize_turns(chat_id)
    assert state(api, chat_id)["pending_clarification"]["decision"] == "propose"
    agent_turn(api, chat_id, "yes", {"decision": "plan_direct"})
    body = state(api, chat_id)
    assert body["pending_clarification"] is None
    assert "Pending" not in body["context_block"]


def test_theme_moves_only_on_high_complexity_or_multi_step_turns(api, settings) -> None:  # type: ignore[no-untyped-def]
    settings.AGENT_SUMMARY_BACKEND = "offline"
    chat_id = new_chat(api)
    agent_turn(
        api, chat_id, "hi", {"decision": "plan_direct", "complexity": "low", "goal": "say hi"}
    )
    assert state(api, chat_id)["engagement_summary"] == ""
    agent_turn(
        api,
        chat_id,
        "plan a week of rice bowls",
        {
            "decision": "plan_direct",
            "complexity": "medium",
            "goal": "planning rice bowl meal prep",
            "step_results": ["read pantry", "drafted menu"],
        },
    )
    assert state(api, chat_id)["engagement_summary"] == "Planning rice bowl meal prep."
    agent_turn(api, chat_id, "save one", {"decision": "plan_direct", "goal": "just saved a recipe"})
    assert state(api, chat_id)["engagement_summary"] == "Planning rice bowl meal prep."
    agent_turn(api, chat_id, "big one", {"decision": "plan_direct", "complexity": "high"})
    assert state(api, chat_id)["engagement_summary"] == "Planning rice bowl meal prep."


def test_theme_uses_the_model_when_configured(api, use_fake_openai) -> None:  # type: ignore[no-untyped-def]
    replies_with(use_fake_openai, "Here is your plan.")
    chat_id = new_chat(api)
    agent_turn(api, chat_id, "plan it all", {"decision": "plan_direct", "complexity": "high"})
    assert state(api, chat_id)["engagement_summary"] == "Planning rice bowl meal prep."
    theme_call = use_fake_openai.chat_requests()[-1]["body"]["messages"]
    assert "one-sentence theme" in theme_call[0]["content"]
    assert "User: plan it all" in theme_call[1]["content"]


def test_step_results_beyond_three_are_compressed_to_one_line(api) -> None:  # type: ignore[no-untyped-def]
    chat_id = new_chat(api)
    agent_turn(
        api,
        chat_id,
        "first",
        {
            "decision": "plan_direct",
            "step_results": [{"summary": "Read 12 recipes", "rows": list(range(50))}, "x\ny"],
        },
    )
    agent_turn(
        api,
        chat_id,
        "second",
        {"decision": "plan_direct", "step_results": ["s1", {"tool": "save", "ok": True}, "s3"]},
    )
    body = state(api, chat_id)
    assert body["recent_steps"] == [
        {"seq": 4, "index": 0, "result": "s1"},
        {"seq": 4, "index": 1, "result": {"tool": "save", "ok": True}},
        {"seq": 4, "index": 2, "result": "s3"},
    ]
    assert body["step_summaries"] == [
        {"seq": 2, "index": 0, "summary": "Read 12 recipes"},
        {"seq": 2, "index": 1, "summary": "x y"},
    ]


# ---------------------------------------------------------------------------------------------
# Validation


@pytest.mark.parametrize(
    ("agent", "path"),
    [
        ("propose", ["agent", "non_field_errors"]),
        ({}, ["agent", "decision"]),
        ({"decision": "maybe"}, ["agent", "decision"]),
        ({"decision": 1}, ["agent", "decision"]),
        ({"decision": "plan_direct", "complexity": 3}, ["agent", "complexity"]),
        ({"decision": "plan_direct", "complexity": "extreme"}, ["agent", "complexity"]),
        ({"decision": "plan_direct", "surprise": 1}, ["agent", "surprise"]),
        ({"decision": "plan_direct", "entities": {"id": "x"}}, ["agent", "entities"]),
        (
            {"decision": "plan_direct", "entities": [entity("a", "A", "web")]},
            ["agent", "entities", "0", "source"],
        ),
        (
            {
                "decision": "plan_direct",
                "entities": [{**entity("a", "A", "db_read"), "state": "X"}],
            },
            ["agent", "entities", "0", "state"],
        ),
        (
            {"decision": "plan_direct", "entities": [{"id": "a", "type": "t", "state": "ACTIVE"}]},
            ["agent", "entities", "0", "label"],
        ),
        (
            {"decision": "plan_direct", "entities": [{**entity("a", "A", "db_read"), "x": 1}]},
            ["agent", "entities", "0", "x"],
        ),
        (
            {"decision": "plan_direct", "entities": [entity("a", "A", "db_read")] * 2},
            ["agent", "entities"],
        ),
        ({"decision": "plan_direct", "step_results": [1]}, ["agent", "step_results", "0"]),
        ({"decision": "propose"}, ["agent", "proposal_message"]),
        (
            {"decision": "plan_direct", "proposal_message": "Shall I?"},
            ["agent", "proposal_message"],
        ),
        (
            {"decision": "clarify", "clarification_questions": []},
            ["agent", "clarification_questions"],
        ),
        (
            {"decision": "propose", "proposal_message": "ok?", "clarification_questions": ["?"]},
            ["agent", "clarification_questions"],
        ),
    ],
)
def test_bad_agent_payload_is_400_naming_the_field_and_stores_nothing(  # type: ignore[no-untyped-def]
    api, agent, path
) -> None:
    chat_id = new_chat(api)
    response = turn(api, chat_id, "hello", agent)
    assert response.status_code == 400, response.content
    node: Any = response.json()
    for key in path:
        node = node[int(key)] if isinstance(node, list) else node[key]
    assert node, response.json()
    assert Message.objects.filter(chat_id=chat_id).count() == 0
    assert Chat.objects.get(pk=chat_id).last_seq == 0
    assert not AgentState.objects.filter(chat_id=chat_id).exists()


# ---------------------------------------------------------------------------------------------
# What the model receives


def test_context_carries_theme_entities_and_pending_and_is_what_the_model_gets(  # type: ignore[no-untyped-def]
    api, use_fake_openai, settings
) -> None:
    settings.AGENT_SUMMARY_BACKEND = "offline"
    chat_id = new_chat(api, system_prompt="Be brief.")
    agent_turn(
        api,
        chat_id,
        "plan the week",
        {
            "decision": "clarify",
            "complexity": "high",
            "goal": "planning rice bowl meal prep",
            "entities": [entity("r1", "Spicy Rice Bowl", "db_write")],
            "clarification_questions": ["How many servings?"],
        },
    )
    context = api.get(f"/api/v1/chats/{chat_id}/context/").json()["messages"]
    assert context[0] == {"role": "system", "content": "Be brief."}
    # Last: it changes every turn, so it stays out of the prefix a provider's cache serves.
    assert context[-1] == {
        "role": "system",
        "content": "\n".join(
            [
                "Agent state (session memory):",
                "Session theme: Planning rice bowl meal prep.",
                "Active entities (exist in the database; use these ids):",
                "- Spicy Rice Bowl (recipe, id r1, db_write)",
                "Pending clarification (awaiting the user's answer):",
                "- Goal: planning rice bowl meal prep",
                "- Question: How many servings?",
            ]
        ),
    }
    response = turn(api, chat_id, "two servings")
    assert response.status_code == 201
    assert use_fake_openai.chat_requests()[-1]["body"]["messages"] == [
        *context,
        {"role": "user", "content": "two servings"},
    ]


def test_the_bound_counts_the_agent_state(api) -> None:  # type: ignore[no-untyped-def]
    chat_id = new_chat(api, system_prompt="Be brief.")
    chat = Chat.objects.get(pk=chat_id)
    before = prompt_tokens(engine_state(chat, load_snapshot(chat_id), 128000))
    entities = [entity(f"r{i}", f"Bowl number {i}", "db_read") for i in range(10)]
    agent_turn(api, chat_id, "x", {"decision": "plan_direct", "entities": entities})
    stored = AgentState.objects.get(chat_id=chat_id)
    assert stored.context_tokens == count_tokens(stored.context_block) > 0
    snapshot = load_snapshot(chat_id)
    assert snapshot.agent_context == stored.context_block
    turn_tokens = sum(m.token_count + ROLE_OVERHEAD_TOKENS for m in snapshot.unfolded)
    after = prompt_tokens(engine_state(chat, snapshot, 128000))
    # One more system message: its tokens and its role overhead, nothing uncounted.
    assert after - before == turn_tokens + stored.context_tokens + ROLE_OVERHEAD_TOKENS


def test_the_agent_state_can_make_the_turn_fold_first(api) -> None:  # type: ignore[no-untyped-def]
    """The agent state is part of the prompt: when it pushes the context over the hard bound,
    the turn folds synchronously like for any other growth (promise 2)."""
    from memory_worker.folding.effective_policy import policy_for_chat

    chat_id = new_chat(api, policy="contract")
    for number in range(3):
        assert turn(api, chat_id, f"message {number} " + "word " * 300).status_code == 201
    entities = [entity(f"id-{i}", f"Entity number {i}", "db_read") for i in range(10)]
    agent_turn(api, chat_id, "many", {"decision": "plan_direct", "entities": entities})
    chat = Chat.objects.get(pk=chat_id)
    policy = policy_for_chat(chat)
    snapshot = load_snapshot(chat_id)
    bare = dataclasses.replace(snapshot, agent_context="", agent_context_tokens=0)
    without = prompt_tokens(engine_state(chat, bare, 1), 5)
    with_state = prompt_tokens(engine_state(chat, snapshot, 1), 5)
    assert with_state > without
    # A model window where the messages fit, but not the messages and the agent state.
    window = int((without + with_state) / 2 / engine.PROMPT_WINDOW_SHARE)
    assert engine.decide_before_turn(engine_state(chat, bare, window), policy, 5).fold is None
    pre_turn = engine.decide_before_turn(engine_state(chat, snapshot, window), policy, 5)
    assert pre_turn.fits and pre_turn.fold is not None


# ---------------------------------------------------------------------------------------------
# The token bound of the block

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
    """Unbounded, this object's block renders 17,451 tokens, counted with the system prompt
    that folding cannot shrink: with an 8k model every later turn would be a 503, even the one
    clearing the proposal."""
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
    from conversations import agent_rules as rules

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


def test_a_stored_block_over_the_bound_is_cut_when_the_context_is_built(api, settings) -> None:  # type: ignore[no-untyped-def]
    """A stored block over AGENT_CONTEXT_MAX_TOKENS (rendered under a larger bound, say) is cut
    when the context is built: sent whole, it makes every turn a 503 that stores nothing, so no
    agent-state run would come to render it again."""
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


# ---------------------------------------------------------------------------------------------
# turn-digest


def test_turn_digest_fold_sends_the_full_reply_not_its_response_summary(  # type: ignore[no-untyped-def]
    api, use_fake_openai, settings
) -> None:
    """A turn-digest fold (TurnSummary) takes the oldest turn's user and assistant text: a reply
    folded from its one-sentence response summary left the context without its content ever reaching
    the summarizer (promise 1)."""
    settings.AGENT_SUMMARY_BACKEND = "offline"
    chat_id = new_chat(api, policy="turn-digest")
    long_reply = f"I'll save the recipes FULL-TEXT-MARKER once you confirm. {FILLER}"
    replies_with(use_fake_openai, long_reply)
    agent_turn(
        api,
        chat_id,
        "save recipes",
        {"decision": "propose", "proposal_message": "Save them?"},
    )
    replies_with(use_fake_openai, "short reply")
    for number in range(3):
        assert turn(api, chat_id, f"later turn {number}").status_code == 201
    summarize_turns(chat_id)
    outcome = fold_once(chat_id, RequestReason.TURN)
    assert outcome.status == "succeeded"
    assert (outcome.decision.from_seq, outcome.decision.to_seq) == (1, 2)  # type: ignore[union-attr]
    fold_input = str(use_fake_openai.summarize_requests()[-1]["body"])
    assert "FULL-TEXT-MARKER" in fold_input
    assert PROPOSED_SUMMARY not in fold_input
    assert "save recipes" in fold_input


def test_plain_turn_digest_turns_get_summaries_without_agent_context(  # type: ignore[no-untyped-def]
    api, use_fake_openai, settings
) -> None:
    settings.AGENT_SUMMARY_BACKEND = "offline"
    replies_with(use_fake_openai, f"Done! I created the menu. {FILLER}")
    chat_id = new_chat(api, policy="turn-digest")
    assert turn(api, chat_id, "make a menu").status_code == 201
    assert summarize_turns(chat_id) == 1
    assert ResponseSummary.objects.get(chat_id=chat_id, seq=2).summary == "Created menu."


# ---------------------------------------------------------------------------------------------
# The state endpoint, the admin, a streamed turn


def test_state_endpoint_is_scoped_and_empty_before_any_agent_turn(api, other_api) -> None:  # type: ignore[no-untyped-def]
    chat_id = new_chat(api)
    body = state(api, chat_id)
    assert body["engagement_summary"] == "" and body["active_entities"] == []
    assert body["pending_clarification"] is None and body["response_summaries"] == []
    assert body["limits"]["summarize_threshold"] == 400
    assert body["limits"]["full_detail_steps"] == 3
    assert body["limits"]["pending_ttl_turns"] == 3
    assert other_api.get(f"/api/v1/chats/{chat_id}/state/").status_code == 404


def test_admin_shows_the_agent_state(api, admin_client) -> None:  # type: ignore[no-untyped-def]
    chat_id = new_chat(api)
    agent_turn(
        api,
        chat_id,
        "x",
        {"decision": "clarify", "clarification_questions": ["Which bowl, exactly?"]},
    )
    page = admin_client.get(f"/admin/conversations/chat/{chat_id}/change/")
    assert page.status_code == 200
    html = page.content.decode()
    assert "What the assistant is tracking (agent state)" in html
    assert "Which bowl, exactly?" in html


@pytest.mark.django_db(transaction=True)
def test_a_streamed_turn_stores_its_agent_context(api) -> None:  # type: ignore[no-untyped-def]
    chat_id = new_chat(api)
    agent = {"decision": "clarify", "clarification_questions": ["Which one?"]}
    response = api.post(
        f"/api/v1/chats/{chat_id}/turns/",
        {"content": "stream it", "stream": True, "agent": agent},
        format="json",
    )
    assert response.status_code == 200
    assert b"event: done" in b"".join(response.streaming_content)
    stored = Message.objects.get(chat_id=chat_id, seq=1).metadata
    assert stored == {"agent": agent}
    bad = {"content": "stream it", "stream": True, "agent": {"decision": "clarify"}}
    refused = api.post(f"/api/v1/chats/{chat_id}/turns/", bad, format="json")
    assert refused.status_code == 400
    assert "clarification_questions" in refused.json()["agent"]
    assert Message.objects.filter(chat_id=chat_id).count() == 2
