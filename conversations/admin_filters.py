"""The admin's list filters of chats and of the fold ledger."""

from django.contrib import admin
from django.db.models import F, QuerySet
from django.http import HttpRequest

from memory_worker.engine.policy import Trigger

# A count, not a verdict: whether a chat is behind depends on its policy (a token-budget chat may
# hold 100 short messages within its bound, a contract chat folds long before 60), and only the
# engine, in Python, per chat, can tell. "Backing off" is the cheap sign that folding is failing.
MANY_UNFOLDED = 60


class MemoryFilter(admin.SimpleListFilter):
    title = "memory"
    parameter_name = "memory"

    def lookups(self, request: HttpRequest, model_admin: admin.ModelAdmin) -> list[tuple[str, str]]:
        return [
            ("many_unfolded", f"Over {MANY_UNFOLDED} unfolded messages (any policy)"),
            ("backing_off", "Backing off (the last fold failed; retried with backoff)"),
            ("degraded", "Degraded (folds keep failing)"),
        ]

    def queryset(self, request: HttpRequest, queryset: QuerySet) -> QuerySet:
        if self.value() == "many_unfolded":
            unfolded = F("last_seq") - F("brief__last_consolidated")
            return queryset.alias(unfolded=unfolded).filter(unfolded__gt=MANY_UNFOLDED)
        if self.value() == "backing_off":
            # Set by every failed fold; cleared by the next success, or a retry that finds
            # nothing due (memory_worker.folding.retries.clear_failure_state).
            return queryset.filter(brief__next_attempt_at__isnull=False)
        if self.value() == "degraded":
            return queryset.filter(brief__degraded=True)
        return queryset


# Fixed, because the field's own filter lists its distinct values: a scan of the whole ledger on
# every page.
LEDGER_TRIGGERS = [(trigger.value, trigger.value) for trigger in Trigger]


class TriggerFilter(admin.SimpleListFilter):
    title = "trigger"
    parameter_name = "trigger"

    def lookups(self, request: HttpRequest, model_admin: admin.ModelAdmin) -> list[tuple[str, str]]:
        return LEDGER_TRIGGERS

    def queryset(self, request: HttpRequest, queryset: QuerySet) -> QuerySet:
        return queryset.filter(trigger=self.value()) if self.value() else queryset
