"""The terminal client (`manage.py chat`): a conversation, /brief and /context, bad input. Input
the API refuses with a 400 is refused in the terminal too (not a traceback after the model call),
Ctrl-C ends a session as /quit does, and user names are checked before anything is looked up or
created."""

from __future__ import annotations

import io
import json
import sys
import uuid

import pytest
from django.contrib.auth import get_user_model
from django.core.management import CommandError, call_command
from django.utils import timezone

from conversations.models import Chat, Message
from conversations.services import turns

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
    assert "last consolidated seq 0" in output and "2 unfolded" in output
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


def run_chat_on(stdin: object, *args: str) -> tuple[str, str]:
    """``manage.py chat`` reading ``stdin`` as given: its (stdout, stderr)."""
    out, err = io.StringIO(), io.StringIO()
    call_command("chat", *args, stdin=stdin, stdout=out, stderr=err)
    return out.getvalue(), err.getvalue()


def test_a_message_the_api_refuses_is_refused_and_the_session_goes_on(monkeypatch) -> None:  # type: ignore[no-untyped-def]
    """A NUL (PostgreSQL: DataError) or an unpaired surrogate (UnicodeEncodeError) would fail
    only when the turn is stored, after the model call: it is refused before the call, and the
    session goes on."""
    calls: list[str] = []
    real_run_turn = turns.run_turn

    def run_turn(chat: Chat, content: str, *args: object, **kwargs: object) -> object:
        calls.append(content)
        return real_run_turn(chat, content, *args, **kwargs)  # type: ignore[arg-type]

    monkeypatch.setattr(turns, "run_turn", run_turn)
    _, err = run_chat_on(io.StringIO("hello\x00world\ncaf\udce9 ok\nfine\n"))
    assert calls == ["fine"]  # the model was never asked about the refused lines
    assert "NUL character (U+0000)" in err
    assert "the byte 0xE9, which is not UTF-8" in err
    assert err.count("(nothing stored)") == 2
    chat = Chat.objects.get()
    stored = list(Message.objects.filter(chat=chat).order_by("seq").values_list("role", "content"))
    assert stored[0] == ("user", "fine") and len(stored) == 2


def test_bytes_that_are_not_utf8_on_a_strict_stdin_are_refused_not_fatal(monkeypatch) -> None:  # type: ignore[no-untyped-def]
    """Under a UTF-8 locale sys.stdin is strict: its readline raises UnicodeDecodeError."""
    stdin = io.TextIOWrapper(io.BytesIO(b"caf\xe9 ok\nfine\n"), encoding="utf-8", errors="strict")
    monkeypatch.setattr(sys, "stdin", stdin)
    out, err = io.StringIO(), io.StringIO()
    call_command("chat", stdout=out, stderr=err)
    assert "0xE9, which is not UTF-8" in err.getvalue()
    assert Message.objects.filter(content="fine").exists()
    assert stdin.errors == "strict"  # put back


class InterruptedStdin(io.StringIO):
    """Lines, then Ctrl-C at the prompt."""

    def readline(self, size: int | None = -1) -> str:  # type: ignore[override]
        line = super().readline()
        if not line:
            raise KeyboardInterrupt
        return line


def test_ctrl_c_ends_the_session_as_quit_does() -> None:
    try:
        out, _ = run_chat_on(InterruptedStdin("first\n"))
    except KeyboardInterrupt:  # not re-raised: it would end the whole pytest run
        pytest.fail("Ctrl-C at the prompt escaped the command (a traceback)")
    assert out.endswith("you> \n")  # the prompt's line ended, no traceback
    assert Message.objects.count() == 2
    # As with /quit and end of input, a session whose every turn failed is a failed run.
    chat = Chat.objects.get()
    with pytest.raises(CommandError, match="1 turn\\(s\\) failed"):
        run_chat_on(InterruptedStdin("bad\x00\n"), "--chat", str(chat.pk))


def test_chat_refuses_a_bad_user_name_and_creates_no_user_for_a_chat_it_cannot_open() -> None:
    with pytest.raises(CommandError, match="invalid username"):
        run_chat_on(io.StringIO(""), "--user", "x" * 200)
    # --chat naming a chat that is not there: no user "typo" left behind.
    with pytest.raises(CommandError, match="chat 5 not found for user typo"):
        run_chat_on(io.StringIO(""), "--chat", "5", "--user", "typo")
    # A refused new chat (unknown policy) leaves no user either.
    with pytest.raises(CommandError, match="policy"):
        run_chat_on(io.StringIO(""), "--policy", "no-such-policy", "--user", "typo")
    assert not get_user_model().objects.exists()


def test_policy_with_an_existing_chat_is_refused_not_ignored() -> None:
    run_chat_on(io.StringIO(""), "--policy", "contract")
    chat = Chat.objects.get()
    with pytest.raises(CommandError, match="--policy applies to a new chat only"):
        run_chat_on(io.StringIO("hi\n"), "--chat", str(chat.pk), "--policy", "sliding-window")
    chat.refresh_from_db()
    assert chat.policy == "contract" and not Message.objects.exists()
