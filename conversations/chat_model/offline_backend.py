"""The offline chat model: no network, deterministic, and marked as offline in every reply (the
embedded default). Plain Python, no Django."""

import functools
import re
from collections.abc import Generator

from conversations.chat_model.contract import (
    ChatCompletion,
    CompletionStream,
    ModelMessages,
    ToolOptions,
    message_content,
)
from conversations.chat_model.tokens import count_tokens

OFFLINE_MODEL_NAME = "offline"
# Every reply starts with this; the offline summarizer leaves such replies out of a summary.
OFFLINE_MODEL_MARKER = "[offline model]"
ECHO_CHARS = 200
# conversations.services.context puts the summary in a system message starting with this.
SUMMARY_PREFIX = "Summary of the earlier conversation"
WORD_BOUNDARY = re.compile(r"(?<=\s)(?=\S)")


class OfflineChatModel:
    """A stand-in model with no network: answers deterministically, and says it is offline."""

    def __init__(self, summary_prefix: str = SUMMARY_PREFIX) -> None:
        self.summary_prefix = summary_prefix

    def complete(
        self, messages: ModelMessages, model: str, tools: ToolOptions | None = None
    ) -> ChatCompletion:
        # Offline, no tool is ever called: the reply is always text.
        reply = self.reply_to(messages)
        return ChatCompletion(
            content=reply,
            finish_reason="stop",
            prompt_tokens=sum(offline_count(message_content(m), model) for m in messages),
            completion_tokens=count_tokens(reply, model),
            model=OFFLINE_MODEL_NAME,  # what answered, not the name the request asked for
        )

    def stream(
        self, messages: ModelMessages, model: str, tools: ToolOptions | None = None
    ) -> CompletionStream:
        return CompletionStream(self._words(self.complete(messages, model)))

    def reply_to(self, messages: ModelMessages) -> str:
        said = last_user_text(messages)[:ECHO_CHARS] or "(nothing)"
        ending = "" if said.endswith((".", "!", "?")) else "."  # no "May 3rd.."
        summary = "yes" if self.has_summary(messages) else "no"
        return (
            f"{OFFLINE_MODEL_MARKER} You said: {said}{ending} "
            f"(Context: {len(messages)} messages, summary present: {summary}.)"
        )

    def has_summary(self, messages: ModelMessages) -> bool:
        return any(
            message.get("role") == "system"
            and message_content(message).startswith(self.summary_prefix)
            for message in messages
        )

    @staticmethod
    def _words(completion: ChatCompletion) -> Generator[str, None, ChatCompletion]:
        # Split between whitespace and the next word, so the deltas join back exactly.
        yield from WORD_BOUNDARY.split(completion.content)
        return completion


# The offline model stands in for a remote one, whose tokenizing costs this process nothing. It
# sees the same context messages turn after turn, so it remembers their counts instead of
# re-encoding the whole context on every call.
@functools.lru_cache(maxsize=2048)
def offline_count(text: str, model: str) -> int:
    return count_tokens(text, model)


def last_user_text(messages: ModelMessages) -> str:
    for message in reversed(messages):
        if message.get("role") == "user":
            return message_content(message).strip()
    return ""
