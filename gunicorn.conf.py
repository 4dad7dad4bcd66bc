"""Gunicorn hooks (gunicorn reads ./gunicorn.conf.py by itself): Prometheus multiprocess mode
needs a clean sample directory at start and each dead worker's live gauges dropped; each worker
runs the start-up checks and freezes its start-up objects out of the garbage collector's reach
(chatmem_project.boot, chatmem_project.gc_tuning)."""

import os
import shutil
from typing import Any


def on_starting(server: Any) -> None:
    directory = os.environ.get("PROMETHEUS_MULTIPROC_DIR")
    if directory:
        shutil.rmtree(directory, ignore_errors=True)  # samples of a previous run
        os.makedirs(directory, exist_ok=True)


def post_worker_init(worker: Any) -> None:
    """Runs in each worker once it has loaded the application (for gevent, after patching).
    A check error stops the worker, and gunicorn halts ("Worker failed to boot")."""
    from chatmem_project.boot import refuse_misconfigured_start
    from chatmem_project.gc_tuning import freeze_startup_objects

    refuse_misconfigured_start()
    freeze_startup_objects()


def child_exit(server: Any, worker: Any) -> None:
    if os.environ.get("PROMETHEUS_MULTIPROC_DIR"):
        from prometheus_client import multiprocess

        multiprocess.mark_process_dead(worker.pid)
