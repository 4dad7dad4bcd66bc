"""OpenAPI descriptions of a chat's pins (conversations.api.schema gathers them)."""

from typing import Any

from drf_spectacular.utils import OpenApiExample, OpenApiParameter, OpenApiResponse, extend_schema

from conversations.api.pin_serializers import PinRequestSerializer, PinSerializer

# A field's messages, or the refusal of a pin that does not fit (its detail, code and room).
PIN_REFUSED = {
    "type": "object",
    "properties": {
        "detail": {"type": "string"},
        "code": {"type": "string"},
        "room_left": {"type": "integer", "description": "Tokens still free for pins."},
    },
    "additionalProperties": {},
}


# Swagger UI's "Try it out" sends the first example unchanged, on any chat: a pinned text, as a
# new chat has no message to pin.
PIN_EXAMPLES = [
    OpenApiExample(
        "Pin a text",
        value={"text": "Always answer in metric units; the budget is 1,200 EUR."},
        request_only=True,
    ),
]

PINS_DESCRIPTION = """Pinned items are in every context the model receives, verbatim, in one
system message after the summary and before the recent messages; folds never take them away (a
pinned message may fold into the summary as usual: its pin keeps it in the context, once). They
count in the chat's bound, so a pin that does not fit is refused (400 `no_room_for_pin`, with
`room_left` in tokens) and nothing is stored. Send exactly one of `text` and `seq` (a stored
message of this chat, shown as `role: content`); other fields are a 400."""


def pin_schemas(not_found: OpenApiResponse) -> dict[str, Any]:
    """The pins' entries of the chat view set's extend_schema_view."""
    return {
        "pins": [
            extend_schema(
                methods=["GET"],
                summary="The chat's pins, oldest first",
                description=PINS_DESCRIPTION,
                responses={200: PinSerializer(many=True)},
            ),
            extend_schema(
                methods=["POST"],
                summary="Pin a text or a stored message: kept verbatim in every context",
                description=PINS_DESCRIPTION,
                request=PinRequestSerializer,
                examples=PIN_EXAMPLES,
                responses={
                    201: PinSerializer,
                    400: OpenApiResponse(
                        PIN_REFUSED,
                        description="Invalid input (field -> messages), or `no_room_for_pin`: "
                        "the pin does not fit the room left for pins (`room_left`). Nothing "
                        "was stored.",
                    ),
                },
            ),
        ],
        "unpin": extend_schema(
            summary="Unpin: the item leaves the context (a pinned message stays folded)",
            parameters=[OpenApiParameter("pin_id", int, OpenApiParameter.PATH)],
            responses={
                204: OpenApiResponse(description="Unpinned."),
                404: OpenApiResponse(
                    not_found.response, description="No such chat or pin, or not yours."
                ),
            },
        ),
    }
