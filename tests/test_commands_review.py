"""Review of `manage.py chat` and `issue_token`: input the API refuses with a 400 is refused in
the terminal too (not a traceback after the model call), Ctrl-C ends a session as /quit does,
and usernames are checked before anything is looked up or created."""

from __future__ import annotations

import io
import sys

import pytest
from django.contrib.auth import get_user_model
from django.core.management import CommandError, call_command

from conversations.models import Chat, Message

pytestmark = pytest.mark.django_db


def run_chat(stdin: object, *args: str) -> tuple[str, str]:
    out, err = io.StringIO(), io.StringIO()
    call_command("chat", *args, stdin=stdin, stdout=out, stderr=err)
    return out.getvalue(), err.getvalue()


def test_a_message_the_api_refuses_is_refused_and_the_session_goes_on(monkeypatch) -> None:  # type: ignore[no-untyped-def]
    """A NUL (PostgreSQL: DataError) or an unpaired surrogate (UnicodeEncodeError) failed when
    the turn was stored, after the model call, with a traceback that ended the session."""
    from conversations.services import turns

    calls: list[str] = []
    real_run_turn = turns.run_turn

    def run_turn(chat: Chat, content: str, *args: object, **kwargs: object) -> object:
        calls.append(content)
        return real_run_turn(chat, content, *args, **kwargs)  # type: ignore[arg-type]

    monkeypatch.setattr(turns, "run_turn", run_turn)
    _, err = run_chat(io.StringIO("hello\x00world\ncaf\udce9 ok\nfine\n"))
    assert calls == ["fine"]  # the model was never asked about the refused lines
    assert "NUL character (U+0000)" in err
    assert "the byte 0xE9, which is not UTF-8" in err
    assert err.count("(nothing stored)") == 2
    chat = Chat.objects.get()
    stored = list(Message.objects.filter(chat=chat).order_by("seq").values_list("role", "content"))
    assert stored[0] == ("user", "fine") and len(stored) == 2


def test_bytes_that_are_not_utf8_on_a_strict_stdin_are_refused_not_fatal(monkeypatch) -> None:  # type: ignore[no-untyped-def]
    """Under a UTF-8 locale sys.stdin is strict: readline raised UnicodeDecodeError."""
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
        out, _ = run_chat(InterruptedStdin("first\n"))
    except KeyboardInterrupt:  # not re-raised: it would end the whole pytest run
        pytest.fail("Ctrl-C at the prompt escaped the command (a traceback)")
    assert out.endswith("you> \n")  # the prompt's line ended, no traceback
    assert Message.objects.count() == 2
    # As with /quit and end of input, a session whose every turn failed is a failed run.
    chat = Chat.objects.get()
    with pytest.raises(CommandError, match="1 turn\\(s\\) failed"):
        run_chat(InterruptedStdin("bad\x00\n"), "--chat", str(chat.pk))


@pytest.mark.parametrize("name", ["", "x" * 200, "a b/c", "nul\x00", "caf\udce9"])
def test_issue_token_refuses_a_name_the_user_model_refuses(name: str) -> None:
    """An empty name was a ValueError traceback, 200 characters a DataError on PostgreSQL,
    "a b/c" a user the admin could not have created."""
    with pytest.raises(CommandError, match="invalid username"):
        call_command("issue_token", name, "--create-user", stdout=io.StringIO())
    # Looked up, not created: only what the database cannot compare is refused outright.
    with pytest.raises(CommandError, match=r"invalid username|No user"):
        call_command("issue_token", name, stdout=io.StringIO())
    assert not get_user_model().objects.exists()


def test_chat_refuses_a_bad_user_name_and_creates_no_user_for_a_chat_it_cannot_open() -> None:
    with pytest.raises(CommandError, match="invalid username"):
        run_chat(io.StringIO(""), "--user", "x" * 200)
    # --chat naming a chat that is not there: no user "typo" left behind.
    with pytest.raises(CommandError, match="chat 5 not found for user typo"):
        run_chat(io.StringIO(""), "--chat", "5", "--user", "typo")
    # A refused new chat (unknown policy) leaves no user either.
    with pytest.raises(CommandError, match="policy"):
        run_chat(io.StringIO(""), "--policy", "no-such-policy", "--user", "typo")
    assert not get_user_model().objects.exists()


def test_policy_with_an_existing_chat_is_refused_not_ignored() -> None:
    run_chat(io.StringIO(""), "--policy", "contract")
    chat = Chat.objects.get()
    with pytest.raises(CommandError, match="--policy applies to a new chat only"):
        run_chat(io.StringIO("hi\n"), "--chat", str(chat.pk), "--policy", "sliding-window")
    chat.refresh_from_db()
    assert chat.policy == "contract" and not Message.objects.exists()


def test_an_existing_user_with_a_name_checks_would_refuse_stays_reachable() -> None:
    """Users made before names were checked (or by an importer) must keep their tokens
    revocable: the full check is for new names only."""
    from django.contrib.auth import get_user_model
    from rest_framework.authtoken.models import Token

    user = get_user_model().objects.create(username="a b/c")
    Token.objects.create(user=user)
    call_command("issue_token", "a b/c", "--revoke", stdout=io.StringIO())
    assert not Token.objects.filter(user=user).exists()
