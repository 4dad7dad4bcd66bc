"""Admin for inspecting chats: history is append-only, so messages and the ledger are read-only."""

from django.contrib import admin, messages
from django.db.models import QuerySet
from django.http import HttpRequest

from conversations.models import Brief, Chat, Consolidation, Message
from memory_worker.dispatch import request_consolidation


class ReadOnlyAdmin(admin.ModelAdmin):
    def has_add_permission(self, request: HttpRequest, obj: object = None) -> bool:
        return False

    def has_change_permission(self, request: HttpRequest, obj: object = None) -> bool:
        return False


class BriefInline(admin.StackedInline):
    model = Brief
    can_delete = False
    readonly_fields = (
        "summary",
        "summary_tokens",
        "last_consolidated",
        "last_consolidated_at",
        "version",
        "degraded",
        "consecutive_failures",
        "next_attempt_at",
        "last_error",
    )
    fields = readonly_fields


@admin.action(description="Consolidate now")
def consolidate_now(modeladmin: admin.ModelAdmin, request: HttpRequest, queryset: QuerySet) -> None:
    queued = sum(request_consolidation(chat.pk, "manual") for chat in queryset)
    modeladmin.message_user(request, f"Queued {queued} consolidation(s).", messages.SUCCESS)


@admin.register(Chat)
class ChatAdmin(admin.ModelAdmin):
    list_display = ["id", "title", "owner", "policy", "last_seq", "watermark", "created_at"]
    list_filter = ["policy", "brief__degraded"]
    search_fields = ["title", "owner__username"]
    readonly_fields = ["last_seq", "turn_token", "turn_started_at", "system_prompt_tokens"]
    inlines = [BriefInline]
    actions = [consolidate_now]

    @admin.display(description="W (folded up to)")
    def watermark(self, chat: Chat) -> int:
        return chat.brief.last_consolidated


@admin.register(Message)
class MessageAdmin(ReadOnlyAdmin):
    list_display = ["chat", "seq", "role", "token_count", "model_variant", "created_at"]
    list_filter = ["role"]
    search_fields = ["content"]


@admin.register(Consolidation)
class ConsolidationAdmin(ReadOnlyAdmin):
    list_display = ["id", "chat", "trigger", "status", "from_seq", "to_seq", "duration_ms"]
    list_filter = ["status", "trigger", "synchronous"]


@admin.register(Brief)
class BriefAdmin(ReadOnlyAdmin):
    list_display = ["chat", "last_consolidated", "version", "degraded", "next_attempt_at"]
    list_filter = ["degraded"]
