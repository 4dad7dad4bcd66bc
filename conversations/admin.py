"""Admin for inspecting chats: history is append-only, so messages and the ledger are read-only."""

from collections import Counter
from collections.abc import Sequence
from typing import Any

from django.contrib import admin, messages
from django.contrib.auth.admin import UserAdmin
from django.contrib.auth.models import User
from django.core.exceptions import PermissionDenied
from django.db.models import CASCADE, Model, QuerySet
from django.http import HttpRequest
from django.urls import reverse
from django.utils import formats
from django.utils.html import format_html, format_html_join
from django.utils.safestring import mark_safe

from conversations import admin_memory as shown
from conversations.admin_brief import edit_link, summary_edit_urls
from conversations.admin_filters import MemoryFilter, TriggerFilter
from conversations.admin_fleet import fleet_urls
from conversations.admin_forms import ChatForm
from conversations.admin_memory import table, when
from conversations.admin_timeline import timeline_svg
from conversations.agent_admin import AgentStateInline, agent_state_shown
from conversations.models import Brief, Chat, Consolidation, DailyNote, Message
from conversations.pin_admin import PinInline
from conversations.services import chats as chat_service
from conversations.services.chats import next_context
from conversations.services.fold_outlook import FoldOutlook, fold_outlook
from conversations.services.memory_timeline import memory_timeline
from conversations.services.prompt_cache import prompt_cache_totals
from memory_worker.memory import ManualRequest, lag_ms, request_manual_fold


class ReadOnlyAdmin(admin.ModelAdmin):
    """History and memory state are written only by turns and folds: deleting a message, a
    ledger row or a brief would leave a gap, or a chat whose every turn fails. They go with
    their chat."""

    def has_add_permission(self, request: HttpRequest, obj: object = None) -> bool:
        return False

    def has_change_permission(self, request: HttpRequest, obj: object = None) -> bool:
        return False

    # Deleting: only with the chat (or its owner), never row by row. The permission itself
    # stays the staff user's own, so that deleting a chat or a user may take these rows with
    # it; their own delete page and bulk action are gone.
    def get_actions(self, request: HttpRequest) -> dict[str, Any]:
        actions = super().get_actions(request)
        actions.pop("delete_selected", None)
        return actions

    def delete_view(self, request: HttpRequest, object_id: str, extra_context: Any = None) -> Any:
        raise PermissionDenied("History is deleted only with its chat.")

    def change_view(
        self, request: HttpRequest, object_id: str, form_url: str = "", extra_context: Any = None
    ) -> Any:
        context = {**(extra_context or {}), "show_delete": False}
        return super().change_view(request, object_id, form_url, context)


def counted_deletion(
    objs: Sequence[Any], chat_ids: Sequence[int], perms_needed: set[str] | None = None
) -> tuple[Any, ...]:
    """``get_deleted_objects`` as counts: Django's own page lists (and loads) every related
    row, hundreds of thousands for a long chat. A chat's messages, ledger and notes are its
    own, so deleting it needs no permission on them; ``perms_needed`` names what else the
    staff user lacks (the page then refuses)."""
    counts = {
        "chats": len(chat_ids),
        "messages": Message.objects.filter(chat_id__in=chat_ids).count(),
        "consolidations": Consolidation.objects.filter(chat_id__in=chat_ids).count(),
        "daily notes": DailyNote.objects.filter(chat_id__in=chat_ids).count(),
    }
    listed: list[str] = [
        format_html("{}: {}", obj._meta.verbose_name.capitalize(), obj) for obj in objs
    ]
    listed += [f"{count} {name}" for name, count in counts.items() if count]
    return listed, counts, perms_needed or set(), []


# Viewing a chat must not queue folds (each costs a model call): the action needs the change
# permission, as editing the chat would.
@admin.action(description="Consolidate now", permissions=["change"])
def consolidate_now(modeladmin: admin.ModelAdmin, request: HttpRequest, queryset: QuerySet) -> None:
    chat_ids = list(queryset.values_list("pk", flat=True))
    answers: Counter[ManualRequest] = Counter()
    for chat_id in chat_ids:
        try:
            answer = request_manual_fold(chat_id)
        except Chat.DoesNotExist:
            continue  # deleted since the list was shown
        if answer == ManualRequest.NOT_QUEUED:
            # The broker is down (each try can wait for its timeout): stop rather than try the
            # rest one by one.
            modeladmin.message_user(
                request,
                f"{manual_fold_summary(answers)} The next consolidation could not be queued "
                "(the broker is unavailable, or MEMORY_DISPATCH is off), so the rest were not "
                "tried. The sweep folds whatever falls due.",
                messages.ERROR,
            )
            return
        answers[answer] += 1
    modeladmin.message_user(request, manual_fold_summary(answers), messages.SUCCESS)


def manual_fold_summary(answers: Counter[ManualRequest]) -> str:
    return (
        f"Queued {answers[ManualRequest.QUEUED]} consolidation(s); "
        f"{answers[ManualRequest.ALREADY_QUEUED]} already queued; "
        f"{answers[ManualRequest.NOTHING_TO_FOLD]} with nothing to fold."
    )


RECENT_ROWS = 30
RECENT_NOTES = 10  # the chat page shows these; a chat's whole history would be a huge page


# Sorting the message or ledger list by its "chat" column would sort by the chat's own ordering
# (a join over the whole table); by the id, the table's index serves it.
@admin.display(description="chat", ordering="chat_id")
def chat_column(row: Message | Consolidation) -> str:
    return str(row.chat)


@admin.register(Chat)
class ChatAdmin(admin.ModelAdmin):
    list_display = [
        "id",
        "title",
        "owner",
        "policy",
        "last_seq",
        "last_consolidated",
        "unfolded",
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
        "last_consolidated",
        "unfolded",
        "last_consolidated_at",
        "degraded",
        "next_fold",
        "summary",
        "prompt_cache",
        "memory_notes",
        "memory_timeline",
        "context_preview",
        "recent_messages",
        "ledger",
        "daily_notes",
        "created_at",
        "updated_at",
    ]
    inlines = [PinInline, AgentStateInline]
    actions = [consolidate_now]
    form = ChatForm
    # A select of every user: 2 MB and seconds per page with 50,000 of them.
    raw_id_fields = ["owner"]

    def get_fieldsets(self, request: HttpRequest, obj: Chat | None = None) -> Any:
        editable = (None, {"fields": list(chat_service.EDITABLE_FIELDS)})
        if obj is None:
            return [editable]
        brief = obj.brief
        memory = ["degraded"] if brief.degraded else []
        memory += ["next_fold", "summary", "last_seq", "last_consolidated", "unfolded"]
        memory += ["last_consolidated_at", "prompt_cache"]
        if memory_notes(brief):
            memory.append("memory_notes")
        return [
            editable,
            ("Memory", {"fields": memory}),
            ("Memory over time", {"fields": ["memory_timeline"]}),
            ("What the model sees next", {"fields": ["context_preview"]}),
            ("History (append-only)", {"fields": ["recent_messages", "ledger"]}),
            ("Daily notes", {"fields": ["daily_notes"]}),
            (
                "Turn slot and times",
                {
                    "classes": ["collapse"],
                    "fields": [
                        "turn_token",
                        "turn_started_at",
                        "system_prompt_tokens",
                        "created_at",
                        "updated_at",
                    ],
                },
            ),
        ]

    def get_inline_instances(self, request: HttpRequest, obj: Chat | None = None) -> list[Any]:
        # Agent state only where a chat has some (most have none: a page of empty lists).
        instances = super().get_inline_instances(request, obj)
        if obj is None or not agent_state_shown(obj):
            return [i for i in instances if not isinstance(i, AgentStateInline)]
        return instances

    def outlook(self, chat: Chat) -> FoldOutlook:
        # Read once per page: several fields show it.
        found: FoldOutlook | None = getattr(chat, "_fold_outlook", None)
        if found is None:
            found = fold_outlook(chat)
            chat._fold_outlook = found  # type: ignore[attr-defined]
        return found

    def save_model(self, request: HttpRequest, obj: Chat, form: Any, change: bool) -> None:
        chat_service.save_chat(obj)

    def get_urls(self) -> list[Any]:
        return [*fleet_urls(self), *summary_edit_urls(self), *super().get_urls()]

    def get_deleted_objects(self, objs: Any, request: HttpRequest) -> tuple[Any, ...]:
        chats = list(objs)
        return counted_deletion(chats, [chat.pk for chat in chats])

    # The API's names (the brief's last_consolidated and unfolded): the watermark W and what lies
    # after it.
    @admin.display(description="last consolidated")
    def last_consolidated(self, chat: Chat) -> int:
        return chat.brief.last_consolidated

    @admin.display(description="unfolded")
    def unfolded(self, chat: Chat) -> int:
        return chat.last_seq - chat.brief.last_consolidated

    @admin.display(description="last consolidated at")
    def last_consolidated_at(self, chat: Chat) -> str:
        return when(chat.brief.last_consolidated_at)

    # A warning only when true: a red "no" read as an alarm.
    @admin.display(description="degraded", ordering="brief__degraded")
    def degraded(self, chat: Chat) -> str:
        return shown.degraded_badge(chat.brief.degraded)

    @admin.display(description="folding")
    def next_fold(self, chat: Chat) -> str:
        return shown.outlook_line(self.outlook(chat))

    @admin.display(description="summary")
    def summary(self, chat: Chat) -> str:
        return format_html(
            "{}{}", shown.summary_block(chat.brief.summary, self.outlook(chat)), edit_link(chat)
        )

    @admin.display(description="prompt cache")
    def prompt_cache(self, chat: Chat) -> str:
        return shown.prompt_cache_line(prompt_cache_totals(chat))

    @admin.display(description="also")
    def memory_notes(self, chat: Chat) -> str:
        return format_html_join(mark_safe("<br>"), "{}: {}", memory_notes(chat.brief))

    @admin.display(description="timeline")
    def memory_timeline(self, chat: Chat) -> str:
        return timeline_svg(memory_timeline(chat))

    @admin.display(description="context preview")
    def context_preview(self, chat: Chat) -> str:
        """Exactly the list the model receives next (the /context/ endpoint), before the new
        user message."""
        return table(["role", "content"], shown.context_rows(next_context(chat)))

    @admin.display(description=f"latest {RECENT_ROWS} messages")
    def recent_messages(self, chat: Chat) -> str:
        latest = chat.messages.order_by("-seq")[:RECENT_ROWS]
        watermark = chat.brief.last_consolidated
        rows = [
            [
                m.seq,
                shown.memory_mark(m.seq, watermark),
                m.role,
                m.token_count,
                when(m.created_at),
                m.content[:300],
            ]
            for m in reversed(latest)
        ]
        # The message list is newest first (MessageAdmin.ordering): the link continues this table.
        link = reverse("admin:conversations_message_changelist") + f"?chat__id__exact={chat.pk}"
        return format_html(
            '{}<p><a href="{}">all messages</a></p>',
            table(["seq", "memory", "role", "tokens", "created", "content"], rows),
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

    @admin.display(description=f"latest {RECENT_NOTES} daily notes")
    def daily_notes(self, chat: Chat) -> str:
        """The daily tier, read-only (written only by the flush hook), newest first."""
        latest = chat.daily_notes.order_by("-day")[:RECENT_NOTES]
        rows = [
            [
                formats.date_format(note.day),
                format_html_join(mark_safe("<br>"), "- {}", ((f["text"],) for f in note.facts)),
                note.extractor,
                when(note.updated_at),
            ]
            for note in latest
        ]
        return format_html(
            "{}<p>All of them, newest first: <code>GET {}</code> (with the owner's token).</p>",
            table(["day", "facts", "extractor", "updated"], rows),
            reverse("chat-notes", args=[chat.pk]),
        )


@admin.register(Message)
class MessageAdmin(ReadOnlyAdmin):
    list_display = [
        chat_column,
        "seq",
        "memory",
        "role",
        "content_column",
        "token_count",
        "model_variant",
        "created_at",
    ]
    list_filter = ["role"]
    list_select_related = ["chat", "chat__brief"]
    # Newest first, on the table's own UNIQUE (chat, seq) index: the model's ordering ("chat")
    # sorts by the chat's ordering, a join and a sort of every message.
    ordering = ["-chat_id", "-seq"]
    # A scan, meant for one chat's list (?chat__id__exact=): whole-table searches are slow.
    search_fields = ["content"]
    # Spares the second count, of the whole table, that a filtered page shows as "(N total)".
    # The paginator still counts the rows it pages: all of them on the unfiltered list.
    show_full_result_count = False

    @admin.display(description="memory")
    def memory(self, message: Message) -> str:
        return shown.memory_mark(message.seq, message.chat.brief.last_consolidated)

    @admin.display(description="content")
    def content_column(self, message: Message) -> str:
        return shown.content_preview(message.content)


@admin.register(Consolidation)
class ConsolidationAdmin(ReadOnlyAdmin):
    list_display = [
        "id",
        chat_column,
        "trigger",
        "status",
        "from_seq",
        "to_seq",
        "duration_ms",
        "lag_ms",
        "dropped",
    ]
    list_filter = ["status", TriggerFilter, "synchronous"]
    list_select_related = ["chat"]
    # Newest first, by the primary key: the model's ordering starts with the chat's (a join).
    ordering = ["-id"]
    # As on the message list: spares the "(N total)" count of a filtered page.
    show_full_result_count = False

    @admin.display(description="lag (ms)")
    def lag_ms(self, ledger: Consolidation) -> int | None:
        if ledger.finished_at is None or ledger.due_at is None:
            return None
        return lag_ms(ledger.due_at, ledger.finished_at)

    @admin.display(description="dropped details")
    def dropped(self, ledger: Consolidation) -> int:
        return len(ledger.dropped_details)


@admin.register(Brief)
class BriefAdmin(ReadOnlyAdmin):
    list_display = [
        "chat",
        "last_consolidated",
        "version",
        "degraded_warning",
        "next_attempt_at",
        "fallback_since",
    ]
    list_filter = ["degraded", ("fallback_since", admin.EmptyFieldListFilter)]

    @admin.display(description="degraded", ordering="degraded")
    def degraded_warning(self, brief: Brief) -> str:
        return shown.degraded_badge(brief.degraded)


def memory_notes(brief: Brief) -> list[tuple[str, object]]:
    """The brief's failure and fallback state, only what is set."""
    notes: list[tuple[str, object]] = []
    if brief.consecutive_failures:
        notes.append(("failed folds in a row", brief.consecutive_failures))
    if brief.next_attempt_at:
        notes.append(("next attempt", when(brief.next_attempt_at)))
    if brief.last_error:
        notes.append(("last error", brief.last_error))
    if brief.withheld:
        notes.append(("withheld messages (the summarizer refused them)", brief.withheld))
    if brief.fallback_since:
        reason = brief.fallback_reason or "the summarizer failed"
        notes.append(("offline fallback summary since", f"{when(brief.fallback_since)} ({reason})"))
    return notes


class ChatOwnerAdmin(UserAdmin):
    """Django's user admin, deleting a user's chats as the chat admin does (counted, not
    listed row by row)."""

    def get_deleted_objects(self, objs: Any, request: HttpRequest) -> tuple[Any, ...]:
        users = list(objs)
        chat_ids = list(Chat.objects.filter(owner__in=users).values_list("pk", flat=True))
        return counted_deletion(users, chat_ids, self.cascade_perms_lacking(request, users))

    def cascade_perms_lacking(self, request: HttpRequest, users: Sequence[User]) -> set[str]:
        """What Django's own page would ask for: the delete permission on each admin-registered
        model with rows that go with these users (their chats: delete_chat). A chat's history
        goes with it, as on the chat's own delete page."""
        lacking: set[str] = set()
        for model, owner_field in self.cascaded_models():
            model_admin = self.admin_site.get_model_admin(model)
            if model_admin.has_delete_permission(request):
                continue
            if model._base_manager.filter(**{f"{owner_field}__in": users}).exists():
                lacking.add(str(model._meta.verbose_name))
        return lacking

    def cascaded_models(self) -> list[tuple[type[Model], str]]:
        """The registered models whose rows a user's deletion cascades to, with the field that
        names the user."""
        return [
            (relation.related_model, relation.field.name)
            for relation in self.model._meta.related_objects
            if not relation.many_to_many
            and relation.on_delete is CASCADE
            and self.admin_site.is_registered(relation.related_model)
        ]


admin.site.unregister(User)
admin.site.register(User, ChatOwnerAdmin)
