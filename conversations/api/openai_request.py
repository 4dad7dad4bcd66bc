"""The /v1 request as chatmem reads it: which parameters it passes to the model (each checked),
which it handles, ignores or refuses, and which conversation the request names."""

from collections.abc import Callable, Mapping
from typing import Any

from rest_framework import exceptions, status
from rest_framework.request import Request

from conversations.variants import ModelVariant, model_variants

CHAT_ID_HEADER = "X-Chatmem-Chat-Id"
MAX_CHAT_ID_CHARS = 200


def _number(value: Any) -> bool:
    return isinstance(value, int | float) and not isinstance(value, bool)


def _integer(value: Any) -> bool:
    return isinstance(value, int) and not isinstance(value, bool)


def _positive_integer(value: Any) -> bool:
    return _integer(value) and value >= 1


def _stop(value: Any) -> bool:
    return isinstance(value, str) or (
        isinstance(value, list) and all(isinstance(s, str) for s in value)
    )


# Passed to the model as the client sent them (tools, and how to sample the reply), each with
# the JSON type it must have. Checked here so that a value of the wrong type is the client's
# 400, not the model's refusal reported as chatmem's 502 (which SDKs retry). Ranges are the
# model's business: OpenAI's temperature stops at 2, other servers' need not.
PASSTHROUGH_CHECKS: dict[str, tuple[Callable[[Any], bool], str]] = {
    "tools": (
        lambda v: isinstance(v, list) and all(isinstance(t, dict) for t in v),
        "an array of objects",
    ),
    "tool_choice": (lambda v: isinstance(v, str | dict), "a string or an object"),
    "parallel_tool_calls": (lambda v: isinstance(v, bool), "a boolean"),
    "temperature": (_number, "a number"),
    "top_p": (_number, "a number"),
    "max_tokens": (_positive_integer, "a positive integer"),
    "max_completion_tokens": (_positive_integer, "a positive integer"),
    "stop": (_stop, "a string or an array of strings"),
    "seed": (_integer, "an integer"),
    "presence_penalty": (_number, "a number"),
    "frequency_penalty": (_number, "a number"),
    "response_format": (lambda v: isinstance(v, dict), "an object"),
    "logit_bias": (lambda v: isinstance(v, dict), "an object"),
    "reasoning_effort": (lambda v: isinstance(v, str), "a string"),
    "verbosity": (lambda v: isinstance(v, str), "a string"),
}
# Parameters chatmem cannot honour, with the one value it accepts (null is always the default):
# refused rather than silently answering differently (logprobs: chatmem's reply carries none).
UNSUPPORTED: dict[str, object] = {
    "n": 1,
    "functions": None,
    "function_call": None,
    "logprobs": False,
    "top_logprobs": None,
    "modalities": ["text"],
    "audio": None,
    "prediction": None,
    "web_search_options": None,
}
# Read by chatmem itself (naming the conversation, streaming, its memory controls), or about
# the provider's records and billing, not the answer: accepted, not forwarded.
HANDLED = {"model", "messages", "stream", "stream_options", "metadata", "user", "chatmem"}
IGNORED = {
    "store",
    "service_tier",
    "prompt_cache_key",
    "prompt_cache_retention",
    "prompt_cache_options",
    "safety_identifier",
}
KNOWN_PARAMETERS = HANDLED | IGNORED | set(PASSTHROUGH_CHECKS) | set(UNSUPPORTED)


class OpenAIError(exceptions.APIException):
    def __init__(
        self,
        message: str,
        status_code: int = status.HTTP_400_BAD_REQUEST,
        param: str | None = None,
        code: str | None = None,
    ) -> None:
        super().__init__(message)
        self.status_code = status_code
        self.param = param
        self.error_code = code


# --- request ----------------------------------------------------------------------------------


def variant_for(model: Any) -> ModelVariant:
    """A configured variant, by its name or by the model it runs."""
    if not isinstance(model, str) or not model:
        raise OpenAIError("you must provide a model parameter", param="model", code="missing")
    variants = model_variants()
    if model in variants:
        return variants[model]
    for variant in variants.values():
        if variant.model == model:
            return variant
    raise OpenAIError(
        f"The model `{model}` does not exist; GET /v1/models lists the configured variants.",
        status.HTTP_404_NOT_FOUND,
        param="model",
        code="model_not_found",
    )


def request_messages(body: Mapping[str, Any]) -> list[dict[str, Any]]:
    messages = body.get("messages")
    if not isinstance(messages, list) or not messages:
        raise OpenAIError("messages must be a non-empty array.", param="messages")
    for index, message in enumerate(messages):
        if not isinstance(message, dict) or not isinstance(message.get("role"), str):
            raise OpenAIError(f"messages[{index}] must be an object with a role.", param="messages")
    return messages


def passthrough_options(body: Mapping[str, Any]) -> dict[str, Any]:
    """The parameters passed to the model, each checked (null: the model's default)."""
    options = {key: body[key] for key in PASSTHROUGH_CHECKS if key in body}
    for key, value in options.items():
        valid, expected = PASSTHROUGH_CHECKS[key]
        if value is not None and not valid(value):
            raise OpenAIError(f"{key} must be {expected}.", param=key)
    return options


def check_unsupported(body: Mapping[str, Any]) -> None:
    unknown = sorted(key for key in body if key not in KNOWN_PARAMETERS)
    if unknown:
        # As OpenAI answers it: a parameter chatmem would drop could change the answer.
        raise OpenAIError(
            f"Unrecognized request argument supplied: {', '.join(unknown)}", param=unknown[0]
        )
    for key, allowed in UNSUPPORTED.items():
        # null is the default, as OpenAI reads it ("n": null is one choice).
        if body.get(key) is not None and body[key] != allowed:
            raise OpenAIError(f"{key} is not supported by chatmem.", param=key)


def chat_name(request: Request, body: Mapping[str, Any]) -> str:
    """The conversation: the X-Chatmem-Chat-Id header, else metadata.chatmem_chat_id, else the
    request's ``user``."""
    metadata = body.get("metadata") if isinstance(body.get("metadata"), dict) else {}
    named = (metadata or {}).get("chatmem_chat_id")
    if named is not None and not isinstance(named, str):
        # OpenAI's metadata values are strings; a number here named no conversation at all.
        raise OpenAIError(
            "metadata.chatmem_chat_id must be a string.", param="metadata.chatmem_chat_id"
        )
    name = (
        request.headers.get(CHAT_ID_HEADER)
        or (metadata or {}).get("chatmem_chat_id")
        or body.get("user")
    )
    if not isinstance(name, str) or not name.strip():
        raise OpenAIError(
            f"Name the conversation: send the {CHAT_ID_HEADER} header, or "
            '"metadata": {"chatmem_chat_id": ...}, or "user".',
            param="user",
            code="missing_chat_id",
        )
    if len(name) > MAX_CHAT_ID_CHARS:
        raise OpenAIError(
            f"The conversation name is longer than {MAX_CHAT_ID_CHARS} characters.", param="user"
        )
    return name.strip()


def include_usage(body: Mapping[str, Any]) -> bool:
    options = body.get("stream_options")
    return isinstance(options, dict) and bool(options.get("include_usage"))
