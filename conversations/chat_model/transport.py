"""The OpenAI SDK's side of every model call, for the chat turn and the summarizers alike:
client construction, the Chat Completions requests, the one mapping of openai errors and HTTP
statuses to error kinds, and the redaction of key-shaped strings from what is shown or logged
(conversations.chat_model.http sends the turn's plain request and uses the same two).

Plain Python (no Django).
"""

import re
import threading
from collections.abc import Mapping
from typing import Any, Literal
from urllib.parse import urlsplit

import openai
from openai.types.chat import ChatCompletion as ChatCompletionResponse
from openai.types.chat import ChatCompletionChunk

# What went wrong with a request, as far as the endpoint's answer (or its absence) tells.
TransportErrorKind = Literal[
    "timeout", "rate_limit", "server_error", "connection", "quota", "client_error"
]

# ---------------------------------------------------------------------------------------------
# Redaction

# Key-shaped strings providers echo in their errors: OpenAI's and Anthropic's sk-, rk-, pk-;
# xAI's xai-; Groq's gsk_; Google's AIza.
SECRET_PATTERN = re.compile(
    r"\b(?:(?:sk|rk|pk|xai)-|gsk_)[A-Za-z0-9_*\-]{6,}|\bAIza[0-9A-Za-z_\-]{20,}"
)
# Whatever follows "Bearer " is a credential, whatever its format (a gateway's, pplx-, a JWT).
BEARER_PATTERN = re.compile(r"(?i)\b(bearer\s+)[^\s\"',;]+")
REDACTED = "[redacted]"
MAX_ERROR_DETAIL_CHARS = 300
# Keys shorter than this are not searched for as literals: "x" or "ollama" as a placeholder key
# would redact ordinary words.
MIN_LITERAL_KEY_CHARS = 8

# The literal key and endpoint of every client this process made (make_openai_client): an
# upstream may echo them in any shape, which no pattern can know.
_configured: set[str] = set()
_configured_pattern: re.Pattern[str] | None = None
_configured_guard = threading.Lock()


def register_secrets(base_url: str | None, api_key: str) -> None:
    """Redact ``api_key`` and the endpoint's host and credentials from now on."""
    found = {api_key} if len(api_key) >= MIN_LITERAL_KEY_CHARS else set()
    if base_url:
        parts = urlsplit(base_url)
        host_port = f"{parts.hostname}:{parts.port}" if parts.port else None
        found |= {p for p in (parts.netloc, host_port, parts.hostname, parts.password) if p}
    global _configured_pattern
    with _configured_guard:
        if found <= _configured:
            return
        _configured.update(found)
        # Longest first: the host:port is replaced whole before its host alone.
        literals = sorted(_configured, key=len, reverse=True)
        _configured_pattern = re.compile("|".join(re.escape(value) for value in literals))


def redact(text: str) -> str:
    """``text`` with anything key-shaped, any bearer credential and the configured key and
    endpoint replaced: providers and gateways echo them in their errors."""
    text = BEARER_PATTERN.sub(rf"\1{REDACTED}", SECRET_PATTERN.sub(REDACTED, text))
    pattern = _configured_pattern
    return pattern.sub(REDACTED, text) if pattern is not None else text


def error_detail(text: str) -> str:
    """A provider's words as they may be shown or logged: redacted and bounded."""
    return redact(text)[:MAX_ERROR_DETAIL_CHARS]


# ---------------------------------------------------------------------------------------------
# Error classification

# The provider refused the request itself: its message says what to change, and is about the
# request, not the operator's account. Any other message (an authentication failure, a rate
# limit or quota naming the organisation or project, a server error) goes to the log only.
REFUSED_REQUEST_STATUSES = frozenset({400, 404, 413, 422})
# A Responses API answer with status "failed" names its error by code, not by HTTP status.
RESPONSE_ERROR_KINDS: dict[str, TransportErrorKind] = {
    "server_error": "server_error",
    "rate_limit_exceeded": "rate_limit",
}


def error_kind(error: openai.OpenAIError) -> TransportErrorKind:
    # APITimeoutError subclasses APIConnectionError: check it first.
    if isinstance(error, openai.APITimeoutError):
        return "timeout"
    if isinstance(error, openai.APIConnectionError):
        return "connection"
    if isinstance(error, openai.APIStatusError):
        return status_kind(error.status_code, is_insufficient_quota(error))
    # A 2xx body the SDK could not use, or a mid-stream error event: not fixable by retrying.
    return "client_error"


def status_kind(status: int, insufficient_quota: bool = False) -> TransportErrorKind:
    if status == 429:
        # An exhausted quota answers 429 too, but only a human topping it up helps.
        return "quota" if insufficient_quota else "rate_limit"
    if status == 408:
        return "timeout"
    if status >= 500:
        return "server_error"
    return "client_error"


def response_error_kind(code: str) -> TransportErrorKind:
    return RESPONSE_ERROR_KINDS.get(code, "client_error")


def is_insufficient_quota(error: openai.APIError) -> bool:
    return "insufficient_quota" in error_names(error)


# A prompt over the model's window: OpenAI's error code, llama.cpp's error type. Not a refusal
# of what the request holds: a smaller request passes.
CONTEXT_LENGTH_NAMES = frozenset({"context_length_exceeded", "exceed_context_size_error"})


def is_context_length_error(error: openai.OpenAIError) -> bool:
    return isinstance(error, openai.APIStatusError) and bool(
        CONTEXT_LENGTH_NAMES & error_names(error)
    )


def error_names(error: openai.APIError) -> set[object]:
    """The error's ``code`` and ``type``, as the SDK read them and as its body has them."""
    names = {error.code, getattr(error, "type", None)}
    body = error.body
    # The SDK unwraps {"error": {...}}; other servers may not wrap at all or wrap differently.
    if isinstance(body, Mapping) and isinstance(body.get("error"), Mapping):
        body = body["error"]
    if isinstance(body, Mapping):
        names |= {body.get("code"), body.get("type")}
    return {name for name in names if isinstance(name, str)}


def shows_provider_message(error: openai.OpenAIError) -> bool:
    return (
        isinstance(error, openai.APIStatusError) and error.status_code in REFUSED_REQUEST_STATUSES
    )


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
    message = body_message(error) or getattr(error, "message", None) or str(error)
    return error_detail(message)


def body_message(error: openai.OpenAIError) -> str | None:
    """The ``message`` of the error's JSON body, as the provider wrote it (not redacted)."""
    body = getattr(error, "body", None)
    message = body.get("message") if isinstance(body, Mapping) else None
    return message if isinstance(message, str) and message else None


# ---------------------------------------------------------------------------------------------
# Output limits

# Where a Chat Completions request's output limit goes. OpenAI's own API wants
# ``max_completion_tokens``: it rejects ``max_tokens`` for its reasoning models, and both at once
# for every model. llama.cpp's server and Ollama honour only ``max_tokens`` (the other is
# ignored); vLLM takes either. "both" is for a server that ignores what it does not know.
TokenLimitField = Literal["max_completion_tokens", "max_tokens", "both"]
TOKEN_LIMIT_FIELDS = ("auto", "max_completion_tokens", "max_tokens", "both")
LIMIT_KEYS = ("max_completion_tokens", "max_tokens")
OPENAI_HOSTS = ("api.openai.com",)
OPENAI_HOST_SUFFIXES = (".openai.azure.com",)


def token_limit_field(setting: str, base_url: str | None) -> TokenLimitField:
    """The field for ``setting`` (one of TOKEN_LIMIT_FIELDS): "auto" is
    ``max_completion_tokens`` for OpenAI's own API (no base URL, api.openai.com, Azure OpenAI),
    else ``max_tokens``, the field every local server honours."""
    if setting in ("max_completion_tokens", "max_tokens", "both"):
        return setting  # type: ignore[return-value]
    if setting != "auto":
        raise ValueError(
            f"OPENAI_TOKEN_LIMIT_FIELD must be one of {', '.join(TOKEN_LIMIT_FIELDS)}, "
            f'got "{setting}"'
        )
    host = (urlsplit(base_url).hostname or "") if base_url else "api.openai.com"
    if host in OPENAI_HOSTS or host.endswith(OPENAI_HOST_SUFFIXES):
        return "max_completion_tokens"
    return "max_tokens"


def with_token_limit(options: Mapping[str, Any], field: TokenLimitField) -> dict[str, Any]:
    """``options`` with its output limit (the smaller of ``max_completion_tokens`` and
    ``max_tokens``, whichever are set) in ``field`` alone."""
    limits = [options[key] for key in LIMIT_KEYS if options.get(key) is not None]
    moved = {key: value for key, value in options.items() if key not in LIMIT_KEYS}
    if limits:
        moved.update(token_limit(field, min(limits)))
    return moved


def token_limit(field: TokenLimitField, limit: int) -> dict[str, int]:
    return {key: limit for key in LIMIT_KEYS if field in (key, "both")}


# ---------------------------------------------------------------------------------------------
# Client and requests


NO_API_KEY = "no-key"


def endpoint_configured(api_key: str, base_url: str | None) -> bool:
    """Whether turns and folds call a model endpoint by default rather than the offline
    backends: a key, or a base URL alone (a local server such as Ollama, vLLM or llama.cpp needs
    no key)."""
    return bool(api_key or base_url)


def make_openai_client(
    base_url: str | None, api_key: str, timeout: float, max_retries: int = 0
) -> openai.OpenAI:
    """An OpenAI-compatible client. Our callers own retries (with backoff, only for transient
    errors), so the SDK's own retries are off unless asked for."""
    register_secrets(base_url, api_key)
    return openai.OpenAI(
        base_url=base_url or None,
        # The SDK refuses an empty key; a local server without one ignores the header.
        api_key=api_key or NO_API_KEY,
        timeout=timeout,
        max_retries=max_retries,
    )


def create_chat_completion(
    client: openai.OpenAI, body: Mapping[str, Any], timeout: float
) -> ChatCompletionResponse:
    """``client.chat.completions.create(**body)`` without the SDK's parameter transform.

    The transform walks every message against the request types' TypedDict unions, the bulk of
    a turn's CPU with a long context; the chat params declare no aliases or formats, so it
    would send the dict we already have. ``client.post`` sends a body as it is, with the same
    auth, retries, error types and response parsing."""
    return client.post(
        "/chat/completions",
        body=dict(body),
        cast_to=ChatCompletionResponse,
        options={"timeout": timeout},
    )


def chat_completion_json(client: openai.OpenAI, body: Mapping[str, Any], timeout: float) -> Any:
    """``create_chat_completion``'s request, answered with the decoded JSON instead of the SDK's
    typed models. A JSON content type whose body is not JSON raises ValueError."""
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
