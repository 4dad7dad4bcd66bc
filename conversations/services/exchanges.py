"""The turn of an OpenAI-compatible client: the client sends only its new messages (a user message,
or the results of the tools the model called); chatmem supplies the system prompt, the summary and
the unfolded history, calls the model with the client's tools, and stores the new messages and the
reply together, exactly like a REST turn (docs/design.md, the turn): same turn slot, same bound and
synchronous fold, one transaction, consolidation queued after commit.

Which of the request's messages are new: every message after the request's last assistant
message (system and developer messages aside). A client that resends its whole history therefore
gets the same answer as one that sends only the new messages: what precedes its last assistant
message is what chatmem already holds, and is neither stored again nor sent twice."""

from __future__ import annotations

import logging
import uuid
from collections.abc import AsyncIterator, Iterator, Mapping, Sequence
from dataclasses import dataclass, field
from functools import partial
from typing import Any

from django.conf import settings
from django.contrib.auth.models import User
from django.db import IntegrityError, connections, transaction

from conversations.chat_model.contract import ChatCompletion, CompletionStream, ToolOptions
from conversations.chat_model.tokens import count_tokens
from conversations.models import Chat, Message, Role
from conversations.services import chats as chat_service
from conversations.services.bounded_context import Bounded, bounded_snapshot
from conversations.services.chat_backend import get_chat_model
from conversations.services.context import build_model_messages
from conversations.services.turn_model import reply_options, turn_prompt_tokens
from conversations.services.turn_slot import release_turn_slot, turn_slot
from conversations.services.turn_store import (
    TurnResult,
    append_messages,
    queue_memory_work,
    reply_row,
)
from conversations.services.turn_stream import (
    TurnDelta,
    TurnDone,
    TurnEvent,
    TurnEvents,
    TurnFailed,
    start_turn_thread,
)
from conversations.services.turns import log_turn_failure
from conversations.variants import ModelVariant, turn_variant
from memory_worker.engine.state import ROLE_OVERHEAD_TOKENS

log = logging.getLogger("chatmem.turn")

CLIENT_ROLES = ("user", "tool")
INSTRUCTION_ROLES = ("system", "developer")


class BadExchange(ValueError):
    """The request's messages cannot be a turn; ``param`` names the offending field."""

    def __init__(self, message: str, param: str = "messages") -> None:
        super().__init__(message)
        self.param = param


@dataclass(frozen=True)
class Incoming:
    role: str  # "user" or "tool"
    content: str
    metadata: dict[str, Any] = field(default_factory=dict)  # tool_call_id, name


@dataclass(frozen=True)
class ExchangeResult:
    stored: list[Message]  # the new messages, then the reply
    completion: ChatCompletion

    @property
    def reply(self) -> Message:
        return self.stored[-1]


# --- which chat, which messages --------------------------------------------------------------


def chat_for(
    owner: User,
    external_id: str,
    system_prompt: str | None,
    policy: str | None = None,
    policy_overrides: dict[str, object] | None = None,
) -> Chat:
    """The owner's chat of that name, created on first use (with the request's system prompt,
    when it has one, and ``policy`` and ``policy_overrides``: PolicyError if they are not
    valid). Two first requests at once: one creates, the other finds it."""
    found = Chat.objects.filter(owner=owner, external_id=external_id).first()
    if found is not None:
        return found
    try:
        with transaction.atomic():
            chat = chat_service.create_chat(
                owner,
                title=external_id,
                system_prompt=system_prompt,
                policy=policy,
                policy_overrides=policy_overrides,
            )
            Chat.objects.filter(pk=chat.pk).update(external_id=external_id)
    except IntegrityError:
        return Chat.objects.get(owner=owner, external_id=external_id)
    chat.external_id = external_id
    return chat


def instructions_of(messages: Sequence[Mapping[str, Any]]) -> str | None:
    """The leading system/developer messages, joined: a new chat's system prompt."""
    parts = []
    for message in messages:
        if message.get("role") not in INSTRUCTION_ROLES:
            break
        parts.append(text_of(message.get("content")))
    if not parts:
        return None
    prompt = "\n\n".join(parts)
    limit = chat_service.MAX_SYSTEM_PROMPT_CHARS
    if len(prompt) > limit:
        raise BadExchange(
            f"The system messages are {len(prompt)} characters; the limit is {limit}.",
            "messages.content",
        )
    return prompt


def new_messages(messages: Sequence[Mapping[str, Any]]) -> list[Incoming]:
    last_assistant = max(
        (i for i, m in enumerate(messages) if m.get("role") == "assistant"), default=-1
    )
    fresh = [m for m in messages[last_assistant + 1 :] if m.get("role") not in INSTRUCTION_ROLES]
    if not fresh:
        raise BadExchange(
            "No new message: send a user message, or tool results, after the last assistant "
            "message."
        )
    return [incoming_of(message) for message in fresh]


def incoming_of(message: Mapping[str, Any]) -> Incoming:
    role = message.get("role")
    if role not in CLIENT_ROLES:
        raise BadExchange(f'A new message must be a user or tool message, not "{role}".')
    content = text_of(message.get("content"))
    limit = settings.CHATMEM_MAX_MESSAGE_CHARS
    if len(content) > limit:
        raise BadExchange(
            f"A {role} message is {len(content)} characters; the limit is {limit}.",
            "messages.content",
        )
    if role == "tool":
        call_id = message.get("tool_call_id")
        if not isinstance(call_id, str) or not call_id:
            raise BadExchange("A tool message needs its tool_call_id.", "messages.tool_call_id")
        return Incoming(role, content, {"tool_call_id": call_id})
    if not content.strip():
        raise BadExchange("The user message is empty.", "messages.content")
    return Incoming(role, content)


def text_of(content: Any) -> str:
    """Content as a string: plain text, or the text parts of a content list."""
    if content is None:
        return ""
    if isinstance(content, str):
        return content
    if isinstance(content, list) and all(
        isinstance(part, dict) and part.get("type") == "text" and isinstance(part.get("text"), str)
        for part in content
    ):
        return "".join(part["text"] for part in content)
    raise BadExchange(
        'Content must be a string or a list of text parts ({"type": "text", "text": "..."}).',
        "messages.content",
    )


# --- the exchange -----------------------------------------------------------------------------


@dataclass
class Prepared:
    """A claimed turn slot and the context to send; ``finish`` stores the reply."""

    chat: Chat
    token: uuid.UUID
    variant: ModelVariant
    bounded: Bounded
    incoming: list[Incoming]
    incoming_tokens: list[int]
    context: list[dict[str, object]]
    prompt_tokens: int  # the context's, as the bound counts it

    def options(self, tools: ToolOptions | None) -> dict[str, object]:
        """The client's options with the reply's output limit (turn_model.reply_options)."""
        return reply_options(self.variant, self.prompt_tokens, tools, chat_id=self.chat.pk)


def prepare(chat: Chat, incoming: list[Incoming], *, variant_name: str | None) -> Prepared:
    """Claims the chat's turn slot (TurnInProgress if taken) and bounds the context; the caller
    must ``release`` it. Raises UnknownVariant, ContextOverBound."""
    with turn_slot(chat, None) as token:
        variant = turn_variant(variant_name, chat.model_variant)
        tokens = [incoming_tokens(m, variant.model) for m in incoming]
        # Tool results continue the newest stored turn: a fold before them must keep it whole.
        opens_turn = incoming[0].role == Role.USER.value
        bounded = bounded_snapshot(
            chat, token, variant, new_messages_tokens(tokens), opens_turn=opens_turn
        )
        snapshot = bounded.snapshot
        context = build_model_messages(chat, snapshot, [model_entry(m) for m in incoming])
        prompt = turn_prompt_tokens(chat, snapshot, variant, new_messages_tokens(tokens))
    return Prepared(chat, token, variant, bounded, incoming, tokens, context, prompt)


def incoming_tokens(message: Incoming, model: str) -> int:
    """A new message's tokens as stored and counted in every later bound: its text, and a tool
    result's ``tool_call_id``, which reaches the model with it (an assistant's calls are counted
    with their ids too)."""
    call_id = message.metadata.get("tool_call_id")
    extra = count_tokens(call_id, model) if isinstance(call_id, str) else 0
    return count_tokens(message.content, model) + extra


def new_messages_tokens(tokens: list[int]) -> int:
    """What the engine counts as the new message: it adds one message's role overhead, and
    each further new message (several tool results) brings its own."""
    return sum(tokens) + ROLE_OVERHEAD_TOKENS * (len(tokens) - 1)


def release(prepared: Prepared) -> None:
    release_turn_slot(prepared.chat, prepared.token)


def run_exchange(
    chat: Chat, incoming: list[Incoming], *, variant_name: str | None, tools: ToolOptions | None
) -> ExchangeResult:
    prepared = prepare(chat, incoming, variant_name=variant_name)
    with turn_slot(chat, prepared.token):
        model = prepared.variant.model
        completion = get_chat_model().complete(prepared.context, model, prepared.options(tools))
        return store_exchange(prepared, completion)


def model_entry(message: Incoming) -> dict[str, object]:
    return {"role": message.role, "content": message.content, **message.metadata}


def store_exchange(prepared: Prepared, completion: ChatCompletion) -> ExchangeResult:
    chat = prepared.chat
    rows = [
        Message(
            chat_id=chat.pk,
            role=message.role,
            content=message.content,
            token_count=tokens,
            model_variant=prepared.variant.name,
            metadata=message.metadata,
        )
        for message, tokens in zip(prepared.incoming, prepared.incoming_tokens, strict=True)
    ]
    reply = reply_row(chat, completion, prepared.variant, prepared.bounded)
    stored = append_messages(chat, prepared.token, [*rows, reply])
    queue_memory_work(chat, prepared.bounded.snapshot, stored)
    return ExchangeResult(stored, completion)


# --- streaming --------------------------------------------------------------------------------


# How long a reader waits for the model before it is handed None: the API then sends an SSE
# comment, so that proxies do not cut a stream the model is silent on (thinking, or a slow
# first token) as idle, as the REST stream's heartbeat does.
HEARTBEAT_SECONDS = 15.0


class StreamedExchange:
    """The model's deltas as they come, then the stored result. The model stream is consumed and
    the reply stored on a thread of its own, so a client that disconnects mid-stream still gets
    its turn completed and stored (and the turn slot released). Readable from a thread
    (``deltas``) or an event loop (``adeltas``, holding no thread while it waits)."""

    def __init__(self, prepared: Prepared, stream: CompletionStream) -> None:
        self.prepared = prepared
        self.stream = stream
        self.events = TurnEvents()
        self.result: ExchangeResult | None = None
        self.error: BaseException | None = None
        self.thread = start_turn_thread("chatmem-exchange", self._run)

    def _run(self) -> None:
        last: TurnEvent = TurnFailed(RuntimeError("the exchange ended early"))
        try:
            for delta in self.stream:
                self.events.put_delta(delta)
            assert self.stream.result is not None
            self.result = store_exchange(self.prepared, self.stream.result)
            last = TurnDone(TurnResult(self.result.stored[0], self.result.reply))
        except BaseException as error:  # reported to the client after the deltas
            log_turn_failure("streamed exchange failed", error, self.prepared.chat.pk)
            self.error = error
            last = TurnFailed(error if isinstance(error, Exception) else RuntimeError(error))
        finally:
            self._finish(last)

    def _finish(self, last: TurnEvent) -> None:
        """Whatever fails here (a database error while releasing the slot), the stream gets its
        last event: without it the client would wait on keep-alives for ever."""
        cleanups = (
            self.stream.close,  # on a failure mid-stream: the upstream connection too
            partial(release, self.prepared),
            connections.close_all,  # this thread's own connection
        )
        for cleanup in cleanups:
            try:
                cleanup()
            except Exception:
                log.exception("cleaning up a streamed exchange failed")
        self.events.put(last)

    def deltas(self) -> Iterator[str | None]:
        """Each delta; None after HEARTBEAT_SECONDS without one."""
        for event in self.events.iter_events(HEARTBEAT_SECONDS):
            if event is None:
                yield None
            elif isinstance(event, TurnDelta):
                yield event.content

    async def adeltas(self) -> AsyncIterator[str | None]:
        async for event in self.events.aiter_events(HEARTBEAT_SECONDS):
            if event is None:
                yield None
            elif isinstance(event, TurnDelta):
                yield event.content


def start_streamed_exchange(
    chat: Chat, incoming: list[Incoming], *, variant_name: str | None, tools: ToolOptions | None
) -> StreamedExchange:
    """Errors before the first delta (slot taken, bound, upstream refusing the request) raise
    here, so the API can still answer with a plain error status."""
    prepared = prepare(chat, incoming, variant_name=variant_name)
    try:
        model = prepared.variant.model
        stream = get_chat_model().stream(prepared.context, model, prepared.options(tools))
    except BaseException:
        release(prepared)
        raise
    return StreamedExchange(prepared, stream)
