"""A Celery worker keeps its Prometheus samples in a directory of its own and clears what a
previous run left there when it starts, as gunicorn does with its own: a directory shared with
gunicorn was cleared by whichever started last, and what was left was summed into both."""

from __future__ import annotations

import subprocess
import sys
import urllib.request
from pathlib import Path

import pytest

from bench.throughput import free_port
from tests.workers import ROOT, Worker, wait_until

FOLD = (
    "import django, logging; django.setup();"
    "logging.getLogger('chatmem.fold').info('fold', extra={'event': 'fold',"
    " 'trigger': 'window', 'outcome': 'succeeded', 'duration_ms': 5})"
)
FOLDS_LINE = 'chatmem_folds_total{outcome="succeeded",trigger="window"}'


def count_a_fold_in(directory: Path, tmp_path: Path) -> None:
    """A process of a previous run (a dead pool process) leaves its samples in ``directory``."""
    import os

    env = {
        **os.environ,
        "PROMETHEUS_MULTIPROC_DIR": str(directory),
        "DJANGO_SETTINGS_MODULE": "chatmem_project.settings",
        "DATABASE_URL": f"sqlite:///{tmp_path}/m.sqlite3",
    }
    subprocess.run([sys.executable, "-c", FOLD], cwd=ROOT, env=env, check=True, timeout=60)


def scrape(port: int) -> str:
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
        "ops-metrics",
        env={"PROMETHEUS_MULTIPROC_DIR": str(directory), "WORKER_METRICS_PORT": str(port)},
    )
    try:
        worker.wait_ready()
        assert wait_until(lambda: "chatmem_" in scrape(port), 10), worker.log()
        body = scrape(port)
    finally:
        worker.stop()
    assert "chatmem_sync_folds_total" in body  # the worker's own metrics are served...
    assert FOLDS_LINE not in body, body  # ...not the fold its previous run counted
