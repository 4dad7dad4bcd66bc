"""Gunicorn hooks (gunicorn reads ./gunicorn.conf.py by itself): Prometheus multiprocess mode
needs a clean sample directory at start and each dead worker's live gauges dropped; each worker
freezes its start-up objects out of the garbage collector's reach (chatmem_project.gc_tuning)."""

import os
import shutil
from typing import Any


def on_starting(server: Any) -> None:
    directory = os.environ.get("PROMETHEUS_MULTIPROC_DIR")
    if directory:
        shutil.rmtree(directory, ignore_errors=True)  # samples of a previous run
        os.makedirs(directory, exist_ok=True)


def post_worker_init(worker: Any) -> None:
    # Runs in the worker after it loaded the application (and, for gevent, after patching).
    from chatmem_project.gc_tuning import freeze_startup_objects

    freeze_startup_objects()


def child_exit(server: Any, worker: Any) -> None:
    if os.environ.get("PROMETHEUS_MULTIPROC_DIR"):
        from prometheus_client import multiprocess

        multiprocess.mark_process_dead(worker.pid)
