"""Prometheus metrics at /metrics: turn and model latency, folds by trigger and outcome, fold
duration, summarizer tokens, synchronous folds, the backlog read from the database.

/metrics is open by default, and its memory gauges are one aggregate over every chat: the gauges
are computed at most once per METRICS_STATE_CACHE_SECONDS per process, and the query is given up
past a statement timeout; the scrape itself always answers. A Celery worker keeps its samples in
a directory of its own and clears what a previous run left there when it starts, as gunicorn does
with its own."""

from __future__ import annotations

import os
import subprocess
import sys
import threading
import time
import urllib.request
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import psycopg
import pytest
from django.db import connection
from django.test.utils import CaptureQueriesContext
from prometheus_client.parser import text_string_to_metric_families

from bench.throughput import free_port
from conversations import metrics_endpoint
from conversations.models import Brief, Chat, Consolidation
from memory_worker.coordination.dispatch import RequestReason
from memory_worker.folding.execute import fold_once
from tests.support.workers import ROOT, Worker, wait_until
from tests.test_folds import (
    VAULT_RULE,
    chat_remembering_the_vault_rule,
    chat_with_planted_values,
    is_repair,
    summary_of,
)

pytestmark = pytest.mark.django_db

GAUGES = ("chatmem_unfolded_messages", "chatmem_degraded_chats", "chatmem_chats_waiting_retry")


@pytest.fixture(autouse=True)
def _memory_gauges_read_at_every_scrape(settings: Any, monkeypatch: Any) -> None:
    """These tests compare scrapes a moment apart: the memory gauges are read at every scrape,
    from a cache of their own, unless a test sets its own period (the cache tests below)."""
    settings.METRICS_STATE_CACHE_SECONDS = 0.0
    monkeypatch.setattr(metrics_endpoint, "MEMORY_STATE", metrics_endpoint.MemoryStateCache())


def scrape(client: Any, **headers: Any) -> dict[tuple[str, tuple[tuple[str, str], ...]], float]:
    response = client.get("/metrics", **headers)
    assert response.status_code == 200
    samples = {}
    for family in text_string_to_metric_families(response.content.decode()):
        for sample in family.samples:
            samples[(sample.name, tuple(sorted(sample.labels.items())))] = sample.value
    return samples


def value(samples: dict, name: str, **labels: str) -> float:
    return samples.get((name, tuple(sorted(labels.items()))), 0.0)


def test_turns_and_folds_show_up_in_the_metrics(client: Any, api: Any) -> None:
    before = scrape(client)
    chat_id = api.post("/api/v1/chats/", {"policy": "contract"}, format="json").json()["id"]
    for number in range(7):  # contract folds synchronously once past K + B = 10 messages
        response = api.post(
            f"/api/v1/chats/{chat_id}/turns/", {"content": f"turn {number}"}, format="json"
        )
        assert response.status_code == 201
    api.post(f"/api/v1/chats/{chat_id}/turns/", {"content": ""}, format="json")  # a 400
    fold_once(chat_id, RequestReason.MANUAL)
    after = scrape(client)

    def grew(name: str, **labels: str) -> float:
        return value(after, name, **labels) - value(before, name, **labels)

    assert grew("chatmem_turn_seconds_count", endpoint="turns", status="201") == 7
    assert grew("chatmem_turn_seconds_count", endpoint="turns", status="400") == 1
    assert grew("chatmem_model_seconds_count", mode="complete") == 7
    assert grew("chatmem_sync_folds_total") >= 1
    assert grew("chatmem_folds_total", trigger="hard_bound", outcome="succeeded") >= 1
    assert grew("chatmem_fold_seconds_count") >= 1
    assert grew("chatmem_summarizer_tokens_total", kind="input") > 0
    chat = Chat.objects.get(pk=chat_id)
    unfolded = value(after, "chatmem_unfolded_messages")
    assert unfolded == chat.last_seq - chat.brief.last_consolidated  # the only chat


def test_consolidation_lag_counts_from_the_turn_that_found_the_fold_due(
    client: Any, api: Any
) -> None:
    from datetime import timedelta

    from django.utils import timezone

    chat_id = api.post("/api/v1/chats/", {"policy": "sliding-window"}, format="json").json()["id"]
    for number in range(26):  # 52 messages: 12 beyond the tail of 40, a window fold is due
        api.post(f"/api/v1/chats/{chat_id}/turns/", {"content": f"turn {number}"}, format="json")
    before = scrape(client)
    due_at = timezone.now() - timedelta(seconds=3)
    assert fold_once(chat_id, RequestReason.TURN, due_at=due_at).status == "succeeded"
    after = scrape(client)
    ledger = Consolidation.objects.get(chat_id=chat_id, status="succeeded")
    assert ledger.due_at == due_at
    assert ledger.finished_at is not None and ledger.finished_at > due_at
    name = "chatmem_consolidation_lag_seconds"
    assert value(after, f"{name}_count") - value(before, f"{name}_count") == 1
    assert value(after, f"{name}_sum") - value(before, f"{name}_sum") >= 3


def test_dropped_details_and_guard_verdicts_are_counted(
    client: Any, api: Any, use_fake_openai: Any
) -> None:
    before = scrape(client)
    lossy = chat_with_planted_values(api)
    use_fake_openai.summary_fn = lambda body: summary_of("Order QX-7719 ships by 2031-04-02.")
    assert fold_once(lossy, RequestReason.MANUAL).status == "succeeded"
    repaired = chat_remembering_the_vault_rule(api)
    use_fake_openai.summary_fn = lambda body: summary_of(*([VAULT_RULE] if is_repair(body) else []))
    assert fold_once(repaired, RequestReason.MANUAL).status == "succeeded"
    after = scrape(client)

    def grew(name: str, **labels: str) -> float:
        return value(after, name, **labels) - value(before, name, **labels)

    [three] = Consolidation.objects.filter(chat_id=lossy).values_list("dropped_details", flat=True)
    [none] = Consolidation.objects.filter(chat_id=repaired).values_list(
        "dropped_details", flat=True
    )
    assert (len(three), none) == (3, [])
    assert grew("chatmem_fold_dropped_details_total") == 3
    assert grew("chatmem_fold_guard_total", outcome="spliced") == 1
    assert grew("chatmem_fold_guard_total", outcome="repair") == 0
    assert grew("chatmem_fold_guard_total", outcome="refused") == 0


def test_a_metrics_token_is_required_when_set(client: Any, settings: Any) -> None:
    settings.METRICS_TOKEN = "s3cret"
    assert client.get("/metrics").status_code == 401
    assert client.get("/metrics", HTTP_AUTHORIZATION="Bearer s3cret").status_code == 200


def test_a_scrape_with_the_database_down_still_has_the_process_metrics(
    client: Any, monkeypatch: Any
) -> None:
    """A failing gauge query must not make the scrape a 500: the error counters matter most
    then."""
    from django.db import OperationalError

    def down(self: Any) -> Any:
        raise OperationalError("connection refused")

    monkeypatch.setattr(metrics_endpoint.MemoryStateCollector, "collect", down)
    names = {name for name, _ in scrape(client)}
    assert "chatmem_enqueue_failures_total" in names  # a process counter, there from the start
    assert "chatmem_unfolded_messages" not in names  # absent, not a misleading zero


def test_multiprocess_mode_sums_what_each_process_counted(tmp_path: Any) -> None:
    """Two processes (as gunicorn workers or Celery pool processes) each count a fold; a third
    scrapes the shared directory and sees both."""
    root = Path(__file__).resolve().parent.parent
    env = {
        **os.environ,
        "PROMETHEUS_MULTIPROC_DIR": str(tmp_path / "metrics"),
        "DJANGO_SETTINGS_MODULE": "chatmem_project.settings",
        "DATABASE_URL": f"sqlite:///{tmp_path}/m.sqlite3",
    }
    fold = (
        "import django, logging; django.setup();"
        "logging.getLogger('chatmem.fold').info('fold', extra={'event': 'fold',"
        " 'trigger': 'window', 'outcome': 'succeeded', 'duration_ms': 5})"
    )
    for _ in range(2):
        subprocess.run([sys.executable, "-c", fold], cwd=root, env=env, check=True, timeout=60)
    scrape_script = (
        "import django; django.setup();"
        "from prometheus_client import generate_latest;"
        "from conversations.metrics import registry;"
        "print(generate_latest(registry()).decode())"
    )
    out = subprocess.run(
        [sys.executable, "-c", scrape_script],
        cwd=root,
        env=env,
        check=True,
        capture_output=True,
        text=True,
        timeout=60,
    ).stdout
    line = 'chatmem_folds_total{outcome="succeeded",trigger="window"} 2.0'
    assert line in out, out[-2000:]


# The memory gauges: computed once per period, given up past a statement timeout.


def gauge_names(samples: dict) -> set[str]:
    return {name for name, _ in samples} & set(GAUGES)


def chat_queries(queries: CaptureQueriesContext) -> list[str]:
    return [query["sql"] for query in queries if "conversations_chat" in query["sql"]]


def test_scrapes_within_the_period_read_the_database_once(client: Any, settings: Any) -> None:
    settings.METRICS_STATE_CACHE_SECONDS = 30.0
    with CaptureQueriesContext(connection) as queries:
        for _ in range(5):
            assert gauge_names(scrape(client)) == set(GAUGES)
    assert len(chat_queries(queries)) == 1


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


# A worker's own samples directory.


FOLD = (
    "import django, logging; django.setup();"
    "logging.getLogger('chatmem.fold').info('fold', extra={'event': 'fold',"
    " 'trigger': 'window', 'outcome': 'succeeded', 'duration_ms': 5})"
)
FOLDS_LINE = 'chatmem_folds_total{outcome="succeeded",trigger="window"}'


def count_a_fold_in(directory: Path, tmp_path: Path) -> None:
    """A process of a previous run (a dead pool process) leaves its samples in ``directory``."""
    env = {
        **os.environ,
        "PROMETHEUS_MULTIPROC_DIR": str(directory),
        "DJANGO_SETTINGS_MODULE": "chatmem_project.settings",
        "DATABASE_URL": f"sqlite:///{tmp_path}/m.sqlite3",
    }
    subprocess.run([sys.executable, "-c", FOLD], cwd=ROOT, env=env, check=True, timeout=60)


def scrape_port(port: int) -> str:
    with urllib.request.urlopen(f"http://127.0.0.1:{port}/metrics", timeout=5) as response:
        return str(response.read().decode())


@pytest.mark.worker
def test_a_starting_worker_clears_the_samples_of_its_previous_run(
    redis_url: str, require_postgres: None, tmp_path: Path
) -> None:
    directory = tmp_path / "worker-metrics"
    count_a_fold_in(directory, tmp_path)
    assert list(directory.glob("counter_*.db"))
    port = free_port()
    worker = Worker(
        redis_url,
        "metrics",
        env={"PROMETHEUS_MULTIPROC_DIR": str(directory), "WORKER_METRICS_PORT": str(port)},
    )
    try:
        worker.wait_ready()
        assert wait_until(lambda: "chatmem_" in scrape_port(port), 10), worker.log()
        # Its one pool process counted itself: the dashboard's worker count.
        pool = "chatmem_worker_pool_processes 1.0"
        assert wait_until(lambda: pool in scrape_port(port), 10), scrape_port(port)
        body = scrape_port(port)
    finally:
        worker.stop()
    assert "chatmem_sync_folds_total" in body  # the worker's own metrics are served...
    assert FOLDS_LINE not in body, body  # ...not the fold its previous run counted
