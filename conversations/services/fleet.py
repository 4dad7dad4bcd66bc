"""How the fleet's memory work is doing, for the admin's fleet page: over the last hour and day,
the folds committed, failed, superseded and fallen back, the fold lag's p50 and p95, and
summarizer calls and tokens by model variant; now, the queue backlog, the degraded, failing and
paused chats, and the chats that need attention (degraded, failing, or not queued).

Cheap on a large ledger: every ledger figure reads only its window's rows, through the index on
``finished_at`` (a day of folds, not the million rows before it), in one query per figure; the
lag's percentiles are computed by PostgreSQL (percentile_cont), in Python on SQLite (the
embedded default). The chat counts and lists read partial indexes of the few degraded, failing,
paused or not-queued chats, not every chat."""

from collections.abc import Sequence
from dataclasses import dataclass
from datetime import datetime, timedelta
from statistics import quantiles

from django.conf import settings
from django.db import connection
from django.db.models import Count, F, Q, Sum

from conversations.models import Brief, Chat, Consolidation, ConsolidationStatus
from conversations.rows import database_now
from memory_worker.engine import policy as engine
from memory_worker.memory import redis_client

WINDOWS = (("last hour", timedelta(hours=1)), ("last day", timedelta(days=1)))
FALLBACK_TRIGGERS = [engine.Trigger.HARD_BOUND_FALLBACK, engine.Trigger.SUMMARIZER_FALLBACK]
ATTENTION_ROWS = 10


@dataclass(frozen=True, slots=True)
class Spend:
    variant: str  # the chats' model variant ("" the default)
    attempts: int  # fold attempts that finished (failed and superseded ones called it too)
    calls: int
    input_tokens: int
    output_tokens: int


@dataclass(frozen=True, slots=True)
class Window:
    label: str
    minutes: int
    committed: int  # folds that succeeded (an edit of the summary is not one)
    failed: int
    superseded: int
    fallen_back: int  # committed by the offline summarizer after the model one failed
    lag_p50_s: float | None  # finished_at - due_at of committed folds a turn asked for
    lag_p95_s: float | None
    spend: list[Spend]

    def per_minute(self, count: int) -> float:
        return count / self.minutes


@dataclass(frozen=True, slots=True)
class AttentionChat:
    chat_id: int
    title: str
    why: str  # degraded / failing / not queued
    unfolded: int
    consecutive_failures: int
    last_error: str


@dataclass(frozen=True, slots=True)
class Fleet:
    now: datetime
    windows: list[Window]
    degraded_chats: int
    failing_chats: int  # the last fold failed, not yet degraded
    paused_chats: int  # folds paused by a person
    backlog: dict[str, int] | None  # queue -> tasks waiting; None: no broker to ask
    attention: list[AttentionChat]


def fleet(now: datetime | None = None) -> Fleet:
    now = now or database_now()  # finished_at and due_at were stamped with the database's time
    return Fleet(
        now=now,
        windows=[window(label, now - span, span) for label, span in WINDOWS],
        degraded_chats=Brief.objects.filter(degraded=True).count(),
        failing_chats=Brief.objects.filter(consecutive_failures__gt=0, degraded=False).count(),
        paused_chats=Chat.objects.filter(folds_paused=True).count(),
        backlog=queue_backlog(),
        attention=attention(),
    )


def window(label: str, since: datetime, span: timedelta) -> Window:
    rows = Consolidation.objects.filter(finished_at__gte=since)
    succeeded = Q(status=ConsolidationStatus.SUCCEEDED) & ~Q(trigger=engine.Trigger.EDIT)
    counts = rows.aggregate(
        committed=Count("id", filter=succeeded),
        failed=Count("id", filter=Q(status=ConsolidationStatus.FAILED)),
        superseded=Count("id", filter=Q(status=ConsolidationStatus.SUPERSEDED)),
        fallen_back=Count("id", filter=succeeded & Q(trigger__in=FALLBACK_TRIGGERS)),
    )
    p50, p95 = lag_percentiles(since)
    spend = [
        Spend(row["variant"], row["attempts"], row["calls"], row["inputs"], row["outputs"])
        for row in rows.exclude(trigger=engine.Trigger.EDIT)
        .values(variant=F("chat__model_variant"))
        .annotate(
            attempts=Count("id"),
            calls=Sum("summarizer_calls"),
            inputs=Sum("input_tokens"),
            outputs=Sum("output_tokens"),
        )
        .order_by("-calls", "variant")
    ]
    return Window(
        label=label,
        minutes=int(span.total_seconds() // 60),
        lag_p50_s=p50,
        lag_p95_s=p95,
        spend=spend,
        **counts,
    )


LAG_PERCENTILES_SQL = """
    SELECT percentile_cont(0.5) WITHIN GROUP (ORDER BY lag),
           percentile_cont(0.95) WITHIN GROUP (ORDER BY lag)
    FROM (
        SELECT EXTRACT(EPOCH FROM finished_at - due_at) AS lag
        FROM conversations_consolidation
        WHERE finished_at >= %s AND status = 'succeeded' AND due_at IS NOT NULL
    ) AS lags
"""


def lag_percentiles(since: datetime) -> tuple[float | None, float | None]:
    if connection.vendor == "postgresql":
        with connection.cursor() as cursor:
            cursor.execute(LAG_PERCENTILES_SQL, [since])
            p50, p95 = cursor.fetchone()
        return (None, None) if p50 is None else (float(p50), float(p95))
    rows = Consolidation.objects.filter(
        finished_at__gte=since, status=ConsolidationStatus.SUCCEEDED, due_at__isnull=False
    ).values_list("finished_at", "due_at")
    lags = [(finished - due).total_seconds() for finished, due in rows if finished and due]
    return percentiles(lags)


def percentiles(values: Sequence[float]) -> tuple[float | None, float | None]:
    """p50 and p95 as percentile_cont interpolates them."""
    if not values:
        return None, None
    if len(values) == 1:
        return values[0], values[0]
    cuts = quantiles(values, n=100, method="inclusive")
    return cuts[49], cuts[94]


def queue_backlog() -> dict[str, int] | None:
    """Tasks waiting in each memory queue (the Redis broker's lists), None when there is no
    broker (in-process tasks) or it does not answer."""
    if not settings.REDIS_URL or settings.MEMORY_DISPATCH != "celery":
        return None
    queues = [settings.CELERY_TASK_DEFAULT_QUEUE, settings.MEMORY_SWEEP_QUEUE]
    try:
        client = redis_client(settings.CELERY_BROKER_URL)
        return {queue: int(client.llen(queue)) for queue in queues}
    except Exception:  # a broker that is down is shown as unknown, not a 500
        return None


def attention() -> list[AttentionChat]:
    """Degraded chats first, then failing ones (the last fold failed), then those whose fold
    the broker did not take (the sweep queues them); each list through its partial index."""
    fields = ("chat_id", "chat__title", "consecutive_failures", "last_error", "unfolded")
    unfolded = F("chat__last_seq") - F("last_consolidated")
    queries = (
        ("degraded", Brief.objects.filter(degraded=True).order_by("-consecutive_failures")),
        (
            "failing",
            Brief.objects.filter(consecutive_failures__gt=0, degraded=False).order_by(
                "-consecutive_failures"
            ),
        ),
        (
            "not queued",
            Brief.objects.filter(enqueue_missed_at__isnull=False).order_by("enqueue_missed_at"),
        ),
    )
    found: list[AttentionChat] = []
    seen: set[int] = set()
    for why, query in queries:
        for row in query.annotate(unfolded=unfolded).values(*fields)[:ATTENTION_ROWS]:
            if row["chat_id"] in seen:
                continue
            seen.add(row["chat_id"])
            found.append(
                AttentionChat(
                    chat_id=row["chat_id"],
                    title=row["chat__title"],
                    why=why,
                    unfolded=row["unfolded"],
                    consecutive_failures=row["consecutive_failures"],
                    last_error=row["last_error"],
                )
            )
    return found
