"""The ``/metrics`` endpoint: the process metrics (conversations.metrics) and the memory gauges,
read from the database at scrape time. One aggregate over every chat, computed at most once per
METRICS_STATE_CACHE_SECONDS per process, within a statement timeout on PostgreSQL."""

import hmac
import logging
import math
import threading
import time
from collections.abc import Callable, Iterator

from django.conf import settings
from django.db import DatabaseError, connection, transaction
from django.db.models import F, Q, Sum
from django.http import HttpRequest, HttpResponse
from prometheus_client import CONTENT_TYPE_LATEST, CollectorRegistry, generate_latest
from prometheus_client.core import GaugeMetricFamily
from prometheus_client.registry import Collector

from conversations.metrics import registry
from conversations.models import Chat
from conversations.services.fleet import queue_backlog

log = logging.getLogger("chatmem.metrics")


def memory_state_totals() -> dict[str, float]:
    """One aggregate query over every chat and its brief."""
    totals = Chat.objects.aggregate(
        unfolded=Sum(F("last_seq") - F("brief__last_consolidated")),
        degraded=Sum(1, filter=Q(brief__degraded=True)),
        behind=Sum(1, filter=Q(brief__next_attempt_at__isnull=False)),
    )
    return {name: float(total or 0) for name, total in totals.items()}


def within_statement_timeout(query: Callable[[], dict[str, float]]) -> dict[str, float]:
    """``query()`` given up by PostgreSQL past METRICS_STATE_QUERY_TIMEOUT_SECONDS (a
    DatabaseError): a scrape must not hold a backend busy, or wait on a locked table, for long.
    SET LOCAL ends with the transaction, so the connection goes back to requests unchanged."""
    if connection.vendor != "postgresql":
        return query()
    milliseconds = max(1, math.ceil(settings.METRICS_STATE_QUERY_TIMEOUT_SECONDS * 1000))
    with transaction.atomic():
        with connection.cursor() as cursor:
            cursor.execute(f"SET LOCAL statement_timeout = {milliseconds}")
        return query()


class MemoryStateCache:
    """The memory gauges of this process: computed at most once per METRICS_STATE_CACHE_SECONDS
    however often /metrics is scraped (it is open by default), one scrape at a time. When the
    query fails or times out, the last value is reported while it is under ten periods old;
    after that the gauges are left out rather than shown stale."""

    STALE_AFTER_PERIODS = 10

    def __init__(self) -> None:
        self.lock = threading.Lock()
        self.totals: dict[str, float] | None = None
        self.backlog: dict[str, int] | None = None
        self.computed_at = -math.inf
        self.tried_at = -math.inf

    def current(self) -> dict[str, float] | None:
        period = settings.METRICS_STATE_CACHE_SECONDS
        with self.lock:
            now = time.monotonic()
            if now - self.tried_at >= period:
                self.tried_at = now
                self.refresh(now)
            if now - self.computed_at > max(period, 1.0) * self.STALE_AFTER_PERIODS:
                return None
            return self.totals

    def refresh(self, now: float) -> None:
        # The broker's queues, asked at the same pace (None: no broker, or it did not answer).
        self.backlog = queue_backlog()
        try:
            self.totals = within_statement_timeout(memory_state_totals)
        except DatabaseError:
            # The database is down or the query ran out of time: the process metrics still go
            # out (its error counters are what the scrape is for now).
            log.warning("memory state metrics not refreshed", exc_info=True)
            return
        self.computed_at = now


MEMORY_STATE = MemoryStateCache()


class MemoryStateCollector(Collector):
    """Read from the database at scrape time (MemoryStateCache): three totals, not a per-chat
    series. Absent, not zero, when they could not be read."""

    def collect(self) -> Iterator[GaugeMetricFamily]:
        totals = MEMORY_STATE.current()
        backlog = MEMORY_STATE.backlog
        if backlog is not None:
            queued = GaugeMetricFamily(
                "chatmem_queue_tasks",
                "Tasks waiting in each memory queue of the broker.",
                labels=["queue"],
            )
            for queue, waiting in backlog.items():
                queued.add_metric([queue], waiting)
            yield queued
        if totals is None:
            return
        yield GaugeMetricFamily(
            "chatmem_unfolded_messages",
            "Messages not yet folded into a summary, all chats together (unfolded).",
            value=totals["unfolded"],
        )
        yield GaugeMetricFamily(
            "chatmem_degraded_chats",
            "Chats whose folds keep failing (marked degraded).",
            value=totals["degraded"],
        )
        yield GaugeMetricFamily(
            "chatmem_chats_waiting_retry",
            "Chats with a failed fold waiting for its retry time.",
            value=totals["behind"],
        )


def metrics_view(request: HttpRequest) -> HttpResponse:
    token = settings.METRICS_TOKEN
    # compare_digest: a plain != answers sooner the earlier a guess goes wrong.
    sent = request.headers.get("Authorization", "")
    if token and not hmac.compare_digest(sent.encode(), f"Bearer {token}".encode()):
        return HttpResponse("metrics need Authorization: Bearer <METRICS_TOKEN>\n", status=401)
    body = generate_latest(registry())
    try:
        state = CollectorRegistry()
        state.register(MemoryStateCollector())
        body += generate_latest(state)
    except DatabaseError:
        # The database is down: the process metrics still go out (its error counters are what
        # the scrape is for now); the memory gauges are absent rather than zero.
        log.warning("memory state metrics skipped: the database is unreachable", exc_info=True)
    return HttpResponse(body, content_type=CONTENT_TYPE_LATEST)
