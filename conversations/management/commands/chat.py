"""A terminal client: hold a conversation with chatmem without curl.

    python manage.py chat [--chat ID] [--policy NAME] [--user USERNAME] [--log-file PATH]
    python manage.py chat --list [--user USERNAME]

Each line you type is a turn (the same service the API's turn endpoint calls). Commands:
``/brief`` (the memory summary and watermark), ``/context`` (exactly what the model receives
next), ``/pin TEXT``, ``/pins`` and ``/unpin ID`` (texts kept verbatim in every context, as the
API's pins), ``/help``, ``/quit`` (or end of input, or Ctrl-C: each ends the session with status
0, or 1 when every turn of the session failed). On a terminal, lines are edited with readline (arrow
keys, Ctrl-A/E, Up for the session's earlier lines) and logs go to ``--log-file``, not the
prompt; escape sequences and control characters are never stored."""

from __future__ import annotations

import io
import json
import sys
import tempfile
from argparse import ArgumentParser
from contextlib import nullcontext
from pathlib import Path
from typing import Any

from django.conf import settings
from django.contrib.auth import get_user_model
from django.core.management.base import BaseCommand, CommandError
from django.db import transaction

from conversations.api.parsers import unstorable
from conversations.chat_model.contract import ModelError
from conversations.management.terminal import LineReader, logs_to_file, printable
from conversations.management.usernames import checked_username, find_user
from conversations.models import Chat, Pin
from conversations.services import chats as chat_service
from conversations.services import pins as pin_service
from conversations.services import turns as turn_service
from conversations.services.bounded_context import ContextOverBound
from conversations.services.turn_slot import TurnInProgress
from conversations.variants import UnknownVariant
from memory_worker.engine.presets import PolicyError

HELP = "Type a message, or /brief, /context, /pin TEXT, /pins, /unpin ID, /help, /quit."
PROMPT = "you> "


class Command(BaseCommand):
    help = "Chat with chatmem in the terminal (/brief and /context show its memory)."
    stealth_options = ("stdin",)  # tests feed the conversation through call_command

    def add_arguments(self, parser: ArgumentParser) -> None:
        parser.add_argument("--chat", type=int, help="continue this chat (default: a new one)")
        parser.add_argument("--policy", help="memory policy of a new chat (default: the default)")
        parser.add_argument("--user", default="cli", help="owner (created if missing)")
        parser.add_argument("--list", action="store_true", help="list the user's chats and exit")
        parser.add_argument(
            "--log-file",
            type=Path,
            default=Path(tempfile.gettempdir()) / "chatmem-chat.log",
            help="where logs go while you type on a terminal (default: %(default)s)",
        )

    def handle(self, *args: Any, **options: Any) -> None:
        if options["list"]:
            if options["chat"] is not None or options["policy"] is not None:
                raise CommandError("--list takes only --user; drop --chat and --policy")
            self.list_chats(options["user"])
            return
        chat = self.open_chat(options["user"], options["chat"], options["policy"])
        self.stdout.write(f"chat {chat.pk} (policy {chat.policy}). {HELP}")
        self.failed_turns = self.stored_turns = 0
        stdin = options.get("stdin") or sys.stdin
        reader = LineReader(stdin)
        if reader.interactive:
            self.stdout.write(f"(logs of this session: {options['log_file']})")
        logs = logs_to_file(options["log_file"]) if reader.interactive else nullcontext()
        # Under a UTF-8 locale, a byte that is not UTF-8 raised UnicodeDecodeError at the prompt
        # and lost the rest of the input; escaped (a lone surrogate), turn() refuses its line.
        reset = stdin if stdin is sys.stdin and isinstance(stdin, io.TextIOWrapper) else None
        if reset is not None and reset.errors == "strict":
            reset.reconfigure(errors="surrogateescape")
        else:
            reset = None
        try:
            with logs:
                self.loop(chat, reader)
        except KeyboardInterrupt:  # Ctrl-C, at the prompt or during a turn: as /quit
            self.stdout.write("")
        finally:
            if reset is not None:
                reset.reconfigure(errors="strict")
        if self.failed_turns and not self.stored_turns:
            # Piped input whose every turn failed is a failed run, for scripts.
            raise CommandError(f"{self.failed_turns} turn(s) failed and none was stored")

    def open_chat(self, username: str, chat_id: int | None, policy: str | None) -> Chat:
        """The chat to talk in; the user is created (when missing) only with a new chat, and not
        when the new chat is refused."""
        if chat_id is not None and policy is not None:
            raise CommandError(
                "--policy applies to a new chat only (a chat's policy is changed in the API "
                "or the admin); drop --policy or --chat"
            )
        user = find_user(username)
        if chat_id is not None:
            chat = None if user is None else Chat.objects.filter(pk=chat_id, owner=user).first()
            if chat is None:
                raise CommandError(f"chat {chat_id} not found for user {username}")
            return chat
        user_model = get_user_model()
        try:
            with transaction.atomic():
                if user is None:
                    # CommandError for a name the user model would refuse.
                    lookup: dict[str, Any] = {user_model.USERNAME_FIELD: checked_username(username)}
                    user, _ = user_model._default_manager.get_or_create(**lookup)
                return chat_service.create_chat(user, title="terminal", policy=policy)
        except (PolicyError, UnknownVariant) as error:
            raise CommandError(str(error)) from error

    def list_chats(self, username: str) -> None:
        user = find_user(username)
        listed = [] if user is None else chat_service.chats_of(user)
        if not listed:
            self.stdout.write(f"no chats for user {username}")
            return
        self.stdout.write(f"{'id':>6}  {'updated (UTC)':<16}  {'messages':>8}  title")
        for listing in listed:
            updated = listing.last_activity.strftime("%Y-%m-%d %H:%M")
            title, _ = printable(listing.title)
            self.stdout.write(f"{listing.id:>6}  {updated:<16}  {listing.messages:>8}  {title}")

    def loop(self, chat: Chat, reader: LineReader) -> None:
        while True:
            if not reader.interactive:
                self.stdout.write(PROMPT, ending="")
                self.stdout.flush()
            line = reader.read(PROMPT)
            text, removed = printable(line or "")
            text = text.strip()
            if line is None or text == "/quit":
                self.stdout.write("")
                return
            if removed and text and not text.startswith("/"):
                self.stderr.write(
                    f"note: {removed} control character(s) or escape sequence(s) removed "
                    "from the message"
                )
            self.handle_line(chat, text)

    def handle_line(self, chat: Chat, line: str) -> None:
        if not line:
            return
        if line == "/help":
            self.stdout.write(HELP)
        elif line == "/brief":
            self.show_brief(chat)
        elif line == "/context":
            context = chat_service.next_context(chat)
            self.stdout.write(json.dumps(context, indent=2, ensure_ascii=False))
        elif line == "/pins":
            self.show_pins(chat)
        elif line == "/pin" or line.startswith("/pin "):
            self.pin(chat, line.removeprefix("/pin").strip())
        elif line == "/unpin" or line.startswith("/unpin "):
            self.unpin(chat, line.removeprefix("/unpin").strip())
        elif line.startswith("/"):
            self.stdout.write(f"unknown command {line}. {HELP}")
        else:
            self.turn(chat, line)

    def turn(self, chat: Chat, content: str) -> None:
        # What the API refuses with a 400 (its parser and serializer are not on this path):
        # otherwise a NUL or an unpaired surrogate failed to be stored, after the model call.
        problem = unstorable(content)
        if problem is not None:
            undecoded = next((char for char in content if "\udc80" <= char <= "\udcff"), None)
            if undecoded is not None and "\x00" not in content:  # surrogateescape's, see handle
                problem = f"the byte 0x{ord(undecoded) - 0xDC00:02X}, which is not UTF-8"
            self.refuse(f"the message contains {problem}")
            return
        limit = settings.CHATMEM_MAX_MESSAGE_CHARS
        if len(content) > limit:
            self.refuse(f"a message holds at most {limit} characters")
            return
        try:
            result = turn_service.run_turn(chat, content)
        except (
            ModelError,
            ContextOverBound,
            TurnInProgress,
            UnknownVariant,  # the chat's model_variant was removed from MODEL_VARIANTS
            Chat.DoesNotExist,  # the chat was deleted meanwhile
        ) as error:
            self.refuse(str(error) or type(error).__name__)
            return
        self.stored_turns += 1
        reply = result.assistant_message
        self.stdout.write(f"assistant> {reply.content}")
        self.stdout.write(f"  [seq {reply.seq}, {reply.token_count} tokens]")

    def pin(self, chat: Chat, text: str) -> None:
        problem = unstorable(text) if text else "nothing: type /pin and the text to keep"
        if problem is not None:
            self.stderr.write(f"error: the pin contains {problem} (nothing stored)")
            return
        try:
            made = pin_service.add_pin(chat, text=text, user=chat.owner)
        except (pin_service.PinRefused, Chat.DoesNotExist) as error:
            self.stderr.write(f"error: {error} (nothing stored)")
            return
        self.stdout.write(f"pinned #{made.pk} ({made.tokens} tokens)")

    def show_pins(self, chat: Chat) -> None:
        pins = pin_service.list_pins(chat)
        if not pins:
            self.stdout.write("(no pins)")
        for pinned in pins:
            source = f"message {pinned.seq}" if pinned.seq is not None else "text"
            self.stdout.write(f"#{pinned.pk} [{source}, {pinned.tokens} tokens] {pinned.text}")

    def unpin(self, chat: Chat, pin_id: str) -> None:
        try:
            pin_service.remove_pin(chat, int(pin_id))
        except (ValueError, Pin.DoesNotExist):
            self.stderr.write(f"error: no pin #{pin_id} in this chat (see /pins)")
            return
        self.stdout.write(f"unpinned #{pin_id}")

    def refuse(self, reason: str) -> None:
        self.stderr.write(f"error: {reason} (nothing stored)")
        self.failed_turns += 1

    def show_brief(self, chat: Chat) -> None:
        view = chat_service.memory_view(chat)
        snapshot = view.snapshot
        self.stdout.write(
            f"last consolidated seq {snapshot.last_consolidated} (version {snapshot.version}), "
            f"{view.unfolded} unfolded, fold due: {view.pending}"
        )
        self.stdout.write(snapshot.summary or "(no summary yet)")
