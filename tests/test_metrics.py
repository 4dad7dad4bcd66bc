"""Prometheus metrics at /metrics: turn and model latency, folds by trigger and outcome, fold
duration, summarizer tokens, synchronous folds, the backlog read from the database."""

from __future__ import annotations

from typing import Any

import pytest
from prometheus_client.parser import text_string_to_metric_families

from conversations.models import Chat, Consolidation
from memory_worker.folds import consolidate_once

pytestmark = pytest.mark.django_db


@pytest.fixture(autouse=True)
def _memory_gauges_read_at_every_scrape(settings: Any, monkeypatch: Any) -> None:
    """These tests compare scrapes a moment apart: no caching of the memory gauges here
    (tests/test_ops_metrics.py tests the cache)."""
    from conversations import metrics

    settings.METRICS_STATE_CACHE_SECONDS = 0.0
    monkeypatch.setattr(metrics, "MEMORY_STATE", metrics.MemoryStateCache())


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
    consolidate_once(chat_id, "manual")
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
    assert consolidate_once(chat_id, "turn", due_at=due_at).status == "succeeded"
    after = scrape(client)
    ledger = Consolidation.objects.get(chat_id=chat_id, status="succeeded")
    assert ledger.due_at == due_at
    assert ledger.finished_at is not None and ledger.finished_at > due_at
    name = "chatmem_consolidation_lag_seconds"
    assert value(after, f"{name}_count") - value(before, f"{name}_count") == 1
    assert value(after, f"{name}_sum") - value(before, f"{name}_sum") >= 3


def test_a_metrics_token_is_required_when_set(client: Any, settings: Any) -> None:
    settings.METRICS_TOKEN = "s3cret"
    assert client.get("/metrics").status_code == 401
    assert client.get("/metrics", HTTP_AUTHORIZATION="Bearer s3cret").status_code == 200


def test_a_scrape_with_the_database_down_still_has_the_process_metrics(
    client: Any, monkeypatch: Any
) -> None:
    """The scrape was a 500, losing the error counters that matter most then."""
    from django.db import OperationalError

    from conversations import metrics

    def down(self: Any) -> Any:
        raise OperationalError("connection refused")

    monkeypatch.setattr(metrics.MemoryStateCollector, "collect", down)
    names = {name for name, _ in scrape(client)}
    assert "chatmem_enqueue_failures_total" in names  # a process counter, there from the start
    assert "chatmem_unfolded_messages" not in names  # absent, not a misleading zero


def test_multiprocess_mode_sums_what_each_process_counted(tmp_path: Any) -> None:
    """Two processes (as gunicorn workers or Celery pool processes) each count a fold; a third
    scrapes the shared directory and sees both."""
    import os
    import subprocess
    import sys
    from pathlib import Path

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
