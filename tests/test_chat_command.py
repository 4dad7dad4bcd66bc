"""The terminal client (`manage.py chat`): a conversation, /brief and /context, bad input."""

from __future__ import annotations

import io
import json
import uuid

import pytest
from django.core.management import CommandError, call_command
from django.utils import timezone

from conversations.models import Chat, Message

pytestmark = pytest.mark.django_db


def run_chat(lines: list[str], *args: str) -> str:
    out = io.StringIO()
    call_command(
        "chat",
        *args,
        stdin=io.StringIO("".join(f"{line}\n" for line in lines)),
        stdout=out,
        stderr=io.StringIO(),
    )
    return out.getvalue()


def test_a_terminal_conversation_is_stored_and_inspectable() -> None:
    output = run_chat(
        ["My name is Ada.", "/brief", "/context", "/nope", "/quit"], "--policy", "contract"
    )
    chat = Chat.objects.get()
    assert chat.policy == "contract"
    stored = list(Message.objects.filter(chat=chat).order_by("seq").values_list("role", "content"))
    assert stored[0] == ("user", "My name is Ada.")
    assert [role for role, _ in stored] == ["user", "assistant"]
    assert f"assistant> {stored[1][1]}" in output
    assert "folded up to seq 0" in output and "2 unfolded" in output
    context = json.loads(output[output.index("[\n") : output.rindex("]") + 1])
    assert context[-1] == {"role": "assistant", "content": stored[1][1]}
    assert "unknown command /nope" in output


def test_continuing_a_chat_appends_to_it() -> None:
    run_chat(["first"])
    chat = Chat.objects.get()
    run_chat(["second"], "--chat", str(chat.pk))
    assert Message.objects.filter(chat=chat).count() == 4


def test_unknown_chat_and_policy_are_clear_errors() -> None:
    with pytest.raises(CommandError, match="chat 999 not found"):
        run_chat([], "--chat", "999")
    with pytest.raises(CommandError, match="policy"):
        run_chat([], "--policy", "no-such-policy")


def test_turn_failures_are_reported_and_fail_a_run_that_stored_nothing(settings) -> None:  # type: ignore[no-untyped-def]
    """A failing turn printed a traceback on every line; a run whose every turn failed exited
    0; over-long lines went past the API's limit."""
    run_chat(["first"])
    chat = Chat.objects.get()
    # Another turn of the chat in progress: this one is refused (409), stores nothing.
    Chat.objects.filter(pk=chat.pk).update(turn_token=uuid.uuid4(), turn_started_at=timezone.now())
    with pytest.raises(CommandError, match="1 turn\\(s\\) failed and none was stored"):
        run_chat(["second"], "--chat", str(chat.pk))
    Chat.objects.filter(pk=chat.pk).update(turn_token=None, turn_started_at=None)
    settings.CHATMEM_MAX_MESSAGE_CHARS = 10
    with pytest.raises(CommandError, match="failed"):
        run_chat(["x" * 11], "--chat", str(chat.pk))
    assert Message.objects.filter(chat=chat).count() == 2
    output = run_chat(["café", "/context"], "--chat", str(chat.pk))
    assert '"café"' in output  # as the model receives it, not \\u00e9
