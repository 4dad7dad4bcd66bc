"""OpenAPI descriptions of the OpenAI-compatible API under /v1/ (docs/openai-compatible.md):
OpenAI's request and response shapes, its error shape, and bearer authentication. Applied in
openai_urls.py, so the views' module (openai_compat.py) stays about behaviour."""

from typing import Any

from drf_spectacular.extensions import OpenApiAuthenticationExtension
from drf_spectacular.utils import OpenApiExample, OpenApiResponse, extend_schema

OPENAI_ERROR_SCHEMA = {
    "type": "object",
    "properties": {
        "error": {
            "type": "object",
            "properties": {
                "message": {"type": "string"},
                "type": {"type": "string"},
                "param": {"type": "string", "nullable": True},
                "code": {"type": "string", "nullable": True},
            },
            "required": ["message", "type"],
        }
    },
    "required": ["error"],
}


def openai_error(description: str) -> OpenApiResponse:
    return OpenApiResponse(OPENAI_ERROR_SCHEMA, description=description)


OPENAI_UNAUTHENTICATED = openai_error("No valid token: `Authorization: Bearer <chatmem token>`.")


class BearerTokenScheme(OpenApiAuthenticationExtension):
    """chatmem tokens the way the OpenAI SDKs send an API key: /v1/, and REST beside Token."""

    target_class = "conversations.authentication.BearerTokenAuthentication"
    name = "bearerAuth"
    priority = 1  # before spectacular's own scheme for DRF's TokenAuthentication subclasses

    def get_security_definition(self, auto_schema: Any) -> dict[str, Any]:
        return {
            "type": "http",
            "scheme": "bearer",
            "description": "A chatmem API token (`python manage.py issue_token NAME`).",
        }


# A plain schema: a serializer's field named `data` would shadow Serializer.data.
MODEL_LIST = {
    "type": "object",
    "properties": {
        "object": {"type": "string", "enum": ["list"]},
        "data": {
            "type": "array",
            "items": {
                "type": "object",
                "properties": {
                    "id": {"type": "string", "description": "A model variant (MODEL_VARIANTS)."},
                    "object": {"type": "string", "enum": ["model"]},
                    "created": {"type": "integer"},
                    "owned_by": {"type": "string"},
                },
                "required": ["id", "object", "created", "owned_by"],
            },
        },
    },
    "required": ["object", "data"],
}


# chatmem's extension (conversations.api.openai_controls); the SDKs send it with extra_body.
CHATMEM_CONTROLS = {
    "type": "object",
    "description": "Memory controls (docs/openai-compatible.md, Memory controls). Unknown keys "
    "are a 400.",
    "properties": {
        "pin": {
            "type": "string",
            "nullable": True,
            "minLength": 1,
            "description": "Pinned: verbatim in every context; 400 `pin_refused` with the room "
            "left if it does not fit.",
        },
        "fold": {
            "type": "string",
            "nullable": True,
            "enum": ["now", "pause", "resume", None],
            "description": "now: queue a manual fold (503 `not_queued` without a broker); "
            "pause / resume: this chat's background folds (a turn over its bound still folds).",
        },
        "policy": {
            "type": "string",
            "nullable": True,
            "description": "A new conversation's preset (null: the default).",
        },
        "policy_overrides": {
            "type": "object",
            "nullable": True,
            "additionalProperties": {},
            "description": "A new conversation's knobs; sent again later they must match.",
        },
    },
    "additionalProperties": False,
}
# The memory's state, in the completion and the stream's chunk with the finish reason.
CHATMEM_STATE = {
    "type": "object",
    "properties": {
        "chat_id": {"type": "integer"},
        "seqs": {"type": "array", "items": {"type": "integer"}},
        "summary_version": {"type": "integer", "description": "The brief's version (ETag)."},
        "unfolded": {"type": "integer"},
        "degraded": {"type": "boolean"},
        "folds_paused": {"type": "boolean"},
        "fold_queued": {"type": "boolean", "description": 'After "fold": "now".'},
        "fold": {
            "type": "string",
            "enum": ["queued", "already_queued", "nothing_to_fold"],
            "description": 'After "fold": "now": as the REST consolidate endpoint answers.',
        },
    },
    "required": ["chat_id", "seqs"],
}


# Loose on purpose: the view checks the rest (which messages are new, each option's type) and
# answers a 400 in OpenAI's shape; docs/openai-compatible.md states the rules.
COMPLETION_REQUEST = {
    "type": "object",
    "properties": {
        "model": {"type": "string", "description": "A model variant (GET /v1/models)."},
        "messages": {
            "type": "array",
            "minItems": 1,
            "items": {"type": "object", "additionalProperties": {}},
            "description": "The conversation as the client has it; chatmem stores only the new "
            "messages and sends the model its bounded context instead.",
        },
        "stream": {"type": "boolean", "nullable": True},
        "user": {
            "type": "string",
            "description": "Names the conversation (or the X-Chatmem-Chat-Id header).",
        },
        # null reads as absent, as for every optional key here.
        "chatmem": {**CHATMEM_CONTROLS, "nullable": True},
    },
    "required": ["model", "messages"],
    "additionalProperties": {},
}

COMPLETION = {
    "type": "object",
    "properties": {
        "id": {"type": "string"},
        "object": {"type": "string", "enum": ["chat.completion"]},
        "created": {"type": "integer"},
        "model": {"type": "string"},
        "choices": {"type": "array", "items": {"type": "object", "additionalProperties": {}}},
        "usage": {"type": "object", "additionalProperties": {}},
        "chatmem": CHATMEM_STATE,
    },
    "required": ["id", "object", "choices"],
    "additionalProperties": {},
}

# One server-sent event as a client parses it.
SSE_CHUNK = {
    "type": "object",
    "properties": {"data": {"type": "string", "description": "A JSON chunk, or [DONE]."}},
    "required": ["data"],
}

TAGS = ["v1 (OpenAI-compatible)"]

completions_schema = extend_schema(
    tags=TAGS,
    summary="OpenAI Chat Completions, with chatmem's memory",
    description="See docs/openai-compatible.md. Authenticate with `Authorization: Bearer "
    "<chatmem token>` (Swagger UI: Authorize, bearerAuth).",
    request={"application/json": COMPLETION_REQUEST},
    examples=[
        OpenApiExample(
            "A message",
            value={
                "model": "default",
                "user": "swagger-try-it-out",
                "messages": [{"role": "user", "content": "Hello"}],
            },
            request_only=True,
        ),
        OpenApiExample(
            "A message that pauses the conversation's background folds",
            value={
                "model": "default",
                "user": "swagger-try-it-out",
                "messages": [{"role": "user", "content": "Hello"}],
                "chatmem": {"fold": "pause"},
            },
            request_only=True,
        ),
    ],
    responses={
        (200, "application/json"): OpenApiResponse(COMPLETION, description="The completion."),
        (200, "text/event-stream"): OpenApiResponse(
            SSE_CHUNK,
            description='`"stream": true`: `data:` lines of chat.completion.chunk objects, then '
            "`data: [DONE]`.",
        ),
        400: openai_error("Invalid request (`param` names what)."),
        404: openai_error("`model_not_found`: no such model variant (GET /v1/models)."),
        409: openai_error("Another turn of this conversation is in progress."),
        413: openai_error("The body is over `CHATMEM_MAX_BODY_BYTES`; nothing was stored."),
        429: openai_error("The user's turn limit (`TURN_RATE_LIMIT`); see `Retry-After`."),
        502: openai_error("The model failed; nothing was stored."),
        503: openai_error(
            "The context cannot be brought within its bound right now, or a "
            '`"fold": "now"` could not be queued (`not_queued`).'
        ),
        504: openai_error("The model did not answer in time; nothing was stored."),
    },
)

models_schema = extend_schema(
    tags=TAGS,
    summary="The model variants (OpenAI's model list)",
    responses={200: OpenApiResponse(MODEL_LIST, description="The configured variants.")},
)
