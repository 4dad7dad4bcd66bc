"""A terminal client: hold a conversation with chatmem without curl.

    python manage.py chat [--chat ID] [--policy NAME] [--user USERNAME]

Each line you type is a turn (the same service the API's turn endpoint calls). Commands:
``/brief`` (the memory summary and watermark), ``/context`` (exactly what the model receives
next), ``/help``, ``/quit`` (or end of input)."""

from __future__ import annotations

import json
import sys
from argparse import ArgumentParser
from typing import Any, TextIO

from django.conf import settings
from django.contrib.auth import get_user_model
from django.core.management.base import BaseCommand, CommandError

from conversations.llm import ModelError
from conversations.models import Chat
from conversations.services import chats as chat_service
from conversations.services import turns as turn_service
from conversations.services.variants import UnknownVariant
from memory_worker.presets import PolicyError

HELP = "Type a message, or /brief, /context, /help, /quit."


class Command(BaseCommand):
    help = "Chat with chatmem in the terminal (/brief and /context show its memory)."
    stealth_options = ("stdin",)  # tests feed the conversation through call_command

    def add_arguments(self, parser: ArgumentParser) -> None:
        parser.add_argument("--chat", type=int, help="continue this chat (default: a new one)")
        parser.add_argument("--policy", help="memory policy of a new chat (default: the default)")
        parser.add_argument("--user", default="cli", help="owner (created if missing)")

    def handle(self, *args: Any, **options: Any) -> None:
        user, _ = get_user_model().objects.get_or_create(username=options["user"])
        chat = self.open_chat(user, options["chat"], options["policy"])
        self.stdout.write(f"chat {chat.pk} (policy {chat.policy}). {HELP}")
        self.failed_turns = self.stored_turns = 0
        self.loop(chat, options.get("stdin") or sys.stdin)
        if self.failed_turns and not self.stored_turns:
            # Piped input whose every turn failed is a failed run, for scripts.
            raise CommandError(f"{self.failed_turns} turn(s) failed and none was stored")

    def open_chat(self, user: Any, chat_id: int | None, policy: str | None) -> Chat:
        if chat_id is not None:
            chat = Chat.objects.filter(pk=chat_id, owner=user).first()
            if chat is None:
                raise CommandError(f"chat {chat_id} not found for user {user.username}")
            return chat
        try:
            return chat_service.create_chat(user, title="terminal", policy=policy)
        except PolicyError as error:
            raise CommandError(str(error)) from error

    def loop(self, chat: Chat, stdin: TextIO) -> None:
        while True:
            self.stdout.write("you> ", ending="")
            self.stdout.flush()
            line = stdin.readline()
            if not line or line.strip() == "/quit":
                self.stdout.write("")
                return
            self.handle_line(chat, line.strip())

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
        elif line.startswith("/"):
            self.stdout.write(f"unknown command {line}. {HELP}")
        else:
            self.turn(chat, line)

    def turn(self, chat: Chat, content: str) -> None:
        limit = settings.CHATMEM_MAX_MESSAGE_CHARS
        if len(content) > limit:  # the API's limit (the serializer is not on this path)
            self.stderr.write(f"error: a message holds at most {limit} characters (nothing stored)")
            self.failed_turns += 1
            return
        try:
            result = turn_service.run_turn(chat, content)
        except (
            ModelError,
            turn_service.ContextOverBound,
            turn_service.TurnInProgress,
            UnknownVariant,  # the chat's model_variant was removed from MODEL_VARIANTS
            Chat.DoesNotExist,  # the chat was deleted meanwhile
        ) as error:
            self.stderr.write(f"error: {error or type(error).__name__} (nothing stored)")
            self.failed_turns += 1
            return
        self.stored_turns += 1
        reply = result.assistant_message
        self.stdout.write(f"assistant> {reply.content}")
        self.stdout.write(f"  [seq {reply.seq}, {reply.token_count} tokens]")

    def show_brief(self, chat: Chat) -> None:
        view = chat_service.memory_view(chat)
        snapshot = view.snapshot
        self.stdout.write(
            f"folded up to seq {snapshot.last_consolidated} (version {snapshot.version}), "
            f"{view.unfolded} unfolded, fold due: {view.pending}"
        )
        self.stdout.write(snapshot.summary or "(no summary yet)")
