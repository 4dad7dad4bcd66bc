"""Output limits every server honours: the summarizer, every chat turn (REST and /v1, at once
and streamed), the daily notes' extraction and the agent state's one-sentence summary send their
limit in the field the endpoint honours (OPENAI_TOKEN_LIMIT_FIELD), and
a chat reply has a limit (CHAT_MAX_REPLY_TOKENS, or its default share of the window). Against
the fake model server in a mode that honours one field only and otherwise runs on, as a looping
small model does (tests/support/fake_openai/, LIMIT_MODES), no call's output exceeds its limit."""

import json
from typing import Any

import pytest
from rest_framework.test import APIClient

from conversations.chat_model.transport import token_limit_field, with_token_limit
from conversations.models import Brief, Chat, Message
from conversations.services.agent_state import ONE_SENTENCE_TOKENS, ChatAgentModel
from conversations.services.turn_model import reply_options
from conversations.variants import ModelVariant
from memory_worker.coordination.dispatch import RequestReason
from memory_worker.daily_notes import EXTRACTION_OUTPUT_TOKENS, extract_with_model
from memory_worker.folding import execute as folds
from memory_worker.folding.effective_policy import policy_for_chat
from memory_worker.summaries.backends import get_summarizer
from memory_worker.summaries.contract import FoldMessage, SummarizerError
from tests.conftest import contract_chat_after_turns
from tests.support.fake_openai import FakeOpenAI, approx_tokens, honoured_limit
from tests.test_bad_input import bearer, completion

REPLY_LIMIT = 200
SUMMARY_CAP = 120

# (the server's mode, chatmem's setting): each a configuration whose limit the server honours.
HONOURED = [
    ("local", "auto"),  # a local endpoint: auto is max_tokens
    ("local", "both"),
    ("openai", "max_completion_tokens"),
]
IDS = [f"{mode}-server-{field}" for mode, field in HONOURED]


@pytest.fixture(params=HONOURED, ids=IDS)
def server(request: Any, settings: Any, use_fake_openai: FakeOpenAI) -> FakeOpenAI:
    mode, field = request.param
    settings.OPENAI_TOKEN_LIMIT_FIELD = field
    settings.CHAT_MAX_REPLY_TOKENS = REPLY_LIMIT
    settings.MEMORY_SUMMARY_TOKEN_CAP = SUMMARY_CAP
    use_fake_openai.limit_mode = mode
    return use_fake_openai


def limit_of(server: FakeOpenAI, body: dict[str, Any]) -> int:
    assert server.limit_mode is not None
    limit = honoured_limit(body, server.limit_mode)
    assert limit is not None, f"no limit the {server.limit_mode} server honours in {body.keys()}"
    return limit


def assert_reply_within_its_limit(server: FakeOpenAI, reply: str, limit: int) -> None:
    [request] = server.chat_requests()
    assert limit_of(server, request.body) == limit
    assert 0 < approx_tokens(reply) <= limit  # the server's own count: what it generated
    stored = Message.objects.filter(role="assistant").latest("id")
    assert (stored.content, stored.metadata["finish_reason"]) == (reply, "length")


def stream_text(response: Any) -> str:
    return b"".join(response.streaming_content).decode()


# --- chat turns ----------------------------------------------------------------------------


@pytest.mark.usefixtures("require_postgres")
@pytest.mark.parametrize("stream", [False, True], ids=["json", "streamed"])
def test_a_rest_reply_stops_at_its_limit(api: APIClient, server: FakeOpenAI, stream: bool) -> None:
    chat_id = api.post("/api/v1/chats/", {}, format="json").json()["id"]
    response = api.post(
        f"/api/v1/chats/{chat_id}/turns/", {"content": "hi", "stream": stream}, format="json"
    )
    assert response.status_code == (200 if stream else 201)
    if stream:
        assert "event: done" in stream_text(response)
    reply = Message.objects.get(chat_id=chat_id, role="assistant").content
    assert_reply_within_its_limit(server, reply, REPLY_LIMIT)


@pytest.mark.usefixtures("require_postgres")
@pytest.mark.parametrize("stream", [False, True], ids=["json", "streamed"])
@pytest.mark.parametrize(
    ("asked", "limit"),
    [({}, REPLY_LIMIT), ({"max_tokens": 40}, 40), ({"max_completion_tokens": 10**6}, REPLY_LIMIT)],
    ids=["none-asked", "client-smaller-wins", "client-larger-capped"],
)
def test_a_v1_reply_stops_at_its_limit(
    user: Any, server: FakeOpenAI, stream: bool, asked: dict[str, int], limit: int
) -> None:
    response = completion(bearer(user), stream=stream, **asked)
    assert response.status_code == 200
    if stream:
        chunks = [line[6:] for line in stream_text(response).splitlines() if line[:6] == "data: "]
        assert chunks[-1] == "[DONE]"
        finish = [json.loads(c)["choices"][0]["finish_reason"] for c in chunks[:-1]]
        assert finish[-1] == "length"
        reply = Message.objects.get(role="assistant").content
    else:
        body = response.json()
        assert body["choices"][0]["finish_reason"] == "length"
        reply = body["choices"][0]["message"]["content"]
    assert_reply_within_its_limit(server, reply, limit)


@pytest.mark.usefixtures("require_postgres")
def test_the_default_reply_limit_is_a_share_of_the_window(
    api: APIClient, server: FakeOpenAI, settings: Any
) -> None:
    """A SmolLM2-sized window (8,192 tokens): a quarter of it, under the 4,096 ceiling."""
    settings.CHAT_MAX_REPLY_TOKENS = 0
    settings.CHAT_MODEL_CONTEXT_TOKENS = 8192
    chat_id = api.post("/api/v1/chats/", {}, format="json").json()["id"]
    response = api.post(f"/api/v1/chats/{chat_id}/turns/", {"content": "hi"}, format="json")
    assert response.status_code == 201, response.content
    reply = response.json()["assistant_message"]["content"]
    assert_reply_within_its_limit(server, reply, 2048)


# --- the summarizer ------------------------------------------------------------------------


def test_every_summarizer_call_stops_at_its_limit(server: FakeOpenAI) -> None:
    """A summary that runs on is cut at its output limit (the cap and a half) and refused as
    cut off: nothing over the cap can be stored."""
    messages = [FoldMessage(n, "user" if n % 2 else "assistant", f"fact {n}") for n in range(1, 7)]
    with pytest.raises(SummarizerError) as caught:
        get_summarizer().summarize("", messages)
    assert caught.value.kind == "truncated"
    [request] = server.summarize_requests()
    assert limit_of(server, request.body) == round(SUMMARY_CAP * 1.5)


def test_the_daily_notes_extraction_stops_at_its_limit(server: FakeOpenAI) -> None:
    messages = [Message(seq=n, role="user", content=f"My locker code is 48{n}.") for n in (1, 2)]
    assert extract_with_model(messages)
    [request] = server.chat_requests()
    assert limit_of(server, request.body) == EXTRACTION_OUTPUT_TOKENS


def test_the_agent_states_one_sentence_summary_stops_at_its_limit(server: FakeOpenAI) -> None:
    assert ChatAgentModel().ask("Say what the reply did, in one sentence.", "Deployed v2.")
    [request] = server.chat_requests()
    assert limit_of(server, request.body) == ONE_SENTENCE_TOKENS


@pytest.mark.usefixtures("require_postgres")
def test_a_fold_whose_summary_runs_on_stores_nothing(api: APIClient, server: FakeOpenAI) -> None:
    mode, server.limit_mode = server.limit_mode, None  # plain turns first
    chat_id = contract_chat_after_turns(api, 6)
    before = Brief.objects.get(chat_id=chat_id)
    server.limit_mode = mode
    outcome = folds.fold_once(chat_id, RequestReason.MANUAL)
    assert (outcome.status, outcome.kind) == ("failed", "truncated")
    cap = policy_for_chat(Chat.objects.get(pk=chat_id)).summary_token_cap
    assert server.summarize_requests()
    for request in server.summarize_requests():
        assert limit_of(server, request.body) == round(cap * 1.5)
    brief = Brief.objects.get(chat_id=chat_id)
    assert (brief.summary, brief.version) == (before.summary, before.version)


# --- the field and the limit, as chosen --------------------------------------------------------


@pytest.mark.parametrize(
    ("base_url", "field"),
    [
        (None, "max_completion_tokens"),
        ("https://api.openai.com/v1", "max_completion_tokens"),
        ("https://acme.openai.azure.com/openai/v1", "max_completion_tokens"),
        ("http://127.0.0.1:8080/v1", "max_tokens"),  # llama.cpp
        ("http://ollama:11434/v1", "max_tokens"),
        ("https://api.groq.com/openai/v1", "max_tokens"),
    ],
)
def test_auto_sends_openai_its_own_field_and_every_other_server_max_tokens(
    base_url: str | None, field: str
) -> None:
    assert token_limit_field("auto", base_url) == field
    assert token_limit_field("both", base_url) == "both"


def test_an_unknown_field_setting_is_refused() -> None:
    with pytest.raises(ValueError, match="OPENAI_TOKEN_LIMIT_FIELD"):
        token_limit_field("max_new_tokens", None)


def test_the_limit_travels_in_the_field_alone() -> None:
    options = {"max_tokens": 90, "max_completion_tokens": 50, "temperature": 0}
    assert with_token_limit(options, "max_tokens") == {"temperature": 0, "max_tokens": 50}
    assert with_token_limit(options, "both") == {
        "temperature": 0,
        "max_completion_tokens": 50,
        "max_tokens": 50,
    }
    assert with_token_limit({"temperature": 0}, "both") == {"temperature": 0}


def test_an_openai_style_server_refuses_both_fields(server: FakeOpenAI, settings: Any) -> None:
    """Why "auto" never sends both to OpenAI: its API refuses the pair, whatever the model."""
    if server.limit_mode != "openai":
        pytest.skip("the OpenAI-style server only")
    settings.OPENAI_TOKEN_LIMIT_FIELD = "both"
    with pytest.raises(SummarizerError) as caught:
        get_summarizer().summarize("", [FoldMessage(1, "user", "fact")])
    assert caught.value.kind == "request_refused"


@pytest.mark.parametrize(
    ("setting", "window", "prompt", "options", "limit"),
    [
        (0, 128_000, 1_000, {}, 4096),  # the default's ceiling
        (0, 8_192, 1_000, {}, 2048),  # a quarter of a small window
        (0, 8_192, 7_500, {}, 692),  # never more than the window has left
        (300, 8_192, 1_000, {"max_tokens": 20}, 20),  # the client's smaller limit
        (300, 8_192, 1_000, {"max_tokens": 900, "max_completion_tokens": 800}, 300),
        (0, 8_192, 7_500, {"tools": [{"type": "function", "function": {"name": "x" * 400}}]}, 0),
    ],
    ids=["ceiling", "share", "room", "client-smaller", "client-larger", "tools-take-room"],
)
def test_the_reply_limit(
    settings: Any, setting: int, window: int, prompt: int, options: dict[str, Any], limit: int
) -> None:
    settings.CHAT_MAX_REPLY_TOKENS = setting
    variant = ModelVariant("default", "gpt-4o", window)
    sent = reply_options(variant, prompt, options, chat_id=7)
    assert "max_tokens" not in sent
    if limit:
        assert sent["max_completion_tokens"] == limit
    else:  # the tools' definitions count against the room too
        assert 1 <= int(sent["max_completion_tokens"]) < window - prompt  # type: ignore[call-overload]


def test_a_limit_in_a_field_the_server_ignores_is_no_limit(
    settings: Any, use_fake_openai: FakeOpenAI
) -> None:
    """The fake's local mode as llama.cpp behaves: max_completion_tokens alone does not stop a
    summary that runs on; only counting catches it (over the cap, twice: the stricter retry)."""
    settings.OPENAI_TOKEN_LIMIT_FIELD = "max_completion_tokens"
    settings.MEMORY_SUMMARY_TOKEN_CAP = SUMMARY_CAP
    use_fake_openai.limit_mode = "local"
    with pytest.raises(SummarizerError) as caught:
        get_summarizer().summarize("", [FoldMessage(1, "user", "fact")])
    assert caught.value.kind == "over_cap"
    assert len(use_fake_openai.summarize_requests()) == 2
