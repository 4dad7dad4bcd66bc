"""Admin for inspecting chats: history is append-only, so messages and the ledger are read-only."""

from collections.abc import Sequence

from django.contrib import admin, messages
from django.db.models import F, QuerySet
from django.http import HttpRequest
from django.urls import reverse
from django.utils.html import format_html, format_html_join, linebreaks
from django.utils.safestring import mark_safe

from conversations.agent_admin import AgentStateInline
from conversations.models import Brief, Chat, Consolidation, DailyNote, Message
from conversations.services.chats import next_context
from memory_worker.consolidation import lag_ms
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


class DailyNoteInline(admin.TabularInline):
    """Seed 002's daily tier, read-only: written only by the flush hook."""

    model = DailyNote
    extra = 0
    can_delete = False
    readonly_fields = ("day", "facts_list", "extractor", "updated_at")
    fields = readonly_fields

    def has_add_permission(self, request: HttpRequest, obj: object = None) -> bool:
        return False

    @admin.display(description="facts")
    def facts_list(self, note: DailyNote) -> str:
        return "\n".join(f"- {fact['text']}" for fact in note.facts)


@admin.action(description="Consolidate now")
def consolidate_now(modeladmin: admin.ModelAdmin, request: HttpRequest, queryset: QuerySet) -> None:
    queued = sum(request_consolidation(chat.pk, "manual") for chat in queryset)
    modeladmin.message_user(request, f"Queued {queued} consolidation(s).", messages.SUCCESS)


LAGGING_UNFOLDED = 60  # more unfolded messages than this: folding has fallen behind
RECENT_ROWS = 30


class MemoryFilter(admin.SimpleListFilter):
    title = "memory"
    parameter_name = "memory"

    def lookups(self, request: HttpRequest, model_admin: admin.ModelAdmin) -> list[tuple[str, str]]:
        return [
            ("lagging", f"Lagging (over {LAGGING_UNFOLDED} unfolded)"),
            ("degraded", "Degraded (folds keep failing)"),
        ]

    def queryset(self, request: HttpRequest, queryset: QuerySet) -> QuerySet:
        if self.value() == "lagging":
            backlog = F("last_seq") - F("brief__last_consolidated")
            return queryset.alias(backlog=backlog).filter(backlog__gt=LAGGING_UNFOLDED)
        if self.value() == "degraded":
            return queryset.filter(brief__degraded=True)
        return queryset


def table(header: Sequence[str], rows: Sequence[Sequence[object]]) -> str:
    head = format_html_join("", "<th>{}</th>", ((cell,) for cell in header))
    body = format_html_join(
        "",
        "<tr>{}</tr>",
        ((format_html_join("", "<td>{}</td>", ((cell,) for cell in row)),) for row in rows),
    )
    return format_html('<table class="chatmem-table"><tr>{}</tr>{}</table>', head, body)


@admin.register(Chat)
class ChatAdmin(admin.ModelAdmin):
    list_display = [
        "id",
        "title",
        "owner",
        "policy",
        "last_seq",
        "watermark",
        "backlog",
        "last_consolidated_at",
        "degraded",
        "created_at",
    ]
    list_filter = [MemoryFilter, "policy", "brief__degraded"]
    list_select_related = ["owner", "brief"]
    search_fields = ["title", "owner__username", "external_id"]
    readonly_fields = [
        "last_seq",
        "turn_token",
        "turn_started_at",
        "system_prompt_tokens",
        "watermark",
        "backlog",
        "last_consolidated_at",
        "degraded",
        "summary",
        "context_preview",
        "recent_messages",
        "ledger",
    ]
    fieldsets = [
        (
            None,
            {
                "fields": [
                    "title",
                    "owner",
                    "external_id",
                    "system_prompt",
                    "policy",
                    "policy_overrides",
                    "model_variant",
                ]
            },
        ),
        (
            "Memory",
            {
                "fields": [
                    "last_seq",
                    "watermark",
                    "backlog",
                    "last_consolidated_at",
                    "degraded",
                    "summary",
                ]
            },
        ),
        ("What the model sees next", {"fields": ["context_preview"]}),
        ("History (append-only)", {"fields": ["recent_messages", "ledger"]}),
        (
            "Turn slot",
            {
                "classes": ["collapse"],
                "fields": ["turn_token", "turn_started_at", "system_prompt_tokens"],
            },
        ),
    ]
    inlines = [BriefInline, DailyNoteInline, AgentStateInline]
    actions = [consolidate_now]

    @admin.display(description="W (folded up to)")
    def watermark(self, chat: Chat) -> int:
        return chat.brief.last_consolidated

    @admin.display(description="unfolded")
    def backlog(self, chat: Chat) -> int:
        return chat.last_seq - chat.brief.last_consolidated

    @admin.display(description="last consolidated")
    def last_consolidated_at(self, chat: Chat) -> object:
        return chat.brief.last_consolidated_at

    @admin.display(description="degraded", boolean=True)
    def degraded(self, chat: Chat) -> bool:
        return chat.brief.degraded

    @admin.display(description="summary")
    def summary(self, chat: Chat) -> str:
        if not chat.brief.summary:
            return "(no summary yet)"
        # linebreaks escapes the text itself (autoescape=True): safe to mark as such.
        rendered = mark_safe(linebreaks(chat.brief.summary, autoescape=True))
        return format_html('<div class="chatmem-summary">{}</div>', rendered)

    @admin.display(description="context preview")
    def context_preview(self, chat: Chat) -> str:
        """Exactly the list the model receives next (the /context/ endpoint), before the new
        user message."""
        rows = [
            [m["role"], format_html("<pre>{}</pre>", m.get("content") or "")]
            for m in next_context(chat)
        ]
        return table(["role", "content"], rows)

    @admin.display(description=f"latest {RECENT_ROWS} messages")
    def recent_messages(self, chat: Chat) -> str:
        latest = chat.messages.order_by("-seq")[:RECENT_ROWS]
        rows = [[m.seq, m.role, m.token_count, m.content[:300]] for m in reversed(latest)]
        link = reverse("admin:conversations_message_changelist") + f"?chat__id__exact={chat.pk}"
        return format_html(
            '{}<p><a href="{}">all messages</a></p>',
            table(["seq", "role", "tokens", "content"], rows),
            link,
        )

    @admin.display(description="consolidation ledger")
    def ledger(self, chat: Chat) -> str:
        latest = chat.consolidations.order_by("-id")[:RECENT_ROWS]
        rows = [
            [
                c.id,
                c.trigger,
                c.status,
                f"{c.from_seq}..{c.to_seq}",
                c.synchronous,
                c.duration_ms,
                c.error[:200],
            ]
            for c in latest
        ]
        link = (
            reverse("admin:conversations_consolidation_changelist") + f"?chat__id__exact={chat.pk}"
        )
        return format_html(
            '{}<p><a href="{}">whole ledger</a></p>',
            table(["id", "trigger", "status", "range", "sync", "ms", "error"], rows),
            link,
        )


@admin.register(Message)
class MessageAdmin(ReadOnlyAdmin):
    list_display = ["chat", "seq", "role", "token_count", "model_variant", "created_at"]
    list_filter = ["role"]
    search_fields = ["content"]


@admin.register(Consolidation)
class ConsolidationAdmin(ReadOnlyAdmin):
    list_display = [
        "id",
        "chat",
        "trigger",
        "status",
        "from_seq",
        "to_seq",
        "duration_ms",
        "lag_ms",
    ]
    list_filter = ["status", "trigger", "synchronous"]

    @admin.display(description="lag (ms)")
    def lag_ms(self, ledger: Consolidation) -> int | None:
        if ledger.finished_at is None or ledger.due_at is None:
            return None
        return lag_ms(ledger.due_at, ledger.finished_at)


@admin.register(Brief)
class BriefAdmin(ReadOnlyAdmin):
    list_display = ["chat", "last_consolidated", "version", "degraded", "next_attempt_at"]
    list_filter = ["degraded"]
