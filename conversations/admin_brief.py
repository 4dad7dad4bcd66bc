"""The admin's summary editor: the API's edit (memory_worker.folding.summary_edit) with the version
the page was loaded at as a hidden field, so a fold that committed since is never overwritten unseen
(the edit is refused and the newer summary shown)."""

from typing import Any

from django import forms
from django.contrib import admin, messages
from django.contrib.admin.widgets import AdminTextareaWidget
from django.http import HttpRequest, HttpResponse, HttpResponseRedirect
from django.shortcuts import get_object_or_404
from django.template.response import TemplateResponse
from django.urls import path, reverse
from django.utils.html import format_html

from conversations.models import Brief, Chat
from memory_worker.memory import EditRefused, OverCap, edit_summary


class SummaryEditForm(forms.Form):
    summary = forms.CharField(
        required=False, strip=False, widget=AdminTextareaWidget(attrs={"rows": 20, "cols": 100})
    )
    version = forms.IntegerField(widget=forms.HiddenInput, min_value=0)


def summary_edit_urls(model_admin: admin.ModelAdmin) -> list[Any]:
    view = model_admin.admin_site.admin_view(edit_summary_view(model_admin))
    return [path("<int:chat_id>/summary/", view, name="conversations_chat_edit_summary")]


def edit_link(chat: Chat) -> str:
    url = reverse("admin:conversations_chat_edit_summary", args=[chat.pk])
    return format_html('<p><a href="{}">Edit the summary</a></p>', url)


def edit_summary_view(model_admin: admin.ModelAdmin) -> Any:
    def view(request: HttpRequest, chat_id: int) -> HttpResponse:
        chat = get_object_or_404(Chat, pk=chat_id)
        if not model_admin.has_change_permission(request, chat):
            return HttpResponse(status=403)
        brief = Brief.objects.get(chat_id=chat.pk)
        form = SummaryEditForm(initial={"summary": brief.summary, "version": brief.version})
        if request.method == "POST":
            form = SummaryEditForm(request.POST)
            if form.is_valid():
                data = form.cleaned_data
                try:
                    edit_summary(
                        chat, data["summary"], data["version"], editor=request.user.get_username()
                    )
                except OverCap as error:
                    form.add_error("summary", str(error))
                except EditRefused as error:
                    # Stale: show the summary as it now is, to edit again.
                    messages.error(request, str(error))
                    return HttpResponseRedirect(request.path)
                else:
                    messages.success(request, "The summary was saved.")
                    return HttpResponseRedirect(
                        reverse("admin:conversations_chat_change", args=[chat.pk])
                    )
        context = {
            **model_admin.admin_site.each_context(request),
            "title": f"Edit the summary of {chat}",
            "chat": chat,
            "form": form,
            "version": form["version"].value(),
            "opts": Chat._meta,
        }
        return TemplateResponse(request, "admin/conversations/chat/edit_summary.html", context)

    return view
