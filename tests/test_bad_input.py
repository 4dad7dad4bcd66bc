"""Bad input is the client's 400 (or 404) with a JSON body saying what is wrong, and stores
nothing: inputs that would otherwise reach the database or the model and fail there as a 500."""

from __future__ import annotations

import json
from typing import Any

import pytest
from rest_framework.authtoken.models import Token
from rest_framework.test import APIClient

from conversations.models import Brief, Chat, Message
from conversations.services import bounded_context, turn_model, turn_slot
from memory_worker.coordination.dispatch import RequestReason
from memory_worker.folding.execute import fold_once
from tests.conftest import contract_chat_after_turns
from tests.support.fake_openai import FakeOpenAI

pytestmark = pytest.mark.django_db

NESTED = "[" * 3000 + "]" * 3000  # Python's decoder gives up (RecursionError) long before this


def post_raw(api: APIClient, path: str, body: str) -> Any:
    return api.post(
        path, data=body.encode("utf-8", "surrogatepass"), content_type="application/json"
    )


def new_chat(api: APIClient, **body: Any) -> int:
    response = api.post("/api/v1/chats/", body, format="json")
    assert response.status_code == 201, response.content
    return int(response.json()["id"])


def bearer(user: Any) -> APIClient:
    client = APIClient()
    key = Token.objects.get_or_create(user=user)[0].key
    client.credentials(HTTP_AUTHORIZATION=f"Bearer {key}")
    return client


def completion(client: APIClient, **body: Any) -> Any:
    request = {
        "model": "default",
        "user": "bad-input",
        "messages": [{"role": "user", "content": "hello"}],
        **body,
    }
    return client.post("/v1/chat/completions", request, format="json")


# --- the parser: nesting, NUL and unpaired surrogates, on every endpoint -------------------------


@pytest.mark.parametrize(
    "body",
    [
        '{"title": ' + NESTED + "}",
        '{"title": ' + "[" * 65 + "]" * 65 + "}",
    ],
    ids=["decoder-recursion", "deeper-than-64"],
)
def test_deeply_nested_json_is_a_400(api: APIClient, body: str) -> None:
    response = post_raw(api, "/api/v1/chats/", body)
    assert response.status_code == 400, response.content
    assert response.json()["code"] == "parse_error"
    assert "nested deeper than 64 levels" in response.json()["detail"]
    assert not Chat.objects.exists()


def test_nesting_up_to_the_limit_is_parsed(api: APIClient) -> None:
    # 64 levels in all: the object, then 63 arrays. The title is then refused as not a string,
    # by the serializer: the parser let it through.
    response = post_raw(api, "/api/v1/chats/", '{"title": ' + "[" * 63 + "]" * 63 + "}")
    assert response.status_code == 400, response.content
    assert "title" in response.json()


@pytest.mark.parametrize(
    ("escaped", "named"),
    [("a\\u0000b", "U+0000"), ("a\\ud800b", "U+D800"), ("\\udfff", "U+DFFF")],
)
def test_unstorable_characters_in_free_form_step_results_are_a_400(
    api: APIClient, escaped: str, named: str
) -> None:
    """The agent context's step results are free-form JSON, not a CharField: PostgreSQL refused
    them when the turn stored its messages, after the model call."""
    chat_id = new_chat(api)
    body = (
        '{"content": "hi", "agent": {"decision": {"action": "answer"}, '
        '"step_results": [{"note": "' + escaped + '"}]}}'
    )
    response = post_raw(api, f"/api/v1/chats/{chat_id}/turns/", body)
    assert response.status_code == 400, response.content
    detail = response.json()["detail"]
    assert "agent.step_results[0].note" in detail and named in detail
    assert not Message.objects.filter(chat_id=chat_id).exists()
    assert Chat.objects.get(pk=chat_id).turn_token is None


def test_a_nul_in_a_key_is_a_400(api: APIClient) -> None:
    response = post_raw(api, "/api/v1/chats/", '{"policy_overrides": {"win\\u0000dow": 3}}')
    assert response.status_code == 400, response.content
    assert "U+0000" in response.json()["detail"]
    assert not Chat.objects.exists()


def test_unstorable_characters_on_the_openai_endpoint_are_an_openai_400(
    user: Any, use_fake_openai: FakeOpenAI
) -> None:
    client = bearer(user)
    for field in ("content", "tool_call_id"):
        message = (
            '{"role": "user", "content": "a\\u0000b"}'
            if field == "content"
            else '{"role": "tool", "content": "ok", "tool_call_id": "call\\u0000"}'
        )
        body = '{"model": "default", "user": "nul", "messages": [' + message + "]}"
        response = post_raw(client, "/v1/chat/completions", body)
        assert response.status_code == 400, response.content
        error = response.json()["error"]
        assert error["type"] == "invalid_request_error" and "U+0000" in error["message"]
    response = post_raw(
        client, "/v1/chat/completions", '{"model": "default", "user": "\\ud83d", "messages": []}'
    )
    assert response.status_code == 400 and "U+D83D" in response.json()["error"]["message"]
    assert not Chat.objects.exists()
    assert use_fake_openai.chat_requests() == []


# --- query parameters ----------------------------------------------------------------------------


@pytest.mark.parametrize(
    "query", ["after_seq=%C2%B2", "page=%C2%B2", "page_size=%C2%B2", "after_seq=%D9%A3"]
)
def test_non_ascii_digits_in_query_parameters_are_a_400(api: APIClient, query: str) -> None:
    chat_id = new_chat(api)
    response = api.get(f"/api/v1/chats/{chat_id}/messages/?{query}")
    assert response.status_code == 400, response.content
    assert query.split("=")[0] in response.json()


def test_an_after_seq_beyond_any_seq_is_an_empty_page(api: APIClient) -> None:
    chat_id = new_chat(api)
    api.post(f"/api/v1/chats/{chat_id}/turns/", {"content": "hi"}, format="json")
    response = api.get(f"/api/v1/chats/{chat_id}/messages/?after_seq={10**30}")
    assert response.status_code == 200, response.content
    assert response.json()["count"] == 0


# --- policy overrides ----------------------------------------------------------------------------


@pytest.mark.parametrize(
    "overrides",
    [
        '{"cooldown_seconds": 1e400}',
        '{"cooldown_seconds": -1e400}',
        '{"cooldown_seconds": 1e10}',
        '{"window": ' + "9" * 400 + "}",
        '{"hard_limit": 1000000001}',
    ],
)
def test_out_of_range_knobs_are_a_400(api: APIClient, overrides: str) -> None:
    body = '{"policy": "sliding-window", "policy_overrides": ' + overrides + "}"
    response = post_raw(api, "/api/v1/chats/", body)
    assert response.status_code == 400, response.content
    assert "1000000000" in json.dumps(response.json())
    assert not Chat.objects.exists()


def test_a_knob_at_the_limit_is_accepted(api: APIClient) -> None:
    chat_id = new_chat(
        api,
        policy="sliding-window",
        policy_overrides={"cooldown_seconds": 1e9, "hard_limit": 10**9},
    )
    policy = api.get(f"/api/v1/chats/{chat_id}/").json()["effective_policy"]
    assert policy["cooldown_seconds"] == 1e9 and policy["hard_limit"] == 10**9


def test_an_integer_knob_may_be_written_as_a_whole_float(api: APIClient) -> None:
    """JSON Schema's "integer" (what the schema publishes) includes 12.0."""
    chat_id = new_chat(api, policy="sliding-window", policy_overrides={"window": 6.0})
    assert api.get(f"/api/v1/chats/{chat_id}/").json()["effective_policy"]["window"] == 6
    response = api.post("/api/v1/chats/", {"policy_overrides": {"window": 6.5}}, format="json")
    assert response.status_code == 400 and "must be an integer" in json.dumps(response.json())


# --- a chat's own summary cap holds its summarizer -----------------------------------------------


def folded_summary_tokens(api: APIClient, overrides: dict[str, Any]) -> int:
    chat_id = new_chat(api, policy="contract", policy_overrides=overrides)
    for number in range(12):
        content = (
            f"Decision {number}: we will deploy service {number} on host {number} because the "
            f"latency budget of {number * 10} ms was agreed with the customer in meeting {number}."
        )
        response = api.post(f"/api/v1/chats/{chat_id}/turns/", {"content": content}, format="json")
        assert response.status_code == 201, response.content
    # The turns folded synchronously already (contract).
    fold_once(chat_id, RequestReason.MANUAL)
    brief = Brief.objects.get(chat_id=chat_id)
    assert brief.last_consolidated > 0 and brief.summary
    return brief.summary_tokens


def test_a_chats_summary_token_cap_caps_its_summaries(api: APIClient) -> None:
    """The bound reserves the chat's cap for the summary and its synchronous fold plans on it:
    a summarizer held to the global 500 instead wrote summaries over it."""
    assert folded_summary_tokens(api, {}) > 64  # the same conversation, the global cap
    assert 0 < folded_summary_tokens(api, {"summary_token_cap": 64}) <= 64


def test_a_summary_cap_without_room_for_the_headings_or_beyond_any_models_output_is_a_400(
    api: APIClient,
) -> None:
    response = api.post(
        "/api/v1/chats/", {"policy_overrides": {"summary_token_cap": 63}}, format="json"
    )
    assert response.status_code == 400, response.content
    assert "at least 64" in json.dumps(response.json())
    response = api.post(
        "/api/v1/chats/", {"policy_overrides": {"summary_token_cap": 8001}}, format="json"
    )
    assert response.status_code == 400 and "at most 8000" in json.dumps(response.json())


def test_the_summarizer_is_asked_for_the_chats_cap(
    api: APIClient, use_fake_openai: FakeOpenAI
) -> None:
    chat_id = new_chat(api, policy="contract", policy_overrides={"summary_token_cap": 321})
    for number in range(8):
        api.post(f"/api/v1/chats/{chat_id}/turns/", {"content": f"fact {number}"}, format="json")
    fold_once(chat_id, RequestReason.MANUAL)
    instructions = use_fake_openai.summarize_requests()[-1]["body"]["messages"][0]["content"]
    assert "321" in instructions and "500" not in instructions


# --- the OpenAI-compatible endpoint's own rules --------------------------------------------------


@pytest.mark.parametrize(
    ("body", "param"),
    [
        ({"temperature": "hot"}, "temperature"),
        ({"top_p": True}, "top_p"),
        ({"max_tokens": -1}, "max_tokens"),
        ({"max_completion_tokens": 0}, "max_completion_tokens"),
        ({"stop": ["a", 1]}, "stop"),
        ({"seed": 1.5}, "seed"),
        ({"presence_penalty": "high"}, "presence_penalty"),
        ({"tools": {"type": "function"}}, "tools"),
        ({"tool_choice": ["auto"]}, "tool_choice"),
        ({"parallel_tool_calls": "yes"}, "parallel_tool_calls"),
        ({"response_format": "json"}, "response_format"),
    ],
)
def test_bad_sampling_parameters_are_the_clients_400(
    user: Any, use_fake_openai: FakeOpenAI, body: dict[str, Any], param: str
) -> None:
    """Passed on unchecked, the model's 400 came back as chatmem's 502, which SDKs retry."""
    response = completion(bearer(user), **body)
    assert response.status_code == 400, response.content
    error = response.json()["error"]
    assert error["param"] == param and error["type"] == "invalid_request_error"
    assert use_fake_openai.chat_requests() == []
    assert not Message.objects.exists()


def test_good_sampling_parameters_reach_the_model(user: Any, use_fake_openai: FakeOpenAI) -> None:
    # Ranges are the model's to judge: 2.5 is past OpenAI's temperature, not every server's.
    options = {"temperature": 2.5, "top_p": 1, "max_tokens": 50, "stop": ["END"] * 5, "seed": 7}
    response = completion(bearer(user), **options, frequency_penalty=None)
    assert response.status_code == 200, response.content
    sent = use_fake_openai.chat_requests()[-1]["body"]
    assert {key: sent[key] for key in options} == options


@pytest.mark.parametrize(
    ("content", "says"),
    [
        ([{"type": "text", "text": None}], "list of text parts"),
        ([{"type": "text", "text": {"a": 1}}], "list of text parts"),
        ([{"type": "text"}], "list of text parts"),
    ],
)
def test_text_parts_must_hold_text(
    user: Any, use_fake_openai: FakeOpenAI, content: Any, says: str
) -> None:
    """A null text part is refused, not stored and sent as the word "None"."""
    response = completion(bearer(user), messages=[{"role": "user", "content": content}])
    assert response.status_code == 400, response.content
    assert says in response.json()["error"]["message"]
    assert not Message.objects.exists()


def test_the_openai_endpoint_keeps_the_rest_apis_size_limits(
    user: Any, settings: Any, use_fake_openai: FakeOpenAI
) -> None:
    settings.CHATMEM_MAX_MESSAGE_CHARS = 100
    client = bearer(user)
    response = completion(client, messages=[{"role": "user", "content": "x" * 101}])
    assert response.status_code == 400 and "limit is 100" in response.json()["error"]["message"]
    long_prompt = {"role": "system", "content": "y" * 20001}
    response = completion(client, messages=[long_prompt, {"role": "user", "content": "hi"}])
    assert response.status_code == 400 and "limit is 20000" in response.json()["error"]["message"]
    assert not Message.objects.exists() and not Chat.objects.exists()
    assert completion(client, messages=[{"role": "user", "content": "x" * 100}]).status_code == 200


# --- the chat deleted while its turn ran ---------------------------------------------------------


def test_a_chat_deleted_during_its_turn_is_a_404(api: APIClient, monkeypatch: Any) -> None:
    chat_id = new_chat(api)
    real = turn_model.get_chat_model()

    class DeletesTheChat:
        def complete(self, messages: Any, model: str, options: Any = None) -> Any:
            assert api.delete(f"/api/v1/chats/{chat_id}/").status_code == 204
            return real.complete(messages, model, options)

    monkeypatch.setattr(turn_model, "get_chat_model", DeletesTheChat)
    response = api.post(f"/api/v1/chats/{chat_id}/turns/", {"content": "hi"}, format="json")
    assert response.status_code == 404, response.content
    assert response.json()["code"] == "chat_deleted"
    assert not Message.objects.exists()


# --- the manual fold when nothing can queue it ---------------------------------------------------


def test_a_manual_fold_not_queued_answers_in_the_error_shape(api: APIClient) -> None:
    # MEMORY_DISPATCH is "off" in unit tests: nothing can queue it.
    chat_id = contract_chat_after_turns(api, 4)  # a manual fold would fold 2
    response = api.post(f"/api/v1/chats/{chat_id}/consolidate/")
    assert response.status_code == 503
    body = response.json()
    assert body["code"] == "not_queued" and "broker" in body["detail"]
    assert body["queued"] is False and body["chat_id"] == chat_id


# --- a synchronous fold longer than the turn slot's staleness ---------------------------------


def slow_fold(monkeypatch: Any, during: Any) -> None:
    """The turn's synchronous fold calls ``during`` inside its summarizer call."""
    from memory_worker.folding import execute as folds

    real = folds.get_summarizer

    class Slow:
        def __init__(self, cap_tokens: int | None = None) -> None:
            self.inner = real(cap_tokens)

        def summarize(self, summary: str, messages: Any) -> Any:
            during()
            return self.inner.summarize(summary, messages)

    monkeypatch.setattr(folds, "get_summarizer", Slow)


def test_a_turn_whose_slot_was_taken_during_its_fold_stops_before_the_model(
    api: APIClient, user: Any, monkeypatch: Any
) -> None:
    from datetime import timedelta

    from django.utils import timezone

    chat_id = contract_chat_after_turns(api, 6)  # 12 unfolded: the 7th turn folds first
    taken: list[Any] = []

    def outlived_and_taken() -> None:
        hour_ago = timezone.now() - timedelta(hours=1)
        Chat.objects.filter(pk=chat_id).update(turn_started_at=hour_ago)
        taken.append(turn_slot.claim_owned_chat(user.pk, chat_id))  # another request

    slow_fold(monkeypatch, outlived_and_taken)
    response = api.post(f"/api/v1/chats/{chat_id}/turns/", {"content": "late"}, format="json")
    assert response.status_code == 409, response.content
    assert "another turn of this chat started" in response.json()["detail"]
    assert Message.objects.filter(chat_id=chat_id).count() == 12  # nothing stored
    assert Chat.objects.get(pk=chat_id).turn_token == taken[0].token  # the other keeps it


def test_a_long_fold_renews_the_turn_slot(api: APIClient, monkeypatch: Any) -> None:
    from datetime import timedelta

    from django.utils import timezone

    chat_id = contract_chat_after_turns(api, 6)
    started = timezone.now()
    folded: list[int] = []

    def outlived() -> None:
        hour_ago = timezone.now() - timedelta(hours=1)
        folded.append(Chat.objects.filter(pk=chat_id).update(turn_started_at=hour_ago))

    slow_fold(monkeypatch, outlived)
    real = turn_model.get_chat_model()
    slot_ages: list[Any] = []

    class Records:
        def complete(self, messages: Any, model: str, options: Any = None) -> Any:
            slot_ages.append(Chat.objects.get(pk=chat_id).turn_started_at)
            return real.complete(messages, model, options)

    monkeypatch.setattr(turn_model, "get_chat_model", Records)
    response = api.post(f"/api/v1/chats/{chat_id}/turns/", {"content": "late"}, format="json")
    assert response.status_code == 201, response.content
    assert folded == [1]  # the fold ran, and aged the slot by an hour
    assert slot_ages[0] >= started  # not the hour-old start a second request could take over


def test_a_turn_that_outlived_its_slot_stores_without_freeing_the_next_turns(
    api: APIClient, user: Any
) -> None:
    """A turn slower than TURN_SLOT_STALE_SECONDS (a long stream) loses its slot to the next
    request. Its store frees only its own slot (freeing whoever holds it would let a third
    request start while the second runs), and still stores its reply."""
    from datetime import timedelta

    from django.utils import timezone

    from conversations.services import turn_store
    from conversations.variants import resolve_variant

    chat_id = new_chat(api)
    slow = turn_slot.claim_owned_chat(user.pk, chat_id)
    Chat.objects.filter(pk=chat_id).update(turn_started_at=timezone.now() - timedelta(hours=1))
    second = turn_slot.claim_owned_chat(user.pk, chat_id)  # takes the stale slot over
    completion = turn_model.get_chat_model().complete([], resolve_variant(None).model)
    user_row = Message(chat_id=chat_id, role="user", content="slow", token_count=1)
    reply = turn_store.reply_row(slow.chat, completion, resolve_variant(None))
    stored = turn_store.append_messages(slow.chat, slow.token, [user_row, reply])
    assert [m.seq for m in stored] == [1, 2]  # the slow turn's reply is kept
    chat = Chat.objects.get(pk=chat_id)
    assert chat.turn_token == second.token and chat.turn_started_at is not None
    with pytest.raises(turn_slot.TurnInProgress):  # a third request still finds the chat busy
        turn_slot.claim_owned_chat(user.pk, chat_id)
    user_row = Message(chat_id=chat_id, role="user", content="next", token_count=1)
    reply = turn_store.reply_row(second.chat, completion, resolve_variant(None))
    turn_store.append_messages(second.chat, second.token, [user_row, reply])
    assert Chat.objects.get(pk=chat_id).turn_token is None  # its own slot: freed


def contract_chat_at_its_bound(api: APIClient) -> int:
    """A contract chat (at most 10 messages in the context) whose next turn must fold first:
    with dispatch off, nothing folded its 12 messages in the background."""
    chat_id = new_chat(api, policy="contract")
    for number in range(6):
        response = api.post(
            f"/api/v1/chats/{chat_id}/turns/", {"content": f"fact {number}"}, format="json"
        )
        assert response.status_code == 201, response.content
    return chat_id


def test_a_chat_deleted_during_its_synchronous_fold_is_a_404(
    api: APIClient, monkeypatch: Any
) -> None:
    """The fold's commit finds no chat, the turn renews its slot and finds none either: the
    chat is gone, not taken over by another turn (it answered 409 turn_in_progress)."""
    from memory_worker.folding import execute as folds

    chat_id = contract_chat_at_its_bound(api)
    real = folds.get_summarizer

    class DeletingSummarizer:
        """Deletes the chat, then summarizes. A wrapper: the real summarizer is cached, and
        changing it would leave every later test's folds deleting chats."""

        def __init__(self, inner: Any) -> None:
            self.inner = inner
            self.name = inner.name

        def summarize(self, *call: Any) -> Any:
            Chat.objects.filter(pk=chat_id).delete()
            return self.inner.summarize(*call)

    def deleting_summarizer(*args: Any, **kwargs: Any) -> Any:
        return DeletingSummarizer(real(*args, **kwargs))

    monkeypatch.setattr(folds, "get_summarizer", deleting_summarizer)
    response = api.post(f"/api/v1/chats/{chat_id}/turns/", {"content": "hi"}, format="json")
    assert response.status_code == 404, response.content
    assert response.json()["code"] == "chat_deleted"
    assert not Chat.objects.filter(pk=chat_id).exists()


def test_a_chat_deleted_before_its_snapshot_is_read_again_is_a_404(
    api: APIClient, monkeypatch: Any
) -> None:
    """After the synchronous fold the turn reads the memory again; the chat (and its brief)
    deleted in between was a missing brief, a 500."""
    chat_id = contract_chat_at_its_bound(api)
    real = bounded_context.load_snapshot

    def load_after_deleting(wanted: int) -> Any:
        Chat.objects.filter(pk=wanted).delete()
        return real(wanted)

    monkeypatch.setattr(bounded_context, "load_snapshot", load_after_deleting)
    response = api.post(f"/api/v1/chats/{chat_id}/turns/", {"content": "hi"}, format="json")
    assert response.status_code == 404, response.content
    assert response.json()["code"] == "chat_deleted"


# --- a bug's 500 ----------------------------------------------------------------------------------


@pytest.mark.parametrize(
    ("path", "error_of"),
    [
        ("/api/v1/policies/", lambda body: body["code"]),
        ("/v1/models", lambda body: body["error"]["code"]),
    ],
)
def test_an_unexpected_error_is_a_json_500(
    api: APIClient, user: Any, monkeypatch: Any, path: str, error_of: Any
) -> None:
    from conversations.api import openai_compat, views

    def broken(*args: Any, **kwargs: Any) -> Any:
        raise RuntimeError("a bug")

    monkeypatch.setattr(views, "policy_parameters", broken)
    monkeypatch.setattr(openai_compat, "model_variants", broken)
    client = bearer(user) if path.startswith("/v1/") else api
    client.raise_request_exception = False
    response = client.get(path)
    assert response.status_code == 500
    assert response["Content-Type"] == "application/json"
    assert error_of(response.json()) == "server_error"
    assert "a bug" not in response.content.decode()


# --- /v1 parameters ----------------------------------------------------------------------------


def test_v1_null_means_the_default_and_more_than_one_choice_is_refused(user: Any) -> None:
    client = bearer(user)
    assert completion(client, n=None).status_code == 200
    assert completion(client, n=1).status_code == 200
    refused = completion(client, n=2)
    assert refused.status_code == 400 and refused.json()["error"]["param"] == "n"


def test_v1_a_chat_name_that_is_not_a_string_says_so(user: Any) -> None:
    """It fell through to "name the conversation" although one was named."""
    response = completion(bearer(user), metadata={"chatmem_chat_id": 5})
    assert response.status_code == 400
    error = response.json()["error"]
    assert error["param"] == "metadata.chatmem_chat_id" and "string" in error["message"]
    assert not Chat.objects.exists()


@pytest.mark.parametrize(
    "url",
    [
        "/admin/conversations/chat/?policy=%00",  # the admin's list filter: a DataError, a 500
        "/admin/conversations/message/?q=a%00b",
        "/api/v1/chats/?search=%00",
        "/v1/models?x=%00",
    ],
)
def test_a_nul_in_the_url_is_a_json_400(admin_client: Any, url: str) -> None:
    response = admin_client.get(url)
    assert response.status_code == 400
    body = response.json()
    code = body["error"]["code"] if url.startswith("/v1/") else body["code"]
    assert code == "nul_in_url"
