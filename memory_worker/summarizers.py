"""The summarizer contract (DESIGN §5, seed 000 §8-9) and its three backends.

``summarize(current_summary, messages) -> SummaryResult`` rewrites the whole memory summary from
the previous one plus the messages being folded. Every backend gets the same input text, in seed
003's exact ``=== EXISTING_SUMMARY === ... === END_NEW_TURNS ===`` format, and every output is
validated the same way: an empty, truncated, refused or over-cap summary is a
``SummarizerError`` and nothing gets written.

Backends:

- ``ChatCompletionsSummarizer``: any OpenAI-compatible Chat Completions endpoint (the default).
- ``ResponsesSummarizer``: the Responses API with a hosted prompt id and version (seed 003).
- ``OfflineSummarizer``: deterministic and extractive, no network (embedded mode and tests).

Plain Python (no Django): configuration comes in as constructor arguments.
"""

import logging
import re
from collections.abc import Iterator, Mapping, Sequence
from dataclasses import dataclass
from typing import Any, Literal, Protocol, cast

import openai
from openai.types.chat import ChatCompletion as ChatCompletionResponse
from openai.types.chat import ChatCompletionChunk

from memory_worker.presets import MIN_SUMMARY_TOKEN_CAP
from memory_worker.text import storable
from memory_worker.tokens import count_tokens

log = logging.getLogger(__name__)

FACTS = "## Facts / Constraints"
GOALS = "## Goals / Preferences"
DECISIONS = "## Decisions"
OPEN_ITEMS = "## Open Items"
ARTIFACTS = "## Key Artifacts"
HEADINGS = (FACTS, GOALS, DECISIONS, OPEN_ITEMS, ARTIFACTS)

DEFAULT_CAP_TOKENS = 500
# Room for the completion beyond the cap, so an over-long summary comes back whole and is
# rejected by counting ("over_cap") instead of arriving cut off ("truncated").
OUTPUT_LIMIT_FACTOR = 1.5
# The one stricter retry after an over-cap summary asks for this share of the cap.
RETRY_TARGET_FACTOR = 0.7


# ---------------------------------------------------------------------------------------------
# Contract types


@dataclass(frozen=True)
class FoldMessage:
    seq: int
    role: str
    content: str


@dataclass(frozen=True)
class SummaryResult:
    text: str
    input_tokens: int  # over all of its calls
    output_tokens: int  # over all of its calls
    backend: str
    calls: int = 1  # model calls it took: 2 after the stricter retry of an over-cap summary


ErrorKind = Literal[
    "timeout",
    "rate_limit",
    "server_error",
    "connection",
    "quota",
    "client_error",
    "empty",
    "truncated",
    "refused",
    "over_cap",
    "malformed",
]

# Worth retrying with backoff: the same request may succeed later. Everything else (a rejected
# request, an exhausted quota, an unusable summary) fails the same way again.
TRANSIENT_KINDS: frozenset[str] = frozenset({"timeout", "rate_limit", "server_error", "connection"})


class SummarizerError(Exception):
    """A summarizer call that produced no usable summary. ``transient`` follows from ``kind``."""

    def __init__(self, kind: ErrorKind, message: str) -> None:
        super().__init__(message)
        self.kind: ErrorKind = kind
        self.transient: bool = kind in TRANSIENT_KINDS


class Summarizer(Protocol):
    name: str

    def summarize(self, current_summary: str, messages: Sequence[FoldMessage]) -> SummaryResult:
        """The complete new summary: ``current_summary`` rewritten to include ``messages``."""
        ...


# ---------------------------------------------------------------------------------------------
# Input format (seed 003 §5.2 step 4) and instructions (seed 000 §8-9)

ROLE_LABELS = {"user": "User", "assistant": "Assistant", "tool": "Tool", "system": "System"}
EMPTY_CONTENT = "(no text)"


def format_fold_input(current_summary: str, messages: Sequence[FoldMessage]) -> str:
    """Seed 003's exact summarizer input: the existing summary (or NONE), then numbered turns."""
    lines = [
        "=== EXISTING_SUMMARY ===",
        current_summary.strip() or "NONE",
        "=== END_EXISTING_SUMMARY ===",
        "",
        "=== NEW_TURNS ===",
    ]
    for number, turn in enumerate(group_turns(messages), start=1):
        if number > 1:
            lines.append("")
        lines.append(f"Turn {number}:")
        lines.extend(f"{role_label(message.role)}: {message_text(message)}" for message in turn)
    lines.append("=== END_NEW_TURNS ===")
    return "\n".join(lines)


def group_turns(messages: Sequence[FoldMessage]) -> list[list[FoldMessage]]:
    """Each user message opens a turn; assistant replies, tool calls and tool results belong to
    the turn they follow. Messages before the first user message form a turn of their own."""
    turns: list[list[FoldMessage]] = []
    for message in messages:
        if message.role == "user" or not turns:
            turns.append([message])
        else:
            turns[-1].append(message)
    return turns


def role_label(role: str) -> str:
    return ROLE_LABELS.get(role, role.capitalize() or "Message")


def message_text(message: FoldMessage) -> str:
    # An assistant message that only called a tool has no text; say so rather than leave
    # a dangling "Assistant:" the model might read as a formatting error.
    return message.content.strip() or EMPTY_CONTENT


# Every rule of seed 000 §8-9 in as few tokens as say it plainly: they travel with every fold,
# so each token here costs as much as a token of conversation, summary after summary
# (docs/benchmarks.md: 302 tokens of instructions were a third of a fold's overhead). Seed 003's
# hosted prompt says its part in three lines.
SUMMARY_INSTRUCTIONS = """\
Rewrite the whole long-term memory summary: EXISTING_SUMMARY (or NONE) merged with NEW_TURNS, \
which are leaving the conversation's context. Deduplicate; the most recent explicit decision \
wins. Keep only durable, action-guiding information, with exact names, numbers, files and URLs. \
Do not invent. No transcript: no dialogue, narration, tone, filler, ephemera or assistant \
reasoning; never reply. These headings in order, short "- " bullets, "- None" if empty:
## Facts / Constraints
## Goals / Preferences
## Decisions
## Open Items
## Key Artifacts
Output only the summary, within {cap_tokens} tokens; drop the least durable first."""


def summary_instructions(cap_tokens: int) -> str:
    return SUMMARY_INSTRUCTIONS.format(cap_tokens=cap_tokens)


def shorten_request(draft_tokens: int, cap_tokens: int) -> str:
    target = int(cap_tokens * RETRY_TARGET_FACTOR)
    return (
        f"That summary is {draft_tokens} tokens, over the hard cap of {cap_tokens} tokens. "
        f"Rewrite it in at most {target} tokens: the same five headings, shorter bullets, the "
        "least durable details dropped first. Output only the summary."
    )


# ---------------------------------------------------------------------------------------------
# Output validation

# A heading line in any language or markup: "## Décisions", "## 1. Facts", "**Open Items**",
# "Decisions:" (a short line ending in a colon). The instructions ask for five; a summary
# translated, renumbered or with two merged still has several, a chat answer or a refusal none
# or one ("Here is what I found:").
ANY_HEADING_LINE = re.compile(
    r"^[ \t]*(?:#{1,6}[ \t]+\S.*|\*\*[^*\n]+\*\*:?|(?:\S+[ \t]+){0,5}\S+:)[ \t]*$",
    re.MULTILINE,
)
MIN_HEADINGS = 2
# A refusal in plain words, from servers that fill no ``refusal`` field (vLLM, Ollama, most
# non-OpenAI models): only when the text has no heading at all.
REFUSAL_OPENING = re.compile(
    r"^\W*(i'?m sorry|i am sorry|sorry\b|i can'?t\b|i cannot\b|i can not\b|i'?m unable|"
    r"i am unable|i won'?t\b|i will not\b|as an ai\b|i apologi[sz]e|my apologies|"
    r"unfortunately\b|i'?m not able|i am not able|i'?m afraid)",
    re.IGNORECASE,
)


def headings_found(summary: str) -> list[str]:
    return [match.strip() for match in ANY_HEADING_LINE.findall(summary)]


def clip_text(text: str, limit: int = 120) -> str:
    flat = " ".join(text.split())
    return flat if len(flat) <= limit else flat[: limit - 1] + "…"


def validate_summary(
    text: str | None,
    finish_reason: str | None,
    cap_tokens: int,
    model: str | None,
    *,
    refusal: str | None = None,
    headings: bool = False,
) -> str:
    """The stripped summary, or a non-transient SummarizerError when it must not be written.

    ``headings``: the model was asked for the five headings (our instructions; a hosted prompt
    is the operator's): fewer than MIN_HEADINGS heading lines is not a summary but a reply (a
    refusal in plain words, a question, a chat answer), and writing it would lose every message
    it was meant to keep."""
    if refusal or finish_reason == "content_filter":
        raise SummarizerError("refused", "summarizer refused to summarize (refusal/content filter)")
    if finish_reason == "length":
        raise SummarizerError("truncated", "summarizer output was cut off by the token limit")
    summary = storable(text or "").strip()
    if not summary:
        raise SummarizerError("empty", "summarizer returned an empty summary")
    tokens = count_tokens(summary, model)
    if tokens > cap_tokens:
        raise SummarizerError(
            "over_cap", f"summary is {tokens} tokens, over the cap of {cap_tokens}"
        )
    found = headings_found(summary)
    if not found and REFUSAL_OPENING.match(summary):
        raise SummarizerError("refused", f"summarizer refused in its text: {clip_text(summary)}")
    if not found and summary.endswith("?"):
        # "Could you clarify which part to summarize?": a reply to the summarizer's input, and
        # written as the summary it would replace every fact the old one kept.
        raise SummarizerError(
            "malformed", f"summarizer asked a question instead: {clip_text(summary)}"
        )
    if headings and len(found) < MIN_HEADINGS:
        raise SummarizerError(
            "malformed",
            f"summarizer output has {len(found)} heading line(s), not a summary under the five "
            f"headings (at least {MIN_HEADINGS} needed): {clip_text(summary)}",
        )
    return summary


# ---------------------------------------------------------------------------------------------
# OpenAI error mapping

# Key-shaped strings providers echo in their errors: OpenAI's and Anthropic's sk-, rk-, pk-;
# xAI's xai-; Groq's gsk_; Google's AIza.
SECRET_PATTERN = re.compile(
    r"\b(?:(?:sk|rk|pk|xai)-|gsk_)[A-Za-z0-9_*\-]{6,}|\bAIza[0-9A-Za-z_\-]{20,}"
)
MAX_ERROR_DETAIL_CHARS = 300
# The provider refused the request itself: its message says what to change, and is about the
# request, not the operator's account. Any other message (an authentication failure, a rate
# limit or quota naming the organisation or project, a server error) goes to the log only:
# a fold's error is shown to the chat's owner (the brief's last_error, the ledger).
REFUSED_REQUEST_STATUSES = frozenset({400, 404, 413, 422})


def error_from_openai(error: openai.OpenAIError) -> SummarizerError:
    """Classify an openai exception so Celery retries only what may succeed later."""
    kind = error_kind(error)
    label = f"summarizer {kind.replace('_', ' ')}"
    log.warning("%s: %s", label, describe_api_error(error), extra={"error_kind": kind})
    shown = describe_api_error(error, with_message=shows_provider_message(error))
    return SummarizerError(kind, f"{label}: {shown}")


def shows_provider_message(error: openai.OpenAIError) -> bool:
    return (
        isinstance(error, openai.APIStatusError) and error.status_code in REFUSED_REQUEST_STATUSES
    )


def error_kind(error: openai.OpenAIError) -> ErrorKind:
    # APITimeoutError subclasses APIConnectionError: check it first.
    if isinstance(error, openai.APITimeoutError):
        return "timeout"
    if isinstance(error, openai.APIConnectionError):
        return "connection"
    if isinstance(error, openai.APIStatusError):
        return status_kind(error)
    # A 2xx body the SDK could not use, or a mid-stream error event: not fixable by retrying.
    return "client_error"


def status_kind(error: openai.APIStatusError) -> ErrorKind:
    status = error.status_code
    if status == 429:
        # An exhausted quota answers 429 too, but only a human topping it up helps.
        return "quota" if is_insufficient_quota(error) else "rate_limit"
    if status == 408:
        return "timeout"
    if status >= 500:
        return "server_error"
    return "client_error"


def is_insufficient_quota(error: openai.APIError) -> bool:
    if "insufficient_quota" in (error.code, getattr(error, "type", None)):
        return True
    body = error.body
    # The SDK unwraps {"error": {...}}; other servers may not wrap at all or wrap differently.
    if isinstance(body, Mapping) and isinstance(body.get("error"), Mapping):
        body = body["error"]
    if isinstance(body, Mapping):
        return "insufficient_quota" in (body.get("code"), body.get("type"))
    return False


def describe_api_error(error: openai.OpenAIError, with_message: bool = True) -> str:
    """A short, secret-free description: HTTP status, error code, and (``with_message``) the
    provider's message."""
    parts: list[str] = []
    if isinstance(error, openai.APIStatusError):
        parts.append(f"HTTP {error.status_code}")
    code = getattr(error, "code", None)
    if code:
        parts.append(str(code))
    detail = provider_message(error) if with_message else ""
    description = " ".join(parts)
    if detail:
        description = f"{description}: {detail}" if description else detail
    return description or type(error).__name__


def provider_message(error: openai.OpenAIError) -> str:
    body = getattr(error, "body", None)
    message = body.get("message") if isinstance(body, Mapping) else None
    if not isinstance(message, str) or not message:
        message = getattr(error, "message", None) or str(error)
    # Providers echo (masked) keys in auth errors; never let anything key-shaped through.
    return SECRET_PATTERN.sub("[redacted]", message)[:MAX_ERROR_DETAIL_CHARS]


def make_openai_client(
    base_url: str | None, api_key: str, timeout: float, max_retries: int = 0
) -> openai.OpenAI:
    """An OpenAI-compatible client. Celery owns retries (with backoff, only for transient
    errors), so the SDK's own retries are off unless asked for."""
    return openai.OpenAI(
        base_url=base_url or None,
        api_key=api_key,
        timeout=timeout,
        max_retries=max_retries,
    )


def create_chat_completion(
    client: openai.OpenAI, body: Mapping[str, Any], timeout: float
) -> ChatCompletionResponse:
    """``client.chat.completions.create(**body)`` without the SDK's parameter transform.

    The transform walks every message against the TypedDict unions of the request types; with
    a 50-message context it took three quarters of a turn's CPU (py-spy, bench.slow_model). The
    chat params declare no aliases or formats, so what it sends is the dict we already have;
    ``client.post`` is the SDK's documented way to send a body as it is, with the same auth,
    retries, error types and response parsing."""
    return client.post(
        "/chat/completions",
        body=dict(body),
        cast_to=ChatCompletionResponse,
        options={"timeout": timeout},
    )


def chat_completion_json(client: openai.OpenAI, body: Mapping[str, Any], timeout: float) -> Any:
    """``create_chat_completion``'s request, answered with the decoded JSON instead of the SDK's
    typed models (the turn reads it with ``conversations.llm.completion_from_json``). A JSON
    content type whose body is not JSON raises ValueError."""
    return client.post(
        "/chat/completions", body=dict(body), cast_to=object, options={"timeout": timeout}
    )


def stream_chat_completion(
    client: openai.OpenAI, body: Mapping[str, Any], timeout: float
) -> openai.Stream[ChatCompletionChunk]:
    """The streaming form of ``create_chat_completion`` (``"stream": true`` is added)."""
    return client.post(
        "/chat/completions",
        body={**body, "stream": True},
        cast_to=ChatCompletionResponse,
        options={"timeout": timeout},
        stream=True,
        stream_cls=openai.Stream[ChatCompletionChunk],
    )


# ---------------------------------------------------------------------------------------------
# Chat Completions backend


@dataclass(frozen=True)
class Draft:
    """One summarizer call's raw output, before validation."""

    text: str
    finish_reason: str | None
    refusal: str | None
    input_tokens: int
    output_tokens: int


class ChatCompletionsSummarizer:
    """Summaries from any OpenAI-compatible Chat Completions endpoint (OpenAI, vLLM, Ollama...).

    ``token_limit_field``: OpenAI's newer models reject ``max_tokens``; servers that do not know
    ``max_completion_tokens`` (Ollama) ignore it, and over-cap output is still caught by counting.
    """

    name = "chat"

    def __init__(
        self,
        client: openai.OpenAI,
        model: str,
        cap_tokens: int = DEFAULT_CAP_TOKENS,
        timeout: float = 30.0,
        *,
        output_token_limit: int | None = None,
        token_limit_field: Literal["max_completion_tokens", "max_tokens"] = (
            "max_completion_tokens"
        ),
    ) -> None:
        self.client = client
        self.model = model
        self.cap_tokens = cap_tokens
        self.timeout = timeout
        self.output_token_limit = output_token_limit or round(cap_tokens * OUTPUT_LIMIT_FACTOR)
        self.token_limit_field = token_limit_field

    def summarize(self, current_summary: str, messages: Sequence[FoldMessage]) -> SummaryResult:
        conversation = [
            {"role": "system", "content": summary_instructions(self.cap_tokens)},
            {"role": "user", "content": format_fold_input(current_summary, messages)},
        ]
        first = self._call(conversation)
        try:
            return self._result(first)
        except SummarizerError as error:
            if error.kind != "over_cap":
                raise
        # One stricter retry: the model shortens its own draft, which usually lands under the cap.
        draft_tokens = count_tokens(first.text, self.model)
        log.info(
            "summary over cap, retrying once with a stricter limit",
            extra={"summary_tokens": draft_tokens, "cap_tokens": self.cap_tokens},
        )
        retry = self._call(
            [
                *conversation,
                {"role": "assistant", "content": first.text},
                {"role": "user", "content": shorten_request(draft_tokens, self.cap_tokens)},
            ]
        )
        result = self._result(retry)
        return SummaryResult(
            result.text,
            first.input_tokens + retry.input_tokens,
            first.output_tokens + retry.output_tokens,
            self.name,
            calls=2,
        )

    def _call(self, conversation: list[dict[str, str]]) -> Draft:
        limit: dict[str, Any] = {self.token_limit_field: self.output_token_limit}
        try:
            response = create_chat_completion(
                self.client, {"model": self.model, "messages": conversation, **limit}, self.timeout
            )
        except openai.OpenAIError as error:
            raise error_from_openai(error) from error
        if not response.choices:
            raise SummarizerError("empty", "summarizer response had no choices")
        choice = response.choices[0]
        text = choice.message.content or ""
        usage = response.usage
        return Draft(
            text=text,
            finish_reason=choice.finish_reason,
            refusal=getattr(choice.message, "refusal", None),
            input_tokens=usage.prompt_tokens if usage else self._count_input(conversation),
            output_tokens=usage.completion_tokens if usage else count_tokens(text, self.model),
        )

    def _count_input(self, conversation: list[dict[str, str]]) -> int:
        return sum(count_tokens(message["content"], self.model) for message in conversation)

    def _result(self, draft: Draft) -> SummaryResult:
        text = validate_summary(
            draft.text,
            draft.finish_reason,
            self.cap_tokens,
            self.model,
            refusal=draft.refusal,
            headings=True,
        )
        return SummaryResult(text, draft.input_tokens, draft.output_tokens, self.name)


# ---------------------------------------------------------------------------------------------
# Responses API backend (hosted prompt, seed 003)


class ResponsesSummarizer:
    """Summaries from the Responses API with a hosted prompt (seed 003 §5.2 step 4).

    The hosted prompt holds the model, its settings and the instructions, so no model name is
    sent, and there is no stricter retry: the instructions cannot be tightened from here without
    changing the exact input format. ``max_output_tokens`` is sent only when given.
    """

    name = "responses"

    def __init__(
        self,
        client: openai.OpenAI,
        prompt_id: str,
        prompt_version: str | None,
        cap_tokens: int = DEFAULT_CAP_TOKENS,
        timeout: float = 30.0,
        *,
        max_output_tokens: int | None = None,
    ) -> None:
        self.client = client
        self.prompt_id = prompt_id
        self.prompt_version = prompt_version
        self.cap_tokens = cap_tokens
        self.timeout = timeout
        self.max_output_tokens = max_output_tokens

    def summarize(self, current_summary: str, messages: Sequence[FoldMessage]) -> SummaryResult:
        fold_input = format_fold_input(current_summary, messages)
        response = self._call(fold_input)
        model = getattr(response, "model", None)
        text = validate_summary(
            response.output_text,
            responses_finish_reason(response),
            self.cap_tokens,
            str(model) if model else None,
            refusal=responses_refusal(response),
        )
        usage = getattr(response, "usage", None)
        return SummaryResult(
            text,
            usage.input_tokens if usage else count_tokens(fold_input),
            usage.output_tokens if usage else count_tokens(text),
            self.name,
        )

    def prompt_reference(self) -> dict[str, str]:
        # Without a version the API uses the hosted prompt's current default version.
        reference = {"id": self.prompt_id}
        if self.prompt_version:
            reference["version"] = self.prompt_version
        return reference

    def _call(self, fold_input: str) -> Any:
        options: dict[str, Any] = {}
        if self.max_output_tokens:
            options["max_output_tokens"] = self.max_output_tokens
        try:
            response = self.client.responses.create(
                prompt=cast(Any, self.prompt_reference()),
                input=fold_input,
                timeout=self.timeout,
                **options,
            )
        except openai.OpenAIError as error:
            raise error_from_openai(error) from error
        if getattr(response, "status", None) == "failed":
            raise failed_response_error(response)
        return response


def responses_finish_reason(response: Any) -> str:
    """The Chat Completions equivalent of a response's status, for ``validate_summary``."""
    if getattr(response, "status", None) != "incomplete":
        return "stop"
    details = getattr(response, "incomplete_details", None)
    if getattr(details, "reason", None) == "content_filter":
        return "content_filter"
    return "length"


def responses_refusal(response: Any) -> str | None:
    for item in getattr(response, "output", None) or []:
        for part in getattr(item, "content", None) or []:
            if getattr(part, "type", None) == "refusal":
                return str(getattr(part, "refusal", "") or "refused")
    return None


def failed_response_error(response: Any) -> SummarizerError:
    error = getattr(response, "error", None)
    code = str(getattr(error, "code", "") or "")
    message = SECRET_PATTERN.sub("[redacted]", str(getattr(error, "message", "") or ""))
    kinds: dict[str, ErrorKind] = {
        "server_error": "server_error",
        "rate_limit_exceeded": "rate_limit",
    }
    kind = kinds.get(code, "client_error")
    # The provider's words go to the log only, as error_from_openai does for everything but a
    # refused request: a rate limit's names the operator's organisation, and the fold's error
    # is shown to the chat's owner.
    log.warning("summarizer response failed: %s %s", code, message, extra={"error_kind": kind})
    return SummarizerError(kind, f"summarizer response failed: {code or 'no error code'}")


# ---------------------------------------------------------------------------------------------
# Offline extractive backend

# A sentence goes to the first category whose rule matches, else to Facts / Constraints.
# Decisions and open items come first: "we decided the budget is 5k" is a decision, and a
# question is open even when it mentions a file.
CATEGORY_RULES: tuple[tuple[str, re.Pattern[str]], ...] = (
    (
        DECISIONS,
        re.compile(
            r"\b(decided|decide|let's|let us|we will|we'll|agreed|agree|chose|chosen|"
            r"going with|settled on)\b",
            re.IGNORECASE,
        ),
    ),
    (
        OPEN_ITEMS,
        re.compile(r"\?|\b(todo|to-do|next|pending|will you|follow up|remind)\b", re.IGNORECASE),
    ),
    (
        FACTS,
        re.compile(
            r"\b(must|never|always|constraint|limit|budget|cannot|can't|deadline|required?)\b",
            re.IGNORECASE,
        ),
    ),
    (
        GOALS,
        re.compile(
            r"\b(want|wants|prefer|prefers|like|likes|goal|goals|plan to|planning to|aim to)\b",
            re.IGNORECASE,
        ),
    ),
    (
        ARTIFACTS,
        re.compile(
            r"https?://\S+"  # URLs
            r"|\b[\w-]+\.(?:py|js|ts|md|txt|json|csv|pdf|ya?ml|toml|html|sql|docx?|xlsx?)\b"
            r'|"[^"]{2,}"|`[^`]+`'  # quoted names, code spans
            r"|\b(?=[\w-]*[A-Za-z])(?=[\w-]*\d)[\w-]{2,}\b",  # names with digits: v2, ABC-123
            re.IGNORECASE,
        ),
    ),
)
# A newer decision with one of these words replaces older decisions about the same thing.
CHANGE_MARKERS = re.compile(
    r"\b(instead|actually|changed?|switch(?:ed)?|no longer|rather than|anymore|replace[sd]?)\b",
    re.IGNORECASE,
)
# Words too common (or too much about deciding itself) to say two decisions share a subject.
STOPWORD_TEXT = (
    "that this with from have will would should could into about their there them they then "
    "than what when which your also just some more most very been were does done make made "
    "instead actually change changed switch switched longer rather anymore replace replaced "
    "decided decide agreed agree chose chosen going settled let's"
)
STOPWORDS = frozenset(STOPWORD_TEXT.split())
FILLER = frozenset(
    {
        "hi",
        "hello",
        "hey",
        "thanks",
        "thank you",
        "ok",
        "okay",
        "sure",
        "great",
        "cool",
        "yes",
        "no",
        "yep",
        "nope",
        "got it",
        "sounds good",
        "perfect",
        "nice",
        "you're welcome",
        "understood",
        "noted",
        "of course",
        "absolutely",
        "alright",
        "all right",
    }
)
SENTENCE_BREAK = re.compile(r"(?<=[.!?])\s+")
LINE_MARKUP = re.compile(r"^\s*(?:[-*+>#]+|\d+[.)])\s*")
# Words that identify one of our headings in a summary, also when a model varied the wording.
HEADING_WORDS = {
    "facts": FACTS,
    "constraints": FACTS,
    "goals": GOALS,
    "preferences": GOALS,
    "decisions": DECISIONS,
    "open": OPEN_ITEMS,
    "pending": OPEN_ITEMS,
    "artifacts": ARTIFACTS,
    "references": ARTIFACTS,
}
HEADING_LINE = re.compile(r"^\s*#{1,6}\s*(?P<title>.+?)\s*$")
MAX_BULLET_CHARS = 300


@dataclass(frozen=True)
class Bullet:
    category: str
    text: str


class OfflineSummarizer:
    """Deterministic extractive summaries, no network (the embedded default and the tests).

    Sentences of the existing summary and of the new messages are sorted under the five
    headings by keyword rules, deduplicated (a repeat counts as new), a decision that says it
    changes something replaces older decisions sharing a word with it, and the oldest bullets
    are dropped first until the rendered summary fits the cap. Same input, same output.
    """

    name = "offline"

    def __init__(self, cap_tokens: int = DEFAULT_CAP_TOKENS) -> None:
        if cap_tokens < MIN_SUMMARY_TOKEN_CAP:
            raise ValueError(f"cap_tokens must be at least {MIN_SUMMARY_TOKEN_CAP}")
        self.cap_tokens = cap_tokens

    def summarize(self, current_summary: str, messages: Sequence[FoldMessage]) -> SummaryResult:
        candidates = [
            *bullets_from_summary(current_summary),
            *(
                bullet
                for message in messages
                if not is_offline_echo(message)
                for bullet in bullets_from_text(message.content)
            ),
        ]
        bullets = drop_superseded_decisions(deduplicate(candidates))
        text = fit_to_cap(bullets, self.cap_tokens)
        fold_input = format_fold_input(current_summary, messages)
        return SummaryResult(text, count_tokens(fold_input), count_tokens(text), self.name)


# The offline chat model (conversations.llm) marks its replies with this: they only echo the
# user's message, which is folded already, so they carry nothing worth remembering.
OFFLINE_MODEL_MARKER = "[offline model]"


def is_offline_echo(message: FoldMessage) -> bool:
    return message.role == "assistant" and message.content.startswith(OFFLINE_MODEL_MARKER)


def bullets_from_summary(summary: str) -> Iterator[Bullet]:
    """Bullets under one of our headings keep their category, so repeated folds are stable;
    any other text is classified like message text."""
    category: str | None = None
    for line in summary.splitlines():
        heading = HEADING_LINE.match(line)
        if heading:
            category = category_for_heading(heading.group("title"))
            continue
        text = clip(LINE_MARKUP.sub("", line).strip())
        if not text or text.rstrip(".").lower() == "none":
            continue
        if category is not None:
            yield Bullet(category, text)
        else:
            yield from bullets_from_text(line)


def category_for_heading(title: str) -> str | None:
    for word in normalise(title).split():
        if word in HEADING_WORDS:
            return HEADING_WORDS[word]
    return None


def bullets_from_text(text: str) -> Iterator[Bullet]:
    for sentence in sentences_of(text):
        yield Bullet(categorize(sentence), sentence)


def sentences_of(text: str) -> Iterator[str]:
    for line in text.splitlines():
        if line.strip().startswith("```"):
            continue
        for part in SENTENCE_BREAK.split(LINE_MARKUP.sub("", line)):
            sentence = part.strip()
            if is_substantive(sentence):
                yield clip(sentence)


def is_substantive(sentence: str) -> bool:
    words = normalise(sentence)
    return len(words.replace(" ", "")) >= 3 and words not in FILLER


def categorize(sentence: str) -> str:
    for category, rule in CATEGORY_RULES:
        if rule.search(sentence):
            return category
    return FACTS


def clip(text: str) -> str:
    if len(text) <= MAX_BULLET_CHARS:
        return text
    return text[: MAX_BULLET_CHARS - 1].rsplit(" ", 1)[0] + "…"


def normalise(text: str) -> str:
    return " ".join(re.findall(r"[a-z0-9']+", text.lower()))


def deduplicate(bullets: Sequence[Bullet]) -> list[Bullet]:
    """One bullet per normalised text, at the position of its latest occurrence: a repeated
    statement is recent, so it is among the last to be dropped for the cap."""
    latest: dict[str, Bullet] = {}
    for bullet in bullets:
        key = normalise(bullet.text)
        latest.pop(key, None)  # re-inserting moves it to the end (dicts keep insertion order)
        latest[key] = bullet
    return list(latest.values())


def drop_superseded_decisions(bullets: Sequence[Bullet]) -> list[Bullet]:
    """Latest explicit decision wins, kept simple: a decision that says it changes something
    ("instead", "switch", "no longer"...) removes earlier decisions sharing a content word."""
    kept: list[Bullet] = []
    for bullet in bullets:
        if bullet.category == DECISIONS and CHANGE_MARKERS.search(bullet.text):
            words = content_words(bullet.text)
            kept = [
                earlier
                for earlier in kept
                if earlier.category != DECISIONS or not words & content_words(earlier.text)
            ]
        kept.append(bullet)
    return kept


def content_words(text: str) -> set[str]:
    return {word for word in normalise(text).split() if len(word) >= 4 and word not in STOPWORDS}


def render(bullets: Sequence[Bullet]) -> str:
    sections = []
    for heading in HEADINGS:
        lines = [f"- {bullet.text}" for bullet in bullets if bullet.category == heading]
        sections.append("\n".join([heading, *(lines or ["- None"])]))
    return "\n\n".join(sections)


def fit_to_cap(bullets: Sequence[Bullet], cap_tokens: int) -> str:
    """Render, dropping the oldest bullets first until it fits. Binary search over how many to
    drop: each probe is one render and one count, instead of one per dropped bullet."""
    if fits(bullets, cap_tokens):
        return render(bullets)
    low, high = 1, len(bullets)  # dropping `high` (all) always fits; find the fewest that do
    while low < high:
        middle = (low + high) // 2
        if fits(bullets[middle:], cap_tokens):
            high = middle
        else:
            low = middle + 1
    if low < len(bullets):
        return render(bullets[low:])
    # Not even the newest bullet fits whole: keep as much of it as fits, never an empty memory.
    return render([shrink_to_fit(bullets[-1], cap_tokens)])


def fits(bullets: Sequence[Bullet], cap_tokens: int) -> bool:
    return count_tokens(render(bullets)) <= cap_tokens


def shrink_to_fit(bullet: Bullet, cap_tokens: int) -> Bullet:
    words = bullet.text.split()
    low, high = 0, len(words)  # the most words that still fit
    while low < high:
        middle = (low + high + 1) // 2
        if fits([Bullet(bullet.category, " ".join(words[:middle]) + "…")], cap_tokens):
            low = middle
        else:
            high = middle - 1
    return Bullet(bullet.category, " ".join(words[:low]) + "…")
