"""The optional ``agent`` object of a turn request (an agent's Router/Think/Act outputs,
docs/agent-state.md) and the agent-state endpoint. Validation is strict: unknown keys, wrong types
and fields that do not belong to the decision are 400s naming the field, so nothing half-understood
is stored."""

import json
from typing import Any

from rest_framework import serializers

from conversations import agent_rules as rules

MAX_ENTITIES = 50
MAX_STEP_RESULTS = 50
MAX_STEP_RESULT_CHARS = 8000
MAX_LIST_ITEMS = 20
MAX_TEXT = 500


class StrictText(serializers.CharField):
    """Refuses numbers, booleans and objects instead of str()-ing them; never blank."""

    def __init__(self, **kwargs: Any) -> None:
        kwargs.setdefault("max_length", MAX_TEXT)
        super().__init__(**kwargs)

    def to_internal_value(self, data: Any) -> str:
        if not isinstance(data, str):
            self.fail("invalid")
        return super().to_internal_value(data)


class StrictChoice(serializers.ChoiceField):
    def to_internal_value(self, data: Any) -> Any:
        if not isinstance(data, str):
            self.fail("invalid_choice", input=data)
        return super().to_internal_value(data)


class NoUnknownKeys(serializers.Serializer):
    """DRF ignores unknown keys; here a misspelt key must not be silently dropped."""

    def to_internal_value(self, data: Any) -> Any:
        if isinstance(data, dict):
            unknown = sorted(set(data) - set(self.fields))
            if unknown:
                raise serializers.ValidationError(
                    {key: ["Unknown field; not part of the agent context."] for key in unknown}
                )
        return super().to_internal_value(data)


class EntitySerializer(NoUnknownKeys):
    id = StrictText(max_length=200)
    type = StrictText(max_length=64)
    label = StrictText(max_length=200)  # type: ignore[assignment]
    state = StrictChoice(choices=rules.ENTITY_STATES)
    # Named like Field attributes: DRF's metaclass takes declared fields off the class.
    source = StrictChoice(choices=rules.ENTITY_SOURCES)  # type: ignore[assignment]


class StepResultField(serializers.Field):
    """A step result: a string or a JSON object, bounded in size."""

    default_error_messages = {
        "invalid": "A step result must be a string or an object.",
        "too_long": f"A step result must be at most {MAX_STEP_RESULT_CHARS} characters as JSON.",
    }

    def to_internal_value(self, data: Any) -> Any:
        if not isinstance(data, str | dict):
            self.fail("invalid")
        if len(json.dumps(data, ensure_ascii=False)) > MAX_STEP_RESULT_CHARS:
            self.fail("too_long")
        return data

    def to_representation(self, value: Any) -> Any:
        return value


# Fields that only make sense with one decision: propose keeps the proposal, clarify the
# questions (docs/agent-state.md, "Pending clarification").
DECISION_FIELDS = {
    "proposal_message": rules.PROPOSE,
    "assumptions": rules.PROPOSE,
    "clarification_questions": rules.CLARIFY,
}


class AgentContextSerializer(NoUnknownKeys):
    decision = StrictChoice(choices=rules.DECISIONS)
    complexity = StrictChoice(choices=rules.COMPLEXITIES, required=False)
    goal = StrictText(required=False)
    entities = serializers.ListField(
        child=EntitySerializer(), required=False, max_length=MAX_ENTITIES
    )
    step_results = serializers.ListField(
        child=StepResultField(), required=False, max_length=MAX_STEP_RESULTS
    )
    proposal_message = StrictText(required=False, max_length=4000)
    assumptions = serializers.ListField(
        child=StrictText(), required=False, max_length=MAX_LIST_ITEMS
    )
    clarification_questions = serializers.ListField(
        child=StrictText(), required=False, max_length=MAX_LIST_ITEMS
    )

    def validate(self, attrs: dict[str, Any]) -> dict[str, Any]:
        decision = attrs["decision"]
        misplaced = {
            field: [f"Only allowed with decision {needed!r}."]
            for field, needed in DECISION_FIELDS.items()
            if field in attrs and decision != needed
        }
        if misplaced:
            raise serializers.ValidationError(misplaced)
        if decision == rules.PROPOSE and not attrs.get("proposal_message"):
            raise serializers.ValidationError({"proposal_message": ["Required for 'propose'."]})
        if decision == rules.CLARIFY and not attrs.get("clarification_questions"):
            raise serializers.ValidationError(
                {"clarification_questions": ["Required (non-empty) for 'clarify'."]}
            )
        ids = [entity["id"] for entity in attrs.get("entities", [])]
        if len(ids) != len(set(ids)):
            raise serializers.ValidationError({"entities": ["Entity ids must be unique."]})
        return attrs


class ResponseSummaryOut(serializers.Serializer):
    seq = serializers.IntegerField()
    decision = serializers.CharField()
    summary = serializers.CharField()
    source = serializers.CharField()  # type: ignore[assignment]


class AgentStateSerializer(serializers.Serializer):
    """``GET /api/v1/chats/{id}/state/``: everything the Summarize node maintains."""

    engagement_summary = serializers.CharField()
    active_entities = serializers.JSONField()
    entity_registry = serializers.JSONField()
    pending_clarification = serializers.JSONField(allow_null=True)
    response_summaries = ResponseSummaryOut(many=True)
    recent_steps = serializers.JSONField()
    step_summaries = serializers.JSONField()
    processed_seq = serializers.IntegerField()
    turns = serializers.IntegerField()
    context_block = serializers.CharField()
    context_tokens = serializers.IntegerField()
    limits = serializers.JSONField()
