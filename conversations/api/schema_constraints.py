"""The schema's postprocessing hook: the input rules the serializers check, written into the
request components, so a request the schema allows is one the API accepts (schemathesis checks
both ways)."""

from typing import Any

from django.conf import settings

from conversations.api.schema import NO_NUL
from conversations.variants import model_variants
from memory_worker.engine.presets import knob_json_schema

NON_BLANK = "^[^\\u0000]*[^\\s\\u0000][^\\u0000]*$"  # a message must say something
# Unknown keys are refused.
STRICT_COMPONENTS = (
    "AgentContextRequest",
    "EntityRequest",
    "ChatRequest",
    "PatchedChatRequest",
    "PinRequestRequest",
)


def _no_nul_strings(schema: Any) -> None:
    if isinstance(schema, dict):
        if schema.get("type") == "string" and not {"enum", "pattern", "format"} & set(schema):
            schema["pattern"] = NO_NUL
        for value in schema.values():
            _no_nul_strings(value)
    elif isinstance(schema, list):
        for value in schema:
            _no_nul_strings(value)


def request_constraints(result: dict[str, Any], **_: Any) -> dict[str, Any]:
    """Postprocessing hook: write into the schema the input rules the serializers check, so a
    request the schema allows is one the API accepts (schemathesis checks both ways). The
    configured model variants and the message size limit are read when the schema is built."""
    schemas = result["components"]["schemas"]
    for name, component in schemas.items():
        if name.endswith("Request"):
            _no_nul_strings(component)
    for name in STRICT_COMPONENTS:
        if name in schemas:
            schemas[name]["additionalProperties"] = False
    if "PinRequestRequest" in schemas:
        schemas["PinRequestRequest"]["properties"]["text"]["pattern"] = NON_BLANK
    variant = {"type": "string", "enum": ["", *sorted(model_variants())]}
    turn = schemas["TurnRequestRequest"]["properties"]
    turn["content"].update(pattern=NON_BLANK, maxLength=settings.CHATMEM_MAX_MESSAGE_CHARS)
    turn["model_variant"] = variant
    for name in ("ChatRequest", "PatchedChatRequest"):
        chat = schemas[name]["properties"]
        chat["model_variant"] = variant
        chat["policy_overrides"] = {
            "type": "object",
            "description": "Any of the preset's knobs (GET /api/v1/policies/). Rules between "
            "knobs, such as max_summary_tokens < max_tokens, are checked too (400).",
            "properties": knob_json_schema(),
            "additionalProperties": False,
        }
    return result
