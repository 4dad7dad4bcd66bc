"""Catching up when the provider recovers (issue 29). A failure that says nothing about the chat
(a rate limit, an outage, a spent quota, a bad key: ``PROVIDER_WIDE_KINDS``) puts the chat on
the retry ladder, up to an hour apart; once the provider answers again, waiting out that ladder
leaves memories stale for nothing. So the sweep lets such chats retry now once a model fold
anywhere has succeeded since they failed, and while none has, lets the longest-waiting one
retry early as the service's probe: one summarizer call per sweep however many chats wait.
A chat whose last failure came right after a provider-wide one is behind the outage too,
whatever that last failure's kind (a truncated answer amid rate limits). Content failures in a
row (the same invalid output again, a crash again) keep their ladder: another chat's success
says nothing about them."""

from datetime import datetime

from django.db.models import Max, OuterRef, Q, QuerySet, Subquery

from conversations.models import Brief, Consolidation, ConsolidationStatus
from memory_worker.engine import policy as engine
from memory_worker.summaries.contract import TRANSIENT_KINDS

PROVIDER_WIDE_KINDS = TRANSIENT_KINDS | {"quota", "client_error"}
# Succeeded ledger rows that are no sign the provider is back: a fallback fold's success is the
# offline summarizer's, and a person's edit of the summary calls no summarizer at all.
NOT_THE_PROVIDER = (
    engine.Trigger.HARD_BOUND_FALLBACK,
    engine.Trigger.SUMMARIZER_FALLBACK,
    engine.Trigger.EDIT,
)


def latest_model_success() -> datetime | None:
    """When a model summarizer call last committed a fold: a succeeded row with a summarizer
    call of its own, not a fallback's, not an edit's."""
    found: datetime | None = (
        Consolidation.objects.filter(status=ConsolidationStatus.SUCCEEDED, summarizer_calls__gt=0)
        .exclude(trigger__in=NOT_THE_PROVIDER)
        .aggregate(latest=Max("finished_at"))["latest"]
    )
    return found


def waiting_behind_the_provider(now: datetime) -> QuerySet[Brief]:
    """Briefs waiting for a retry whose failure streak the provider explains: the last failure
    is provider-wide, or the one before it in the streak was (a truncated answer, a crash or a
    refusal amid the outage: whatever its kind, the chat is behind because the provider was
    down). A streak that ends in two failures in a row of the chat's own (the same malformed
    output again, a crash again) keeps its ladder: a persistent failure, not the outage."""
    previous_kind = Subquery(
        Consolidation.objects.filter(chat_id=OuterRef("chat_id"), status=ConsolidationStatus.FAILED)
        .order_by("-id")
        .values("error_kind")[1:2]
    )
    return (
        Brief.objects.filter(next_attempt_at__gt=now)
        .annotate(previous_kind=previous_kind)
        .filter(
            Q(failure_kind__in=PROVIDER_WIDE_KINDS)
            | Q(consecutive_failures__gte=2, previous_kind__in=PROVIDER_WIDE_KINDS)
        )
    )


def catch_up(now: datetime, limit: int) -> list[int]:
    """Chats behind the provider (``waiting_behind_the_provider``) whose retry is moved to
    ``now`` (at most ``limit``): all that failed before the latest model success, else the one
    waiting longest (the probe). Conditional on the retry time still being later: a retry that
    came meanwhile wins."""
    waiting = waiting_behind_the_provider(now)
    latest = latest_model_success()
    recovered = waiting.filter(updated_at__lt=latest) if latest is not None else waiting.none()
    chosen = list(recovered.order_by("next_attempt_at").values_list("chat_id", flat=True)[:limit])
    if not chosen and limit > 0:
        chosen = list(waiting.order_by("updated_at").values_list("chat_id", flat=True)[:1])
    if chosen:
        Brief.objects.filter(chat_id__in=chosen, next_attempt_at__gt=now).update(
            next_attempt_at=now
        )
    return chosen
