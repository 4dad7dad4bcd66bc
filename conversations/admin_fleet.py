"""The admin's fleet page (staff): how memory work is doing across every chat, from the ledger and
the database (services.fleet), each chat that needs attention a link to its page."""

from typing import Any

from django.contrib import admin
from django.http import HttpRequest, HttpResponse
from django.template.response import TemplateResponse
from django.urls import path

from conversations.models import Chat
from conversations.services.fleet import fleet

OUTCOMES = (
    ("committed", "committed"),
    ("failed", "failed"),
    ("superseded", "superseded (another fold committed first)"),
    ("fallen_back", "fallen back (the offline summarizer folded after the model failed)"),
)


def fleet_urls(model_admin: admin.ModelAdmin) -> list[Any]:
    view = model_admin.admin_site.admin_view(fleet_view(model_admin))
    return [path("fleet/", view, name="conversations_chat_fleet")]


def fleet_view(model_admin: admin.ModelAdmin) -> Any:
    def view(request: HttpRequest) -> HttpResponse:
        if not model_admin.has_view_permission(request):
            return HttpResponse(status=403)
        figures = fleet()
        rows = [
            {
                "key": key,
                "label": label,
                "cells": [
                    (w.label, getattr(w, key), f"{w.per_minute(getattr(w, key)):.2f}")
                    for w in figures.windows
                ],
            }
            for key, label in OUTCOMES
        ]
        context = {
            **model_admin.admin_site.each_context(request),
            "title": "Memory across the fleet",
            "fleet": figures,
            "outcome_rows": rows,
            "opts": Chat._meta,
        }
        return TemplateResponse(request, "admin/conversations/fleet.html", context)

    return view
