"""Memory controls on /v1/chat/completions, driven by the official ``openai`` package with
``extra_body={"chatmem": {...}}``: pause and resume folds, ask for one, pin, choose a new
conversation's policy; the answer's and the stream's ``chatmem`` state; unknown keys refused."""

from __future__ import annotations

import json
from typing import Any

import openai
import pytest
from django.utils import timezone
from rest_framework.authtoken.models import Token

from conversations.chat_model.tokens import count_tokens
from conversations.models import Chat, Consolidation
from conversations.services import chats as chat_service
from conversations.services import pins, turn_store
from memory_worker.coordination.dispatch import RequestReason
from memory_worker.folding import execute as folds
from memory_worker.folding.outcomes import FoldStatus
from memory_worker.scheduling import manual as manual_folds
from tests import test_openai_compat as compat
from tests.conftest import client_for
from tests.support.fake_openai import FakeOpenAI

HELLO: Any = [{"role": "user", "content": "hello"}]
PINS_BUILT = hasattr(pins, "list_pins")  # this branch carries a stub of the pins service

# The OpenAI-compatible tests' fixtures: a token, the fake model under a contract policy, the SDK.
token, memory, client = compat.token, compat.memory, compat.client


@pytest.fixture
def requested(monkeypatch: Any) -> list[tuple[str, int, str]]:
    """Every consolidation asked for, by whom: a turn's, /v1's fold "now", a resume's."""
    calls: list[tuple[str, int, str]] = []

    def recorder(source: str) -> Any:
        def request(chat_id: int, trigger: str, due_at: object = None) -> bool:
            calls.append((source, chat_id, str(trigger)))
            return True

        return request

    monkeypatch.setattr(turn_store, "request_fold", recorder("turn"))
    monkeypatch.setattr(manual_folds, "request_fold", recorder("v1"))
    monkeypatch.setattr(chat_service, "request_fold", recorder("resume"))
    return calls


def send(client: openai.OpenAI, name: str, content: str = "hello", **chatmem: Any) -> Any:
    extra = {"chatmem": chatmem} if chatmem else None
    return client.chat.completions.create(
        model="default",
        messages=[{"role": "user", "content": content}],
        user=name,
        extra_body=extra,
    )


def state_of(completion: Any) -> dict[str, Any]:
    return dict(completion.model_extra["chatmem"])


def test_a_paused_chat_queues_no_fold_but_stays_bounded_and_resuming_asks_for_one(
    client: openai.OpenAI, memory: FakeOpenAI, requested: list[Any]
) -> None:
    paused = send(client, "steered", fold="pause")
    assert state_of(paused)["folds_paused"] is True
    chat = Chat.objects.get(external_id="steered")
    assert chat.folds_paused
    for number in range(8):
        send(client, "steered", f"fact {number}")
    assert not [call for call in requested if call[0] == "turn"]
    # Over the hard bound the turn still folds first: the context stays bounded.
    assert Consolidation.objects.filter(chat=chat, synchronous=True, status="succeeded").exists()
    last = send(client, "steered", "one more")
    assert state_of(last)["unfolded"] <= 10  # contract: K + B
    resumed = send(client, "steered", fold="resume")
    assert state_of(resumed)["folds_paused"] is False
    assert ("resume", chat.pk, RequestReason.RERUN) in requested


def test_fold_now_asks_for_a_manual_fold_and_says_so(
    client: openai.OpenAI, memory: FakeOpenAI, requested: list[Any]
) -> None:
    # Judged as the REST endpoint judges it: a new chat has nothing to fold.
    first = state_of(send(client, "manual", fold="now", policy="contract"))
    chat = Chat.objects.get(external_id="manual")
    assert (first["fold_queued"], first["fold"]) == (False, "nothing_to_fold")
    assert Consolidation.objects.filter(chat=chat, status="nothing_to_fold").exists()
    for number in range(12):
        send(client, "manual", f"message {number}")
    answer = send(client, "manual", fold="now")
    assert ("v1", chat.pk, RequestReason.MANUAL) in requested
    state = state_of(answer)
    assert (state["fold_queued"], state["fold"]) == (True, "queued")
    assert set(state) >= {"summary_version", "unfolded", "degraded", "folds_paused", "seqs"}


def test_the_streams_last_chunk_carries_the_memory_state(
    client: openai.OpenAI, memory: FakeOpenAI, requested: list[Any]
) -> None:
    stream = client.chat.completions.create(
        model="default",
        messages=HELLO,
        user="streamed",
        stream=True,
        extra_body={"chatmem": {"fold": "pause"}},
    )
    states = [chunk.model_extra.get("chatmem") for chunk in stream if chunk.model_extra]
    (state,) = [s for s in states if s]
    assert state["folds_paused"] is True and state["summary_version"] == 0
    assert state["unfolded"] == 2 and state["degraded"] is False


def test_a_new_conversation_takes_its_policy_and_a_different_one_later_is_refused(
    client: openai.OpenAI, memory: FakeOpenAI
) -> None:
    overrides = {"summary_token_cap": 300}
    send(client, "chosen", policy="token-budget", policy_overrides=overrides)
    chat = Chat.objects.get(external_id="chosen")
    assert (chat.policy, chat.policy_overrides) == ("token-budget", overrides)
    send(client, "chosen", policy="token-budget", policy_overrides=overrides)  # the same: fine
    with pytest.raises(openai.BadRequestError) as refused:
        send(client, "chosen", policy="contract")
    assert refused.value.body["param"] == "chatmem.policy"  # type: ignore[index]
    with pytest.raises(openai.BadRequestError) as bad:
        send(client, "other", policy="no-such-preset")
    assert bad.value.body["param"] == "chatmem.policy"  # type: ignore[index]
    assert not Chat.objects.filter(external_id="other").exists()


@pytest.mark.parametrize(
    ("chatmem", "param"),
    [
        ({"pinn": "x"}, "chatmem.pinn"),
        ({"fold": "later"}, "chatmem.fold"),
        ({"pin": ""}, "chatmem.pin"),
        ({"policy_overrides": [1]}, "chatmem.policy_overrides"),
    ],
)
def test_unknown_or_malformed_controls_are_a_400_and_change_nothing(
    client: openai.OpenAI, memory: FakeOpenAI, chatmem: dict[str, Any], param: str
) -> None:
    with pytest.raises(openai.BadRequestError) as refused:
        client.chat.completions.create(
            model="default", messages=HELLO, user="typo", extra_body={"chatmem": chatmem}
        )
    assert refused.value.body["param"] == param  # type: ignore[index]
    assert not Chat.objects.filter(external_id="typo").exists()


def test_another_users_conversation_of_the_same_name_is_not_paused(
    client: openai.OpenAI, memory: FakeOpenAI, other_user: Any, live_server: Any
) -> None:
    send(client, "shared-name")
    key = Token.objects.create(user=other_user).key
    with openai.OpenAI(base_url=f"{live_server.url}/v1", api_key=key, max_retries=0) as bob:
        send(bob, "shared-name", fold="pause")
    mine, theirs = (
        Chat.objects.get(external_id="shared-name", owner__username=u) for u in ("alice", "bob")
    )
    assert not mine.folds_paused and theirs.folds_paused


@pytest.mark.skipif(not PINS_BUILT, reason="pins come with the pins branch")
def test_a_pin_sent_with_a_turn_is_in_its_context(
    client: openai.OpenAI, memory: FakeOpenAI, token: str
) -> None:
    send(client, "pinned", pin="The vault code is 4471.")
    sent = json.dumps(memory.requests[-1].body)
    assert "The vault code is 4471." in sent


@pytest.mark.skipif(not PINS_BUILT, reason="pins come with the pins branch")
def test_a_pin_on_a_conversation_whose_variant_was_removed_is_counted_with_the_default_model(
    client: openai.OpenAI, memory: FakeOpenAI, settings: Any
) -> None:
    send(client, "removed-variant")
    # The chat's default variant, since removed from MODEL_VARIANTS by the operator.
    Chat.objects.filter(external_id="removed-variant").update(model_variant="local")
    send(client, "removed-variant", pin="The vault code is 4471.")
    chat = Chat.objects.get(external_id="removed-variant")
    tokens = count_tokens("The vault code is 4471.", settings.CHAT_MODEL)
    assert [p.tokens for p in pins.list_pins(chat)] == [tokens]


@pytest.mark.skipif(not PINS_BUILT, reason="pins come with the pins branch")
def test_a_refused_pin_creates_no_conversation(client: openai.OpenAI, memory: FakeOpenAI) -> None:
    """A new conversation's first request with a pin over the room (400 pin_refused) created
    the conversation anyway, with the request's policy: the next plain request ran under
    settings the client was told were refused. A refused request leaves nothing."""
    overrides = {"summary_token_cap": 300}
    with pytest.raises(openai.BadRequestError) as refused:
        send(
            client, "refused", pin="word " * 2500, policy="token-budget", policy_overrides=overrides
        )
    assert refused.value.body["code"] == "pin_refused"  # type: ignore[index]
    assert not Chat.objects.filter(external_id="refused").exists()
    send(client, "refused")
    chat = Chat.objects.get(external_id="refused")
    assert (chat.policy, chat.policy_overrides) == ("contract", {})
    assert not pins.list_pins(chat)


# --- the REST API's flag, and the paused chat in the workers' paths --------------------------


def test_the_rest_api_pauses_folds_and_another_user_gets_404(api: Any, other_api: Any) -> None:
    chat_id = api.post("/api/v1/chats/", {}, format="json").json()["id"]
    url = f"/api/v1/chats/{chat_id}/"
    assert other_api.patch(url, {"folds_paused": True}, format="json").status_code == 404
    assert api.get(url).json()["folds_paused"] is False
    response = api.patch(url, {"folds_paused": True}, format="json")
    assert response.status_code == 200 and response.json()["folds_paused"] is True
    assert api.patch(url, {"folds_paused": "yes"}, format="json").status_code == 400


@pytest.mark.django_db
def test_a_paused_chat_is_folded_only_by_hand(user: Any) -> None:
    api = client_for(user)
    chat_id = api.post("/api/v1/chats/", {"policy": "contract"}, format="json").json()["id"]
    Chat.objects.filter(pk=chat_id).update(folds_paused=True)
    for number in range(5):
        api.post(f"/api/v1/chats/{chat_id}/turns/", {"content": f"n {number}"}, format="json")
    now = timezone.now()
    for trigger in (RequestReason.TURN, RequestReason.SWEEP, RequestReason.RERUN):
        assert folds.fold_once(chat_id, trigger, now).status == FoldStatus.NOTHING
    manual = folds.fold_once(chat_id, RequestReason.MANUAL, now)
    assert manual.status == FoldStatus.SUCCEEDED


@pytest.mark.skipif(not PINS_BUILT, reason="pins come with the pins branch")
def test_a_fold_now_answered_503_leaves_no_pin_behind(
    client: openai.OpenAI, memory: FakeOpenAI
) -> None:
    """MEMORY_DISPATCH is off here: nothing can queue the fold. The request is a 503, and the
    pin it carried is not applied: the client's retry would pin it twice."""
    for number in range(4):
        send(client, "unqueued", f"fact {number}")
    with pytest.raises(openai.APIStatusError) as unavailable:
        send(client, "unqueued", pin="The vault code is 4471.", fold="now")
    assert unavailable.value.status_code == 503
    assert not pins.list_pins(Chat.objects.get(external_id="unqueued"))
