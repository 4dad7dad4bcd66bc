"""The chat's pins on its admin page: shown, added, rewritten and removed inline, each through
conversations.services.pins, so the admin makes the API's checks (the room left, one of text and
message)."""

from typing import Any

from django import forms
from django.contrib import admin
from django.contrib.auth.models import AbstractBaseUser, AnonymousUser
from django.core.exceptions import ValidationError
from django.forms.models import BaseInlineFormSet
from django.http import HttpRequest

from conversations.models import Chat, Pin
from conversations.services import pins as pin_service


class PinForm(forms.ModelForm):
    text = forms.CharField(
        required=False,
        widget=forms.Textarea(attrs={"rows": 2, "cols": 60}),
        help_text='A text to pin, or leave it empty and give a message\'s seq ("role: content").',
    )

    class Meta:
        model = Pin
        fields = ["text", "seq"]

    def clean(self) -> dict[str, Any]:
        data = super().clean() or {}
        chat = self.instance.chat if self.instance.pk else None
        if chat is not None:  # an existing pin: only a pinned text is rewritten
            if "seq" in self.changed_data:
                raise ValidationError("A pin's message does not change: unpin it, pin another.")
            if not data.get("text", "").strip():
                raise ValidationError("A pin's text cannot be blank: delete the pin instead.")
            return data
        if bool(data.get("text", "").strip()) == (data.get("seq") is not None):
            raise ValidationError("Give exactly one of a text and a message's seq.")
        return data


class PinFormSet(BaseInlineFormSet):
    """Saves through the pins service; ``editor`` is the staff user (the pins' created_by)."""

    editor: AbstractBaseUser | AnonymousUser | None = None
    instance: Chat

    def clean(self) -> None:
        super().clean()
        if any(self.errors):
            return
        texts = []
        for form in self.forms:
            if not form.has_changed() and not form.instance.pk:
                continue  # an empty extra row
            if self.can_delete and form.cleaned_data.get("DELETE"):
                continue
            texts.append(self._text_of(form))
        try:
            pin_service.check_pins_fit(self.instance, texts)
        except pin_service.PinRefused as error:
            raise ValidationError(str(error)) from error

    def _text_of(self, form: forms.ModelForm) -> str:
        seq = form.cleaned_data.get("seq")
        if form.instance.pk or seq is None:
            return str(form.cleaned_data.get("text") or form.instance.text)
        try:
            return pin_service.message_pin_text(self.instance, seq)
        except pin_service.PinRefused as error:
            raise ValidationError(str(error)) from error

    def save_new(self, form: forms.ModelForm, commit: bool = True) -> Pin:
        data = form.cleaned_data
        seq = data.get("seq")
        return pin_service.add_pin(
            self.instance,
            text=None if seq is not None else data["text"],
            seq=seq,
            user=self.editor,
        )

    def save_existing(self, form: forms.ModelForm, obj: Pin, commit: bool = True) -> Pin:
        return pin_service.change_pin_text(self.instance, obj.pk, form.cleaned_data["text"])

    def delete_existing(self, obj: Pin, commit: bool = True) -> None:
        if commit:
            pin_service.remove_pin(self.instance, obj.pk)


class PinInline(admin.TabularInline):
    model = Pin
    form = PinForm
    formset = PinFormSet
    extra = 1
    fields = ("text", "seq", "tokens", "created_at", "created_by")
    readonly_fields = ("tokens", "created_at", "created_by")
    verbose_name_plural = "pins (always in the context, verbatim, counted in the bound)"

    def get_formset(self, request: HttpRequest, obj: Any = None, **kwargs: Any) -> Any:
        formset = super().get_formset(request, obj, **kwargs)
        return type(formset.__name__, (formset,), {"editor": request.user})
