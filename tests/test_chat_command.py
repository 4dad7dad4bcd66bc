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

from conversations.models import Chat, Message, Pin
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


def test_escape_sequences_and_control_characters_are_never_stored() -> None:
    """Arrow keys went into the database when the terminal did not edit the line."""
    err = io.StringIO()
    call_command(
        "chat", stdin=io.StringIO("abc\x1b[D\x1b[DX\x07\x9b\n"), stdout=io.StringIO(), stderr=err
    )
    assert Message.objects.get(role="user").content == "abcX"
    assert "4 control character(s) or escape sequence(s) removed" in err.getvalue()


def test_list_shows_the_users_chats_with_their_messages_and_last_activity() -> None:
    run_chat(["one"], "--user", "ada")
    run_chat(["two", "three"], "--user", "ada")
    run_chat(["not hers"], "--user", "bob")
    Chat.objects.filter(owner__username="ada", last_seq=2).update(title="first\x1b[31m")
    out = io.StringIO()
    call_command("chat", "--list", "--user", "ada", stdout=out)
    header, *rows = out.getvalue().splitlines()
    assert header.split() == ["id", "updated", "(UTC)", "messages", "title"]
    newest, oldest = Chat.objects.filter(owner__username="ada").order_by("-pk")
    assert [row.split()[0] for row in rows] == [str(newest.pk), str(oldest.pk)]
    assert rows[0].split()[-2:] == ["4", "terminal"] and rows[1].split()[-2:] == ["2", "first"]
    assert Message.objects.filter(chat__owner__username="ada").count() == 6
    out = io.StringIO()
    call_command("chat", "--list", "--user", "nobody", stdout=out)
    assert out.getvalue() == "no chats for user nobody\n"
    assert not get_user_model().objects.filter(username="nobody").exists()
    with pytest.raises(CommandError, match="--list takes only --user"):
        call_command("chat", "--list", "--chat", str(newest.pk), stdout=io.StringIO())


def test_logs_go_to_the_log_file_while_the_user_types(tmp_path, capsys) -> None:  # type: ignore[no-untyped-def]
    """A fold's log line printed into the middle of the prompt."""
    import logging

    from conversations.management.terminal import logs_to_file

    logger = logging.getLogger("chatmem.test_terminal")
    handler = logging.StreamHandler()  # sys.stderr, as the settings' console handler
    logger.addHandler(handler)
    try:
        with logs_to_file(tmp_path / "chat.log"):
            logger.warning("fold finished")
        logger.warning("after the session")
    finally:
        logger.removeHandler(handler)
    assert (tmp_path / "chat.log").read_text() == "fold finished\n"
    assert capsys.readouterr().err == "after the session\n"


def read_until(fd: int, needle: bytes, seen: bytearray, start: int, timeout: float = 60) -> int:
    """Reads the pty into ``seen`` until ``needle`` appears at or after ``start``; where it
    ends."""
    import os
    import select
    import time

    deadline = time.monotonic() + timeout
    while needle not in seen[start:]:
        remaining = deadline - time.monotonic()
        assert remaining > 0, f"no {needle!r} in {bytes(seen[start:])!r}"
        ready, _, _ = select.select([fd], [], [], min(remaining, 0.5))
        if ready:
            try:
                chunk = os.read(fd, 4096)
            except OSError:  # EIO: the command exited and closed the terminal
                chunk = b""
            assert chunk, f"the command ended before {needle!r}: {bytes(seen[start:])!r}"
            seen += chunk
    return seen.index(needle, start) + len(needle)


def test_on_a_terminal_arrow_keys_and_ctrl_a_edit_the_line_and_up_recalls_it(
    require_postgres, tmp_path
) -> None:  # type: ignore[no-untyped-def]
    """`manage.py chat` on a real terminal (a pty): the stored message is the edited text."""
    import os
    import subprocess
    import sys

    from tests.support.workers import ROOT, test_database_url

    env = {
        key: value
        for key, value in os.environ.items()
        if not key.startswith(("OPENAI_", "REDIS_URL", "CHAT_BACKEND"))
    }
    env.update(DATABASE_URL=test_database_url(), TERM="xterm", MEMORY_DISPATCH="off")
    primary, secondary = os.openpty()
    process = subprocess.Popen(
        [sys.executable, "manage.py", "chat", "--user", "tty", "--log-file", str(tmp_path / "log")],
        cwd=ROOT,
        env=env,
        stdin=secondary,
        stdout=secondary,
        stderr=secondary,
        start_new_session=True,
    )
    os.close(secondary)
    seen = bytearray()
    try:
        at = read_until(primary, b"you> ", seen, 0)
        assert b"(logs of this session:" in seen  # the terminal was recognised
        left, up, ctrl_a = b"\x1b[D", b"\x1b[A", b"\x01"
        os.write(primary, b"abc" + left + left + b"X" + ctrl_a + b"Y\r")
        at = read_until(primary, b"you> ", seen, read_until(primary, b"assistant> ", seen, at))
        os.write(primary, up + b"!\r")  # the previous line, recalled and extended
        read_until(primary, b"you> ", seen, read_until(primary, b"assistant> ", seen, at))
        os.write(primary, b"\x04")  # Ctrl-D: end of input
        assert process.wait(timeout=60) == 0, bytes(seen)
    finally:
        if process.poll() is None:
            process.kill()
            process.wait(timeout=10)
        os.close(primary)
    typed = Message.objects.filter(role="user").order_by("seq").values_list("content", flat=True)
    assert list(typed) == ["YaXbc", "YaXbc!"]


def test_pin_pins_and_unpin_keep_a_text_in_the_context_until_unpinned() -> None:
    output = run_chat(["/pin The budget is 1,200 EUR.", "/pins", "/context", "/quit"])
    chat = Chat.objects.get()
    pinned = Pin.objects.get(chat=chat)
    assert (pinned.text, pinned.created_by_id) == ("The budget is 1,200 EUR.", chat.owner_id)
    assert f"pinned #{pinned.pk}" in output
    assert f"#{pinned.pk} [text, {pinned.tokens} tokens] The budget is 1,200 EUR." in output
    assert "- The budget is 1,200 EUR." in output  # the context's pinned block
    output = run_chat(
        [f"/unpin {pinned.pk}", "/pins", "/unpin 999", "/quit"], "--chat", str(chat.pk)
    )
    assert f"unpinned #{pinned.pk}" in output and "(no pins)" in output
    assert not Pin.objects.exists()


def test_a_pin_that_does_not_fit_is_refused_and_the_session_goes_on() -> None:
    err = io.StringIO()
    out = io.StringIO()
    lines = ["/pin " + "word " * 2500, "/pin", "/pins", "/quit"]
    call_command(
        "chat",
        "--policy",
        "token-budget",
        stdin=io.StringIO("".join(f"{line}\n" for line in lines)),
        stdout=out,
        stderr=err,
    )
    assert "tokens kept for pins are left" in err.getvalue()
    assert "type /pin and the text" in err.getvalue()
    assert "(no pins)" in out.getvalue()
    assert not Pin.objects.exists()
