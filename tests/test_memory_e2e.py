"""300 turns per preset through the API, with the fake model server as the only witness: every
message it ever saw in a chat request stays in every later chat request until a summarize
request has carried it, and no summarize request carries a message twice."""

import random

import pytest

from conversations.models import Consolidation, Message
from memory_worker.coordination.dispatch import RequestReason
from memory_worker.engine.presets import PRESETS
from memory_worker.folding.execute import fold_once
from tests.support.fake_openai import read_fold_input

pytestmark = pytest.mark.django_db

TURNS = 300
WORDS = [
    "alpha",
    "beta",
    "gamma",
    "delta",
    "budget",
    "deploy",
    "schema",
    "cache",
    "index",
    "queue",
    "worker",
    "lock",
]


def user_text(rng: random.Random, number: int) -> str:
    filler = " ".join(rng.choice(WORDS) for _ in range(rng.randint(10, 90)))
    return f"u{number:04d} {filler}"


def work_off(chat_id: int) -> None:
    """What a worker does after a turn: fold until nothing is due."""
    for _ in range(5):
        if fold_once(chat_id, RequestReason.TURN).status != "succeeded":
            return


def folded_sections(server) -> list[tuple[int, str]]:  # type: ignore[no-untyped-def]
    """Each fold attempt's input: its first summarize request. A follow-up in the same attempt
    (the fold guard's repair, an over-cap retry) resends the input; it folds nothing again."""
    sections = []
    for index, record in enumerate(server.requests):
        if record.kind == "summarize" and len(record.body["messages"]) <= 2:
            _, messages = read_fold_input(record.text)
            assert messages, "summarize request without its input sections"
            sections.append((index, "\n".join(content for _, content in messages)))
    return sections


@pytest.mark.parametrize("preset", sorted(PRESETS))
def test_three_hundred_turns_nothing_dropped_nothing_refolded(
    api, use_fake_openai, preset: str
) -> None:  # type: ignore[no-untyped-def]
    use_fake_openai.reply_words = 60
    rng = random.Random(preset)
    chat_id = api.post("/api/v1/chats/", {"policy": preset}, format="json").json()["id"]
    for number in range(TURNS):
        response = api.post(
            f"/api/v1/chats/{chat_id}/turns/", {"content": user_text(rng, number)}, format="json"
        )
        assert response.status_code == 201, response.content
        work_off(chat_id)

    requests = use_fake_openai.requests
    chats = [(i, r) for i, r in enumerate(requests) if r.kind == "chat"]
    folds = folded_sections(use_fake_openai)
    assert folds, f"{preset}: 300 turns and no fold"
    stored = list(Message.objects.filter(chat_id=chat_id).order_by("seq"))
    assert len(stored) == 2 * TURNS

    for message in stored:
        carried = [index for index, section in folds if message.content in section]
        assert len(carried) <= 1, f"{preset}: seq {message.seq} folded {len(carried)} times"
        seen = [
            i
            for i, r in chats
            if any(m.get("content") == message.content for m in r.body["messages"])
        ]
        if not seen:
            continue
        # The message is in every chat request from its first appearance until it is folded.
        first = seen[0]
        later = [i for i, _ in chats if i >= first]
        missing = [i for i in later if i not in seen]
        if missing:
            assert carried and carried[0] < missing[0], (
                f"{preset}: seq {message.seq} left the context unfolded"
            )
    # Every chat request ends with exactly the user message just sent.
    for (_, record), number in zip(chats, range(TURNS), strict=True):
        assert record.body["messages"][-1]["content"].startswith(f"u{number:04d} ")
    assert not Consolidation.objects.filter(chat_id=chat_id, synchronous=True).exists()
