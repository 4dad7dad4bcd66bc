"""PostgreSQL outages: the connection pool's wait is bounded by
DB_CONNECT_TIMEOUT, not psycopg_pool's 30 s; pooled connections are checked before use, so a
restart fails no request; a fold whose database fails under it is retried by its task and does
not leave its ledger row "running"; a not-ready probe is a WARNING, not one ERROR per probe."""

from __future__ import annotations

import json
import logging
import os
import subprocess
import sys
import time
import typing
from datetime import timedelta
from pathlib import Path
from typing import Any

import psycopg
import pytest
from django.db import OperationalError, connection
from django.utils import timezone

from conversations import health
from conversations.models import Brief, Consolidation
from memory_worker import tasks
from memory_worker.coordination.deadlines import fold_heartbeat_stale_after
from memory_worker.coordination.runtime import chat_lock
from memory_worker.folding import commit as fold_commit
from memory_worker.folding import execute as folds
from memory_worker.folding import retries
from memory_worker.scheduling import sweep
from tests.conftest import contract_chat_after_turns

ROOT = Path(__file__).resolve().parent.parent


def in_a_process(env: dict[str, str], code: str) -> dict[str, Any]:
    """``code`` run after django.setup() in a fresh interpreter (the settings read ``env``); it
    prints one JSON line."""
    clean = {k: v for k, v in os.environ.items() if not k.startswith("DB_") and k != "DATABASE_URL"}
    result = subprocess.run(
        [sys.executable, "-c", f"import django, json, time\ndjango.setup()\n{code}"],
        cwd=ROOT,
        env={**clean, "DJANGO_SETTINGS_MODULE": "chatmem_project.settings", **env},
        capture_output=True,
        text=True,
        timeout=20,
    )
    assert result.returncode == 0, result.stderr[-3000:]
    found: dict[str, Any] = json.loads(result.stdout.strip().splitlines()[-1])
    return found


# --- A and B: the pool's configuration --------------------------------------------------------

POOL = """
from django.db import connection
pool = connection.pool
check = getattr(pool, "_check", None)
print(json.dumps({"timeout": pool.timeout, "check": getattr(check, "__qualname__", str(check))}))
"""


@pytest.mark.parametrize(("connect_timeout", "waits"), [("", 10.0), ("3", 3.0), ("0", 30.0)])
def test_the_pool_waits_the_connect_timeout_and_checks_its_connections(
    connect_timeout: str, waits: float
) -> None:
    """A request waited psycopg_pool's 30 s for a connection during an outage, whatever
    DB_CONNECT_TIMEOUT said; 0 (libpq's "no limit") keeps the pool's 30 s (0 would fail at once)."""
    env = {
        "DATABASE_URL": "postgres://u@127.0.0.1:1/x",
        "DB_POOL_MAX_SIZE": "4",
        "DB_CONNECT_TIMEOUT": connect_timeout,
    }
    assert in_a_process(env, POOL) == {"timeout": waits, "check": "ConnectionPool.check_connection"}


READYZ = """
from django.test import Client
started = time.monotonic()
response = Client().get("/readyz")
elapsed = time.monotonic() - started
print(json.dumps({"status": response.status_code, "body": response.json(), "elapsed": elapsed}))
"""


def test_with_a_pool_readyz_gives_up_after_the_connect_timeout() -> None:
    """Nothing listens on port 1: the pool's workers keep failing to connect, and /readyz must
    not wait psycopg_pool's 30 s for them."""
    env = {
        "DATABASE_URL": "postgres://u@127.0.0.1:1/x",
        "DB_POOL_MAX_SIZE": "2",
        "DB_CONNECT_TIMEOUT": "2",
    }
    found = in_a_process(env, READYZ)
    assert found["status"] == 503
    assert found["body"]["database"].startswith("error"), found
    assert 1.5 <= found["elapsed"] < 8, found


RESTART = """
import psycopg
from django.db import connection
def backend() -> int:
    with connection.cursor() as cursor:
        cursor.execute("SELECT pg_backend_pid()")
        return cursor.fetchone()[0]
before = backend()
connection.close()  # back to the pool, idle
params = {k: v for k, v in connection.get_connection_params().items() if k != "pool"}
with psycopg.connect(**params, autocommit=True) as admin:
    admin.execute("SELECT pg_terminate_backend(%s)", [before])
    while admin.execute("SELECT 1 FROM pg_stat_activity WHERE pid = %s", [before]).fetchone():
        time.sleep(0.02)
try:
    after = backend()
except Exception as error:
    after = type(error).__name__
print(json.dumps({"before": before, "after": after}))
"""


def test_a_pooled_connection_postgresql_dropped_fails_no_request(require_postgres: None) -> None:
    """After a PostgreSQL restart every idle pooled connection is dead; unchecked, each would
    fail the request the pool hands it to."""
    db = connection.settings_dict
    url = f"postgres://{db['USER']}:{db['PASSWORD']}@{db['HOST']}:{db['PORT']}/{db['NAME']}"
    env = {"DATABASE_URL": url, "DB_POOL_MAX_SIZE": "1", "DB_POOL_MIN_SIZE": "1"}
    found = in_a_process(env, RESTART)
    assert isinstance(found["after"], int), found  # not "OperationalError"
    assert found["after"] != found["before"]


# --- C: a fold whose database fails under it ------------------------------------------------


def queued_retries(monkeypatch: pytest.MonkeyPatch) -> list[dict[str, typing.Any]]:
    published: list[dict[str, typing.Any]] = []
    monkeypatch.setattr(tasks.fold_chat, "apply_async", lambda **options: published.append(options))
    return published


def lock_is_free(chat_id: int) -> bool:
    lock = chat_lock()
    if not lock.acquire_or_mark_pending(chat_id, "probe"):
        return False
    lock.release(chat_id, "probe")
    return True


@pytest.fixture
def ladder(settings: Any) -> Any:
    settings.MEMORY_FAILURE_BACKOFF_SECONDS = 30
    settings.MEMORY_FAILURE_BACKOFF_MAX_SECONDS = 3600
    return settings


@pytest.mark.django_db
def test_a_fold_whose_commit_fails_on_the_database_is_retried(
    api: Any, ladder: Any, monkeypatch: pytest.MonkeyPatch
) -> None:
    """The task retries itself: failing and being acknowledged would lose the manual request
    and leave the ledger row "running" until the recovery marks it interrupted. The row says
    interrupted, not failed: not the chat's failure."""
    published = queued_retries(monkeypatch)
    chat_id = contract_chat_after_turns(api, 6)  # 12 unfolded messages: a fold is due

    def lost(write: fold_commit.FoldWrite) -> bool:
        raise OperationalError("server closed the connection unexpectedly")

    monkeypatch.setattr(fold_commit, "commit_in_one_statement", lost)
    monkeypatch.setattr(fold_commit, "commit_in_transaction", lost)
    assert tasks.fold_chat(chat_id, "manual", due_at=1000.0) == ["database_error"]
    row = Consolidation.objects.get(chat_id=chat_id)
    assert (row.status, row.error) == ("interrupted", "OperationalError (database error)")
    assert row.finished_at is not None
    brief = Brief.objects.get(chat_id=chat_id)
    # Not the chat's failure: no backoff, not degraded, nothing folded.
    assert (brief.consecutive_failures, brief.next_attempt_at, brief.degraded) == (0, None, False)
    assert brief.last_consolidated == 0
    assert lock_is_free(chat_id)
    # A manual request stays manual; the lag still counts from the turn that found it due.
    assert len(published) == 1
    assert published[0]["args"] == (chat_id, "manual")
    assert published[0]["kwargs"] == {"db_retries": 1, "due_at": 1000.0}
    assert 0.8 * 30 <= published[0]["countdown"] <= 1.2 * 30

    # The next retry waits twice as long; the last one gives up with the error.
    assert tasks.fold_chat(chat_id, "manual", db_retries=1) == ["database_error"]
    assert published[1]["kwargs"] == {"db_retries": 2}
    assert 0.8 * 60 <= published[1]["countdown"] <= 1.2 * 60
    with pytest.raises(OperationalError):
        tasks.fold_chat(chat_id, "manual", db_retries=retries.DATABASE_ERROR_RETRIES)
    assert len(published) == 2
    assert lock_is_free(chat_id)

    # The database is back: the retry folds.
    monkeypatch.undo()
    published = queued_retries(monkeypatch)
    assert tasks.fold_chat(chat_id, "manual", db_retries=1) == ["succeeded"]
    assert Brief.objects.get(chat_id=chat_id).last_consolidated > 0
    assert published == []
    assert set(Consolidation.objects.filter(chat_id=chat_id).values_list("status", flat=True)) == {
        "interrupted",
        "succeeded",
    }


def test_a_connection_killed_during_the_summarizer_call(
    require_postgres: None, api: Any, ladder: Any, monkeypatch: pytest.MonkeyPatch
) -> None:
    """The real thing: the worker's backend is terminated while the summarizer answers (no
    transaction is open then); the commit fails, the row is marked interrupted on a new connection
    and the task queues its retry."""
    published = queued_retries(monkeypatch)
    chat_id = contract_chat_after_turns(api, 6)
    real = folds.get_summarizer
    params = {k: v for k, v in connection.get_connection_params().items() if k != "pool"}

    class Killed:
        def __init__(self, inner: Any) -> None:
            self.inner = inner

        def summarize(self, *args: Any, **kwargs: Any) -> Any:
            assert not connection.in_atomic_block
            pid = connection.connection.info.backend_pid
            with psycopg.connect(**params, autocommit=True) as admin:
                admin.execute("SELECT pg_terminate_backend(%s)", [pid])
                while admin.execute(
                    "SELECT 1 FROM pg_stat_activity WHERE pid = %s", [pid]
                ).fetchone():
                    time.sleep(0.02)
            return self.inner.summarize(*args, **kwargs)

    monkeypatch.setattr(folds, "get_summarizer", lambda cap: Killed(real(cap)))
    assert tasks.fold_chat(chat_id, "manual") == ["database_error"]
    row = Consolidation.objects.get(chat_id=chat_id)
    assert row.status == "interrupted" and "database error" in row.error
    assert Brief.objects.get(chat_id=chat_id).last_consolidated == 0
    assert [options["args"] for options in published] == [(chat_id, "manual")]
    assert lock_is_free(chat_id)


# --- D: a not-ready probe ---------------------------------------------------------------------


@pytest.mark.django_db
def test_a_not_ready_probe_is_a_warning_not_an_error(
    client: Any, monkeypatch: pytest.MonkeyPatch, caplog: pytest.LogCaptureFixture
) -> None:
    """django.request logged every 503 of /readyz at ERROR: one ERROR per probe per replica for
    as long as the database was down."""
    monkeypatch.setattr(health, "database_state", lambda: "error: OperationalError")
    with caplog.at_level(logging.INFO):
        response = client.get("/readyz")
    assert response.status_code == 503
    assert response.json()["database"] == "error: OperationalError"
    assert [r for r in caplog.records if r.levelno >= logging.ERROR] == []
    warnings = [r for r in caplog.records if r.levelno == logging.WARNING]
    assert [(r.name, getattr(r, "event", None)) for r in warnings] == [
        ("chatmem.health", "not_ready")
    ]
    assert "OperationalError" in warnings[0].getMessage()


@pytest.mark.django_db
def test_folds_interrupted_by_outages_are_not_counted_as_deaths(api: Any, ladder: Any) -> None:
    """Three folds a database outage interrupted, then a run the sweep finds dead: that is the
    chat's first death, interrupted and folded again at once, not a crash counted on the brief
    (which would push the chat into backoff after an outage)."""
    chat_id = contract_chat_after_turns(api, 6)
    row = {"chat_id": chat_id, "trigger": "window", "from_seq": 1, "to_seq": 12, "base_version": 0}
    for _outage in range(sweep.CRASH_AFTER_INTERRUPTIONS):
        Consolidation.objects.create(
            **row, status="interrupted", error="OperationalError (database error)"
        )
    dead = Consolidation.objects.create(**row)
    stopped = timezone.now() - timedelta(seconds=fold_heartbeat_stale_after() + 1)
    Consolidation.objects.filter(pk=dead.pk).update(heartbeat_at=stopped)  # its worker died
    assert sweep.deaths_in_a_row(dead) == 1
    refold = sweep.interrupt_run(dead, timezone.now())
    assert refold is not None and refold.chat_id == chat_id
    dead.refresh_from_db()
    assert (dead.status, dead.error) == ("interrupted", sweep.INTERRUPTED)
    brief = Brief.objects.get(chat_id=chat_id)
    assert (brief.consecutive_failures, brief.next_attempt_at) == (0, None)
