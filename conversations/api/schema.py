"""OpenAPI descriptions of the API (drf-spectacular): what each endpoint takes and answers,
including the error bodies and the server-sent events of a streamed turn. Views carry these via
``extend_schema_view``; the schema is served at /api/v1/schema/ and browsable at /api/v1/docs/.
"""

from typing import Any

from drf_spectacular.extensions import OpenApiSerializerFieldExtension
from drf_spectacular.openapi import AutoSchema
from drf_spectacular.utils import (
    OpenApiExample,
    OpenApiParameter,
    OpenApiResponse,
    extend_schema,
    extend_schema_view,
)
from rest_framework import serializers
from rest_framework.permissions import IsAuthenticated

from conversations.api.agent_serializers import AgentStateSerializer
from conversations.api.openai_schema import OPENAI_UNAUTHENTICATED
from conversations.api.pin_schema import pin_schemas
from conversations.api.serializers import (
    BriefEditSerializer,
    BriefSerializer,
    ChatSerializer,
    ConsolidationSerializer,
    DailyNoteSerializer,
    MessageSerializer,
    TurnRequestSerializer,
    TurnResponseSerializer,
)
from conversations.services.chat_list import ORDERING_FIELDS
from memory_worker.engine.presets import PRESETS

# DRF's CharField refuses NUL characters (and the URL check, in a query string).
NO_NUL = "^[^\\u0000]*$"
# Empty: the default order, as DRF's OrderingFilter has it.
ORDERING_PATTERN = "^(-?({fields})(,-?({fields}))*)?$".format(fields="|".join(ORDERING_FIELDS))

# --- Bodies that have no serializer of their own ----------------------------------------------


class ErrorSerializer(serializers.Serializer):
    detail = serializers.CharField(help_text="What went wrong, for people.")
    code = serializers.CharField(help_text="Stable machine-readable code.", required=False)


VALIDATION_ERROR = OpenApiResponse(
    # Nested serializers (a turn's agent object) nest their messages the same way, and a body
    # that is not JSON answers {"detail", "code"}: any JSON value per key.
    response={"type": "object", "additionalProperties": {}},
    description='Invalid input: field name -> list of messages, e.g. {"content": ["..."]} '
    '(nested for nested objects), or {"detail", "code"} for a body that is not valid JSON.',
)
UNAUTHENTICATED = OpenApiResponse(
    ErrorSerializer, description="No valid token (the response has WWW-Authenticate: Token)."
)
NOT_FOUND = OpenApiResponse(ErrorSerializer, description="No such chat, or not yours.")
PAGE_NOT_FOUND = OpenApiResponse(ErrorSerializer, description="No such page.")
# gunicorn refuses a request line (the path and the query string) over its limit_request_line
# before any view runs, on any operation, and in this shape even under /v1/
# (gunicorn.conf.write_json_error).
URI_TOO_LONG = OpenApiResponse(
    ErrorSerializer,
    description="`uri_too_long`: the request line (path and query string) is over the server's "
    "limit (gunicorn's limit_request_line, 4094 bytes by default). The same shape under /v1/.",
)
API_PREFIXES = ("/api/v1/", "/v1/")


def only_rest_api(endpoints: list[tuple[Any, ...]]) -> list[tuple[Any, ...]]:
    """Preprocessing hook: this schema documents chatmem's REST API under /api/v1/ and the
    OpenAI-compatible API under /v1/ (in OpenAI's shapes, conversations/api/openai_schema.py);
    not the admin, the browsable API's login or the metrics."""
    return [endpoint for endpoint in endpoints if str(endpoint[0]).startswith(API_PREFIXES)]


class ChatmemAutoSchema(AutoSchema):
    """Adds the errors every endpoint shares, so no endpoint (including ones added later without
    an extend_schema) is published without them: 401 where a token is required, 404 where the
    path names a chat (another user's chat is a 404 too), and gunicorn's 414 everywhere."""

    def _get_response_bodies(self, direction: Any = "response") -> dict[str, Any]:
        responses: dict[str, Any] = super()._get_response_bodies(direction)
        shared = {"414": URI_TOO_LONG}
        if any(isinstance(p, IsAuthenticated) for p in self.view.get_permissions()):
            openai = self.path.startswith("/v1/")
            shared["401"] = OPENAI_UNAUTHENTICATED if openai else UNAUTHENTICATED
        if "{id}" in self.path:
            shared["404"] = NOT_FOUND
        elif self.method == "GET" and self._get_paginator() is not None:
            shared["404"] = PAGE_NOT_FOUND
        if self._get_paginator() is not None and self.method == "GET":
            shared["400"] = VALIDATION_ERROR  # a page or page_size that is not a positive int
        for code, response in shared.items():
            if code not in responses:
                responses[code] = self._get_response_for_code(response, code, None, direction)
        return responses


class StepResultFieldSchema(OpenApiSerializerFieldExtension):
    """A turn's agent ``step_results`` item is a string or a JSON object; spectacular cannot read
    that off the custom field (it would warn and say "string")."""

    target_class = "conversations.api.agent_serializers.StepResultField"

    def map_serializer_field(self, auto_schema: AutoSchema, direction: Any) -> dict[str, Any]:
        return {
            "oneOf": [{"type": "string"}, {"type": "object", "additionalProperties": {}}],
            "description": "A step result: a string or a JSON object.",
        }


class ContextMessageSerializer(serializers.Serializer):
    role = serializers.ChoiceField(choices=["system", "user", "assistant", "tool"])
    content = serializers.CharField(allow_blank=True)
    # Tool traffic, in the shape the model produced it (conversations.services.context).
    tool_calls = serializers.ListField(
        child=serializers.DictField(), required=False, help_text="An assistant's tool calls."
    )
    tool_call_id = serializers.CharField(
        required=False, help_text="A tool result: the call it answers."
    )
    name = serializers.CharField(required=False)


class ContextSerializer(serializers.Serializer):
    messages = ContextMessageSerializer(many=True)


class ConsolidateSerializer(serializers.Serializer):
    queued = serializers.BooleanField()
    chat_id = serializers.IntegerField()
    status = serializers.CharField(
        required=False, help_text="queued, already_queued, nothing_to_fold or not_queued"
    )
    detail = serializers.CharField(required=False)


class NotQueuedSerializer(ConsolidateSerializer):
    detail = serializers.CharField()
    code = serializers.CharField()


class PolicySerializer(serializers.Serializer):
    name = serializers.CharField()
    description = serializers.CharField(help_text="Which use the preset is for, in a sentence.")
    parameters = serializers.DictField(help_text="The preset's knobs and their values.")


class PolicyListSerializer(serializers.Serializer):
    results = PolicySerializer(many=True)


class SeqRangeSerializer(serializers.Serializer):
    from_seq = serializers.IntegerField()
    to_seq = serializers.IntegerField()


class RunningSummarySerializer(serializers.Serializer):
    summary = serializers.CharField()
    summarized_message_ids = SeqRangeSerializer(allow_null=True)
    last_summarized_message_id = serializers.IntegerField(allow_null=True)
    last_summarized_seq = serializers.IntegerField(allow_null=True)


class BriefResponseSerializer(BriefSerializer):
    running_summary = RunningSummarySerializer(read_only=True)

    class Meta(BriefSerializer.Meta):
        fields = [*BriefSerializer.Meta.fields, "running_summary"]
        read_only_fields = fields


# Request examples are what Swagger UI's "Try it out" sends unchanged: each must succeed.
CREATE_EXAMPLES = [
    OpenApiExample(
        "A chat with the default policy",
        value={"title": "Trip planning", "system_prompt": "You are a helpful assistant."},
        request_only=True,
    ),
    OpenApiExample(
        "A chat with a preset and an override",
        value={
            "title": "Support",
            "policy": "contract",
            "policy_overrides": {"safety_user_turns": 8},
        },
        request_only=True,
    ),
]
PATCH_EXAMPLES = [
    OpenApiExample("Rename", value={"title": "Trip planning (Lisbon)"}, request_only=True),
    OpenApiExample(
        "Another policy, from the next fold",
        value={"policy": "sliding-window", "policy_overrides": {}},
        request_only=True,
    ),
]
# `stream` stated: Swagger UI sends `Accept: text/event-stream` (its first success media type),
# which would stream a turn whose body leaves `stream` out.
TURN_EXAMPLES = [
    OpenApiExample(
        "A message, the stored turn as JSON",
        value={"content": "Hello", "stream": False},
        request_only=True,
    ),
    OpenApiExample(
        "A message, the reply streamed (server-sent events)",
        value={"content": "Hello", "stream": True},
        request_only=True,
    ),
]

# --- Turns ------------------------------------------------------------------------------------

TURN_STREAM_DESCRIPTION = """Server-sent events, when the body has `"stream": true` (or no
`stream` and `Accept: text/event-stream`):

- `event: accepted`: `{"chat_id", "model_variant", "user_message": {"seq": null, "role",
  "content", "token_count", "pending": true}}`, once, first;
- `event: delta`: `{"content": "..."}` for each piece of the reply as the model produces it;
- then exactly one of `event: done`, with the JSON turn's 201 body (`user_message`,
  `assistant_message`, both stored), or `event: error`, with `{"code", "detail", "status",
  "retry"}` (the JSON turn's error: 502/503/504 from the model or the memory bound, 409
  `turn_in_progress`, 404 `chat_deleted`, 500 `server_error`; `retry` is false when sending the
  same turn again cannot help, as the JSON turn's `x-should-retry: false`; nothing was stored).

Lines starting with `:` are keep-alive comments. A client that disconnects does not cancel the
turn: it is completed and stored. See docs/streaming.md."""

TURN_STREAM_EXAMPLE = (
    "event: accepted\n"
    'data: {"chat_id":1,"model_variant":"default","user_message":{"seq":null,"role":"user",'
    '"content":"Hello","token_count":1,"pending":true}}\n\n'
    "event: delta\n"
    'data: {"content":"Hi "}\n\n'
    "event: delta\n"
    'data: {"content":"there!"}\n\n'
    "event: done\n"
    'data: {"user_message":{"seq":1,...},"assistant_message":{"seq":2,...}}\n\n'
)

# One server-sent event as a client parses it (the schema of a text/event-stream response).
SSE_EVENT = {
    "type": "object",
    "properties": {
        "event": {"type": "string", "enum": ["accepted", "delta", "done", "error"]},
        "data": {"type": "string", "description": "A JSON document."},
    },
    "required": ["event", "data"],
}

turn_schema = extend_schema(
    summary="Send a user message; get the stored reply (JSON) or stream it (SSE)",
    request=TurnRequestSerializer,
    examples=TURN_EXAMPLES,
    responses={
        (201, "application/json"): OpenApiResponse(
            TurnResponseSerializer, description="The turn, stored: the user message and reply."
        ),
        (200, "text/event-stream"): OpenApiResponse(
            SSE_EVENT,
            description=TURN_STREAM_DESCRIPTION,
            examples=[OpenApiExample("A streamed turn", value=TURN_STREAM_EXAMPLE)],
        ),
        400: VALIDATION_ERROR,
        409: OpenApiResponse(
            ErrorSerializer,
            description="`turn_in_progress`: another turn of this chat is running; retry later.",
        ),
        502: OpenApiResponse(
            ErrorSerializer, description="`model_error`: the model failed; nothing was stored."
        ),
        503: OpenApiResponse(
            ErrorSerializer,
            description="`context_over_bound`: the context cannot be brought within its bound "
            "right now; nothing was stored.",
        ),
        504: OpenApiResponse(
            ErrorSerializer,
            description="`model_timeout`: the model did not answer in time; nothing was stored.",
        ),
        413: OpenApiResponse(
            ErrorSerializer,
            description="`request_too_large`: the body is over `CHATMEM_MAX_BODY_BYTES`, refused "
            "before it is read (plain JSON, also for a streamed turn). Nothing was stored.",
        ),
        429: OpenApiResponse(
            ErrorSerializer,
            description="`throttled`: the user's turn limit (`TURN_RATE_LIMIT`) is reached; the "
            "`Retry-After` header says when to retry. Nothing was stored.",
        ),
    },
)

# --- Everything else --------------------------------------------------------------------------

AFTER_SEQ = OpenApiParameter(
    "after_seq",
    {"type": "integer", "minimum": 0},
    OpenApiParameter.QUERY,
    description="Only messages with a larger seq (resume after the last one you have).",
)

LIST_PARAMETERS = [
    OpenApiParameter(
        "search",
        {"type": "string", "pattern": NO_NUL},
        OpenApiParameter.QUERY,
        description="Only chats whose title contains every word of it (case-insensitive).",
    ),
    OpenApiParameter(
        "policy",
        str,
        OpenApiParameter.QUERY,
        enum=sorted(PRESETS),
        description="Only chats with this memory policy.",
    ),
    OpenApiParameter(
        "degraded",
        {"type": "string", "enum": ["true", "false"]},
        OpenApiParameter.QUERY,
        description="Only chats whose memory is (true) or is not (false) degraded: folds have "
        "kept failing (the brief's `degraded`).",
    ),
    OpenApiParameter(
        "ordering",
        {"type": "string", "pattern": ORDERING_PATTERN},
        OpenApiParameter.QUERY,
        description=f"Comma-separated fields among {', '.join(ORDERING_FIELDS)}, each "
        "optionally prefixed with - (descending). Default -created_at (newest first). Any "
        "other field is a 400.",
        examples=[OpenApiExample("Recently updated first", value="-updated_at")],
    ),
]

IF_MATCH = OpenApiParameter(
    "If-Match",
    {"type": "string", "pattern": '^"[0-9]+"$'},
    OpenApiParameter.HEADER,
    required=True,
    description='The brief\'s ETag, its version in quotes (e.g. "3"). Without it 428; another '
    'version than the brief\'s now 412, and so is a weak tag (W/"3": If-Match compares '
    'strongly); not one quoted version ("*" included) 400. The example is a new chat\'s.',
    examples=[OpenApiExample("A new chat's version", value='"0"')],
)
BRIEF_ETAG = OpenApiParameter(
    "ETag",
    str,
    OpenApiParameter.HEADER,
    response=[200],
    description='The brief\'s version in quotes (e.g. "3"): send it back in If-Match to edit.',
)

chat_schema = extend_schema_view(
    create=extend_schema(
        summary="Create a chat",
        examples=CREATE_EXAMPLES,
        responses={201: ChatSerializer, 400: VALIDATION_ERROR},
    ),
    list=extend_schema(
        summary="Your chats, searched, filtered and ordered",
        parameters=LIST_PARAMETERS,
        responses={200: ChatSerializer, 400: VALIDATION_ERROR},
    ),
    partial_update=extend_schema(
        summary="Change a chat: title, system prompt, policy, overrides, variant, folds paused",
        description="Only the fields sent change, with the checks creation makes (400, nothing "
        "stored). A new policy or overrides apply from the chat's next fold decision; the "
        "memory (summary, watermark, version) is kept. The answer echoes the effective policy. "
        "PUT is not supported (405): send PATCH.",
        examples=PATCH_EXAMPLES,
        responses={200: ChatSerializer, 400: VALIDATION_ERROR},
    ),
    retrieve=extend_schema(summary="A chat", responses={200: ChatSerializer}),
    destroy=extend_schema(
        summary="Delete a chat with its messages and memory",
        responses={204: OpenApiResponse(description="Deleted.")},
    ),
    turns=turn_schema,
    messages=extend_schema(
        summary="The chat's messages, ordered by seq",
        parameters=[AFTER_SEQ],
        responses={200: MessageSerializer(many=True), 400: VALIDATION_ERROR},
    ),
    brief=[
        extend_schema(
            methods=["GET"],
            summary="Memory state: summary, watermark, unfolded count, failures",
            parameters=[BRIEF_ETAG],
            responses={200: BriefResponseSerializer},
        ),
        extend_schema(
            methods=["PATCH"],
            summary="Edit the summary, on the version you read (If-Match)",
            description="Replaces the summary if the brief is still at the version If-Match "
            "names (its ETag), through the same fenced UPDATE a fold commits with: a fold that "
            "read that version is superseded and runs again from the edited text. The ledger "
            "records the edit (trigger `edit`, `edited_by`, tokens before and after); the lines "
            "written here are listed in `user_lines` and kept by later folds unless a later "
            "message revokes them.",
            request=BriefEditSerializer,
            parameters=[IF_MATCH, BRIEF_ETAG],
            examples=[
                OpenApiExample(
                    "A corrected summary",
                    value={"summary": "## Facts / Constraints\n- Call me Sam, never Samuel"},
                    request_only=True,
                )
            ],
            responses={
                200: BriefResponseSerializer,
                400: VALIDATION_ERROR,
                412: OpenApiResponse(
                    ErrorSerializer,
                    description="The version moved (`version_moved`): a fold or another edit "
                    "committed since. GET the brief again and edit that summary.",
                ),
                428: OpenApiResponse(
                    ErrorSerializer, description="No If-Match (`if_match_required`)."
                ),
            },
        ),
    ],
    context=extend_schema(
        summary="Exactly what the model would receive next, before the new user message",
        responses={200: ContextSerializer},
    ),
    state=extend_schema(
        summary="Agent state: theme, entities, pending clarification, summaries",
        responses={200: AgentStateSerializer},
    ),
    consolidate=extend_schema(
        summary="Queue a fold of this chat's memory now",
        request=None,
        responses={
            200: OpenApiResponse(
                ConsolidateSerializer,
                description="Nothing to fold (status nothing_to_fold, recorded in the ledger).",
            ),
            202: OpenApiResponse(
                ConsolidateSerializer,
                description="Queued, or a manual fold of this chat is already queued.",
            ),
            429: OpenApiResponse(
                ErrorSerializer,
                description="Too many manual folds (MEMORY_MANUAL_FOLD_RATE_LIMIT).",
            ),
            503: OpenApiResponse(
                NotQueuedSerializer, description="The broker is unavailable; not queued."
            ),
        },
    ),
    **pin_schemas(NOT_FOUND),
    notes=extend_schema(
        summary="Daily notes: durable facts from folded messages, one per day",
        responses={200: DailyNoteSerializer(many=True)},
    ),
    consolidations=extend_schema(
        summary="The ledger of fold attempts, newest first",
        responses={200: ConsolidationSerializer(many=True)},
    ),
)

policy_schema = extend_schema_view(
    get=extend_schema(
        summary="Memory policy presets and their parameters",
        responses={200: PolicyListSerializer},
    )
)

__all__ = ["chat_schema", "policy_schema"]
