"""/metrics is open by default, and its memory gauges are one aggregate over every chat (1.6-2 s
with 3,000,000 chats): anyone could keep PostgreSQL busy by scraping. The gauges are computed at
most once per METRICS_STATE_CACHE_SECONDS per process, and the query is given up past a
statement timeout; the scrape itself always answers."""

from __future__ import annotations

import threading
import time
from collections.abc import Iterator
from typing import Any

import psycopg
import pytest
from django.db import connection
from django.test.utils import CaptureQueriesContext

from tests.test_metrics import scrape, value

GAUGES = ("chatmem_unfolded_messages", "chatmem_degraded_chats", "chatmem_chats_waiting_retry")


@pytest.fixture(autouse=True)
def _fresh_memory_state(monkeypatch: Any) -> None:
    from conversations import metrics

    cache = getattr(metrics, "MemoryStateCache", None)
    if cache is not None:
        monkeypatch.setattr(metrics, "MEMORY_STATE", cache())


def gauge_names(samples: dict) -> set[str]:
    return {name for name, _ in samples} & set(GAUGES)


def chat_queries(queries: CaptureQueriesContext) -> list[str]:
    return [query["sql"] for query in queries if "conversations_chat" in query["sql"]]


@pytest.mark.django_db
def test_scrapes_within_the_period_read_the_database_once(client: Any, settings: Any) -> None:
    settings.METRICS_STATE_CACHE_SECONDS = 30.0
    with CaptureQueriesContext(connection) as queries:
        for _ in range(5):
            assert gauge_names(scrape(client)) == set(GAUGES)
    assert len(chat_queries(queries)) == 1


@pytest.mark.django_db
def test_the_gauges_are_read_again_after_the_period(
    client: Any, settings: Any, monkeypatch: Any
) -> None:
    settings.METRICS_STATE_CACHE_SECONDS = 30.0
    clock = [1000.0]
    monkeypatch.setattr(time, "monotonic", lambda: clock[0])
    with CaptureQueriesContext(connection) as queries:
        scrape(client)
        clock[0] += 29.0
        scrape(client)
        clock[0] += 2.0
        scrape(client)
    assert len(chat_queries(queries)) == 2


@pytest.fixture
def chat_table_locked(require_postgres: None) -> Iterator[None]:
    """Another session holds conversations_chat exclusively (as a long migration or a VACUUM
    FULL would): the aggregate waits for it. Released after 4 s at the latest, so a scrape
    without a statement timeout ends too, late."""
    params = connection.get_connection_params()
    locker = psycopg.connect(
        dbname=params.get("dbname") or connection.settings_dict["NAME"],
        user=params.get("user"),
        host=params.get("host"),
        port=params.get("port"),
        password=params.get("password"),
    )
    locker.execute("LOCK TABLE conversations_chat IN ACCESS EXCLUSIVE MODE")
    release = threading.Timer(4.0, locker.rollback)
    release.start()
    try:
        yield
    finally:
        release.cancel()
        locker.rollback()
        locker.close()


def timed_scrape(client: Any) -> tuple[float, dict]:
    started = time.monotonic()
    samples = scrape(client)
    return time.monotonic() - started, samples


def test_a_query_past_its_statement_timeout_is_given_up(
    client: Any, settings: Any, chat_table_locked: None
) -> None:
    settings.METRICS_STATE_QUERY_TIMEOUT_SECONDS = 0.3
    elapsed, samples = timed_scrape(client)
    assert elapsed < 2.0, elapsed
    assert "chatmem_enqueue_failures_total" in {name for name, _ in samples}  # still answered
    assert gauge_names(samples) == set()  # nothing read yet: absent, not zero


def test_after_a_timeout_the_last_value_is_reported(
    client: Any, settings: Any, require_postgres: None, request: Any
) -> None:
    from conversations.models import Brief, Chat

    settings.METRICS_STATE_CACHE_SECONDS = 0.0  # read again at every scrape
    settings.METRICS_STATE_QUERY_TIMEOUT_SECONDS = 0.3
    owner = request.getfixturevalue("user")
    chat = Chat.objects.create(owner=owner, title="t", last_seq=7)
    Brief.objects.update_or_create(chat=chat, defaults={"last_consolidated": 2})
    assert value(scrape(client), "chatmem_unfolded_messages") == 5
    request.getfixturevalue("chat_table_locked")
    elapsed, samples = timed_scrape(client)
    assert elapsed < 2.0, elapsed
    assert value(samples, "chatmem_unfolded_messages") == 5
