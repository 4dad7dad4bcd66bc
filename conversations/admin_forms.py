"""The admin's chat form: the checks a chat created through the API gets."""

from typing import Any

from django import forms
from django.contrib.admin.widgets import AdminTextareaWidget, AdminTextInputWidget
from django.core.exceptions import ValidationError

from conversations.models import Chat
from conversations.services import chats as chat_service
from conversations.variants import UnknownVariant
from memory_worker.engine.presets import PRESETS, PolicyError


class PolicyOverridesField(forms.JSONField):
    """A JSON object of knob -> value, as the API's ``policy_overrides`` (a DictField): a list,
    number, boolean, string or null stored here would make every listing of the owner's chats
    fail. An empty box means no overrides, the model's default."""

    default_error_messages = {
        "not_an_object": 'Enter a JSON object of knobs and their values, e.g. {"window": 12}.',
    }

    def to_python(self, value: Any) -> Any:
        if value in self.empty_values:
            return {}
        converted = super().to_python(value)
        if not isinstance(converted, dict):
            raise ValidationError(self.error_messages["not_an_object"], code="not_an_object")
        return converted


class ChatForm(forms.ModelForm):
    """The checks a chat created through the API gets: a policy or variant its turns cannot
    use is refused here, with the reason, instead of failing every turn."""

    # Text as the API stores it (trim_whitespace=False), and the API's cap on the prompt, whose
    # tokens every turn's bound counts: an uncapped prompt can leave no room for any turn.
    title = forms.CharField(
        required=False,
        strip=False,
        max_length=Chat._meta.get_field("title").max_length,
        widget=AdminTextInputWidget,
    )
    system_prompt = forms.CharField(
        required=False,
        strip=False,
        max_length=chat_service.MAX_SYSTEM_PROMPT_CHARS,
        widget=AdminTextareaWidget,
    )
    # A choice of the known presets: a misspelt preset would make every turn of the chat fail.
    policy = forms.ChoiceField(choices=[(name, name) for name in PRESETS])
    policy_overrides = PolicyOverridesField(required=False)

    class Meta:
        model = Chat
        fields = list(chat_service.EDITABLE_FIELDS)

    def clean(self) -> dict[str, Any]:
        cleaned = super().clean() or {}
        chat = Chat(
            policy=cleaned.get("policy") or "",
            # Absent when its field refused it (the error is on the form already).
            policy_overrides=cleaned.get("policy_overrides", {}),
            model_variant=cleaned.get("model_variant") or "",
            system_prompt=cleaned.get("system_prompt") or "",
        )
        try:
            chat_service.validate_chat_settings(chat)
        except chat_service.NoRoomInWindow as error:  # the prompt and the cap together
            self.add_error(None, str(error))
        except PolicyError as error:
            unknown_preset = chat.policy not in PRESETS
            self.add_error("policy" if unknown_preset else "policy_overrides", str(error))
        except UnknownVariant as error:
            self.add_error("model_variant", str(error))
        return cleaned
