from typing import Any

from django.conf import settings
from drf_spectacular.types import OpenApiTypes
from drf_spectacular.utils import extend_schema_field
from rest_framework import serializers

from conversations.api.agent_serializers import AgentContextSerializer
from conversations.models import Brief, Chat, Consolidation, DailyNote, Message, Role
from conversations.services import chats as chat_service
from memory_worker.engine.presets import PRESETS, PolicyError, policy_parameters
from memory_worker.memory import policy_for_chat, policy_for_new_settings, variant_context_tokens


class StrictCharField(serializers.CharField):
    """A CharField that refuses numbers, booleans and objects instead of str()-ing them."""

    def to_internal_value(self, data: Any) -> str:
        if not isinstance(data, str):
            self.fail("invalid")
        return super().to_internal_value(data)


class StrictBooleanField(serializers.BooleanField):
    """true or false only, as the schema says (and /v1 checks): DRF's would take 0, "yes"…"""

    def to_internal_value(self, data: Any) -> bool:
        if not isinstance(data, bool):
            self.fail("invalid", input=data)
        return data


class ChatSerializer(serializers.ModelSerializer):
    title = StrictCharField(max_length=200, required=False, allow_blank=True, trim_whitespace=False)
    system_prompt = StrictCharField(
        required=False,
        allow_blank=True,
        trim_whitespace=False,
        max_length=chat_service.MAX_SYSTEM_PROMPT_CHARS,
    )
    policy = serializers.ChoiceField(choices=sorted(PRESETS), required=False)
    policy_overrides = serializers.DictField(required=False)
    model_variant = StrictCharField(required=False, allow_blank=True, max_length=100)
    folds_paused = StrictBooleanField(
        required=False,
        help_text="Background folds of this chat wait while true; a turn over its hard bound "
        "still folds (the context stays bounded).",
    )
    effective_policy = serializers.SerializerMethodField()

    class Meta:
        model = Chat
        fields = [
            "id",
            "title",
            "system_prompt",
            "policy",
            "policy_overrides",
            "effective_policy",
            "model_variant",
            "folds_paused",
            "last_seq",
            "created_at",
            "updated_at",
        ]
        read_only_fields = ["id", "last_seq", "created_at", "updated_at"]

    @extend_schema_field(OpenApiTypes.OBJECT)
    def get_effective_policy(self, chat: Chat) -> dict[str, object]:
        return policy_parameters(policy_for_chat(chat), variant_context_tokens(chat))

    def to_internal_value(self, data: Any) -> dict[str, Any]:
        # A misspelt knob or field ("polcy") silently ignored would give a chat the client did
        # not ask for. Read-only fields are ignored, as DRF does: a client may send back what
        # it read.
        if isinstance(data, dict):
            unknown = sorted(str(key) for key in data if key not in self.fields)
            if unknown:
                raise serializers.ValidationError(
                    {key: [f"Unknown field; the fields are {WRITABLE}."] for key in unknown}
                )
        return dict(super().to_internal_value(data))

    def validate(self, attrs: dict[str, Any]) -> dict[str, Any]:
        if self.instance is not None:
            return attrs  # an edit: chat_service.update_chat checks the row as it then is
        preset = attrs.get("policy") or settings.MEMORY_POLICY
        try:
            policy_for_new_settings(preset, attrs.get("policy_overrides") or {})
        except PolicyError as error:
            raise serializers.ValidationError({"policy_overrides": [str(error)]}) from error
        return attrs


WRITABLE = ", ".join(chat_service.API_EDITABLE_FIELDS)


# Read-only. Fields declared rather than introspected (ModelSerializer): every turn answers with
# two messages, and building a ModelSerializer's fields costs more than a turn's query. (A comment,
# not a docstring: drf-spectacular would publish a docstring as the schema's description.)
class MessageSerializer(serializers.Serializer):
    seq = serializers.IntegerField(read_only=True)
    role = serializers.ChoiceField(choices=Role.choices, read_only=True)
    content = serializers.CharField(read_only=True)
    token_count = serializers.IntegerField(read_only=True)
    model_variant = serializers.CharField(read_only=True)
    metadata = serializers.JSONField(read_only=True)
    created_at = serializers.DateTimeField(read_only=True)


class TurnRequestSerializer(serializers.Serializer):
    content = StrictCharField(trim_whitespace=False)
    model_variant = StrictCharField(required=False, allow_blank=True, max_length=100)
    # Absent: the Accept header decides (text/event-stream streams).
    stream = StrictBooleanField(
        required=False,
        help_text="Answer with server-sent events (accepted, delta..., done | error).",
    )
    # The structured agent context of this turn (docs/agent-state.md).
    agent = AgentContextSerializer(required=False)

    def validate_content(self, value: str) -> str:
        if not value.strip():
            raise serializers.ValidationError("Content must not be empty or only whitespace.")
        limit = settings.CHATMEM_MAX_MESSAGE_CHARS
        if len(value) > limit:
            raise serializers.ValidationError(
                f"Content is {len(value)} characters; the limit is {limit}."
            )
        return value


class TurnResponseSerializer(serializers.Serializer):
    user_message = MessageSerializer()
    assistant_message = MessageSerializer()


# Built once: every serializer instance deep-copies its declared fields (here two nested
# MessageSerializers), which costs more than the representation itself (docs/benchmarks.md).
# Rendering keeps no state on the fields between calls, so the one bound instance serves every
# request and thread.
_TURN_RESPONSE = TurnResponseSerializer()
_TURN_RESPONSE.fields  # noqa: B018 - bind the fields now, not in a race between first requests


def turn_response_body(user_message: Message, assistant_message: Message) -> dict[str, Any]:
    """What ``TurnResponseSerializer({...}).data`` gives for a stored turn."""
    return dict(
        _TURN_RESPONSE.to_representation(
            {"user_message": user_message, "assistant_message": assistant_message}
        )
    )


class WithheldSerializer(serializers.Serializer):
    """A message folded past without its content: the summarizer refused it (docs/policies.md,
    poison messages). Its text stays in the chat's messages."""

    seq = serializers.IntegerField()
    reason = serializers.CharField()


class PromptCacheSerializer(serializers.Serializer):
    """What the provider's prompt cache served the chat's replies, as their usage reported it
    (OpenAI's ``cached_tokens``, Anthropic's ``cache_read_input_tokens``); 0 cached where the
    server reports none."""

    replies = serializers.IntegerField(help_text="Model replies whose usage was reported.")
    prompt_tokens = serializers.IntegerField(help_text="Their prompt tokens, all together.")
    cached_tokens = serializers.IntegerField(
        help_text="Of those, the tokens the provider's prompt cache served."
    )
    cached_share = serializers.FloatField(
        allow_null=True, help_text="cached_tokens / prompt_tokens; null before any reply."
    )


class BriefSerializer(serializers.ModelSerializer):
    unfolded = serializers.IntegerField(read_only=True)
    pending = serializers.BooleanField(read_only=True)
    withheld = WithheldSerializer(many=True, read_only=True)
    prompt_cache = PromptCacheSerializer(read_only=True)
    degraded_reason = serializers.SerializerMethodField(
        help_text=(
            "Why the memory is degraded: how many folds in a row failed and the last failure's "
            "kind and error; empty when it is not."
        )
    )

    class Meta:
        model = Brief
        fields = [
            "summary",
            "summary_tokens",
            "last_consolidated",
            "last_consolidated_at",
            "version",
            "unfolded",
            "pending",
            "degraded",
            "degraded_reason",
            "consecutive_failures",
            "next_attempt_at",
            "last_error",
            "withheld",
            "fallback_since",
            "fallback_reason",
            "user_lines",
            "prompt_cache",
        ]
        read_only_fields = fields
        extra_kwargs = {
            "user_lines": {
                "help_text": "The summary's lines a person wrote (PATCH), in its order: folds "
                "keep them unless a later message revokes them."
            }
        }

    def get_degraded_reason(self, brief: Brief) -> str:
        return degraded_reason(brief)


class BriefEditSerializer(serializers.Serializer):
    """PATCH …/brief/: the new summary, with the brief's ETag in If-Match."""

    summary = StrictCharField(allow_blank=True, trim_whitespace=False)

    def to_internal_value(self, data: Any) -> dict[str, Any]:
        if isinstance(data, dict):
            unknown = sorted(str(key) for key in data if key not in self.fields)
            if unknown:
                raise serializers.ValidationError(
                    {key: ["Unknown field; the only field is summary."] for key in unknown}
                )
        return dict(super().to_internal_value(data))


def degraded_reason(brief: Brief) -> str:
    if not brief.degraded:
        return ""
    kind = f" ({brief.failure_kind})" if brief.failure_kind else ""
    return f"{brief.consecutive_failures} folds in a row failed; the last{kind}: {brief.last_error}"


# What a chat's owner reads as the editor of a summary a staff person edited (the admin): that
# staff edited it, not who (a staff username is the operator's, not the user's, to know).
STAFF_EDITOR = "staff"


class ConsolidationSerializer(serializers.ModelSerializer):
    withheld_seqs = serializers.ListField(child=serializers.IntegerField(), read_only=True)
    dropped_details = serializers.ListField(
        child=serializers.CharField(),
        read_only=True,
        help_text=(
            "A committed fold's loss report: exact details of its input (numbers, codes, dates, "
            "URLs, e-mail addresses, file names, identifiers) absent from its summary; at most "
            "50."
        ),
    )
    edited_by = serializers.SerializerMethodField(
        help_text=(
            'An edit\'s (trigger "edit"): your username for your own edit, "staff" for an '
            "operator's; empty for a fold."
        )
    )

    class Meta:
        model = Consolidation
        fields = [
            "id",
            "trigger",
            "status",
            "from_seq",
            "to_seq",
            "synchronous",
            "input_tokens",
            "output_tokens",
            "summary_tokens_before",
            "summary_tokens_after",
            "summarizer_calls",
            "started_at",
            "finished_at",
            "duration_ms",
            "error",
            "withheld_seqs",
            "dropped_details",
            "edited_by",
        ]
        read_only_fields = fields

    def get_edited_by(self, row: Consolidation) -> str:
        """The owner's own username for their edit, "staff" for anyone else's (context
        ``owner_username``: the chat's owner, who reads the ledger)."""
        if not row.edited_by or row.edited_by == self.context.get("owner_username"):
            return row.edited_by
        return STAFF_EDITOR


class DailyNoteSerializer(serializers.ModelSerializer):
    class Meta:
        model = DailyNote
        fields = ["day", "facts", "ranges", "extractor", "updated_at"]
        read_only_fields = fields
