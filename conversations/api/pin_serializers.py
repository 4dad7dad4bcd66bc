"""A chat's pins in the API (conversations.services.pins)."""

from typing import Any

from rest_framework import serializers

from conversations.api.serializers import StrictCharField
from conversations.models import Pin
from conversations.services.pins import MAX_PIN_CHARS

MAX_SEQ = 2**63 - 1  # the column's range: a larger number would be the database's error


class PinSerializer(serializers.ModelSerializer):
    class Meta:
        model = Pin
        fields = ["id", "text", "seq", "tokens", "created_at"]
        read_only_fields = fields
        extra_kwargs = {
            "text": {"help_text": 'The pinned text; a pinned message\'s is "role: content".'},
            "seq": {"help_text": "The pinned message's seq; null for a pinned text."},
            "tokens": {"help_text": "The text's tokens, counted in the chat's bound."},
        }


class PinRequestSerializer(serializers.Serializer):
    text = StrictCharField(
        required=False,
        trim_whitespace=False,
        max_length=MAX_PIN_CHARS,
        help_text="A text to keep verbatim in every context.",
    )
    seq = serializers.IntegerField(
        required=False,
        min_value=1,
        max_value=MAX_SEQ,
        help_text="A stored message of this chat to keep verbatim.",
    )

    def to_internal_value(self, data: Any) -> dict[str, Any]:
        # As for chats: a misspelt field silently ignored would pin nothing the client meant.
        if isinstance(data, dict):
            unknown = sorted(str(key) for key in data if key not in self.fields)
            if unknown:
                raise serializers.ValidationError(
                    {key: ['Unknown field; send "text" or "seq".'] for key in unknown}
                )
        return dict(super().to_internal_value(data))

    def validate_text(self, value: str) -> str:
        if not value.strip():
            raise serializers.ValidationError("A pinned text must not be empty or only whitespace.")
        return value

    def validate(self, attrs: dict[str, Any]) -> dict[str, Any]:
        if ("text" in attrs) == ("seq" in attrs):
            raise serializers.ValidationError('Send exactly one of "text" and "seq".')
        return attrs
