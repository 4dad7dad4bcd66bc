"""The turn's answer is rendered by one shared serializer instance (turn_response_body): it must
be exactly what a fresh TurnResponseSerializer gives, from any thread."""

import json
import threading

import pytest
from rest_framework.renderers import JSONRenderer

from conversations.api.serializers import TurnResponseSerializer, turn_response_body
from conversations.models import Message

pytestmark = pytest.mark.django_db


def fresh_body(user_message: Message, assistant_message: Message) -> object:
    data = TurnResponseSerializer(
        {"user_message": user_message, "assistant_message": assistant_message}
    ).data
    return json.loads(JSONRenderer().render(data))


def test_the_api_answers_what_a_fresh_serializer_renders(api) -> None:  # type: ignore[no-untyped-def]
    chat = api.post("/api/v1/chats/", {"title": "t"}, format="json").json()["id"]
    body = {"content": "plan the release, é 🎉", "agent": {"decision": "plan_direct"}}
    response = api.post(f"/api/v1/chats/{chat}/turns/", body, format="json")
    assert response.status_code == 201
    user_message, assistant_message = Message.objects.filter(chat_id=chat).order_by("seq")
    assert user_message.metadata  # the agent context is part of what is rendered
    assert response.json() == fresh_body(user_message, assistant_message)


def test_threads_share_the_serializer_safely(api) -> None:  # type: ignore[no-untyped-def]
    chat = api.post("/api/v1/chats/", {"title": "t"}, format="json").json()["id"]
    for number in range(4):
        api.post(f"/api/v1/chats/{chat}/turns/", {"content": f"m{number}"}, format="json")
    messages = list(Message.objects.filter(chat_id=chat).order_by("seq"))
    pairs = list(zip(messages[::2], messages[1::2], strict=True))
    expected = [fresh_body(user, reply) for user, reply in pairs]
    wrong: list[object] = []
    go = threading.Barrier(len(pairs))

    def render(index: int) -> None:
        go.wait()
        for _ in range(300):
            got = json.loads(JSONRenderer().render(turn_response_body(*pairs[index])))
            if got != expected[index]:
                wrong.append(got)

    threads = [threading.Thread(target=render, args=(i,)) for i in range(len(pairs))]
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join()
    assert wrong == []
