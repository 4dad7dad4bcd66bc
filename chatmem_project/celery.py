"""The Celery application: consolidation workers (queue ``memory``, and ``memory-sweep`` for the
beat sweep) and the beat sweep."""

import os
import sys
from pathlib import Path
from typing import Any

from celery import Celery
from celery.signals import (
    beat_init,
    celeryd_after_setup,
    task_postrun,
    task_prerun,
    worker_init,
    worker_process_init,
    worker_process_shutdown,
)
from django.core.exceptions import ImproperlyConfigured

from chatmem_project import boot, gc_tuning

os.environ.setdefault("DJANGO_SETTINGS_MODULE", "chatmem_project.settings")

EX_CONFIG = 78  # sysexits.h: configuration error

app = Celery("chatmem")
app.config_from_object("django.conf:settings", namespace="CELERY")
app.autodiscover_tasks(["memory_worker"])


@worker_init.connect
@beat_init.connect
def refuse_misconfigured_start(**_: object) -> None:
    """Workers and beat run Django's checks at start-up: misordered deadlines stop them with
    the reason instead of surfacing later as expired locks or redelivered tasks.

    Celery's signal dispatch catches what a receiver raises and only logs it, so raising would
    not stop the process: it exits here, with EX_CONFIG, before any task is consumed."""
    try:
        boot.refuse_misconfigured_start()
    except ImproperlyConfigured as error:
        sys.stderr.write(f"chatmem: refusing to start, misconfigured:\n{error}\n")
        sys.stderr.flush()
        os._exit(EX_CONFIG)


@worker_init.connect
@beat_init.connect
def broker_timeouts_of_a_worker(**_: object) -> None:
    """The settings' broker timeouts are a turn's (REDIS_REQUEST_TIMEOUT_SECONDS); a worker's
    and beat's are longer: their publishes hold no request, and a consumer's read may wait on a
    busy Redis. Set before the process opens its first broker connection."""
    from django.conf import settings

    seconds = settings.BROKER_SOCKET_TIMEOUT_SECONDS
    app.conf.broker_transport_options = {
        **app.conf.broker_transport_options,
        "socket_connect_timeout": min(seconds, 2.0),
        "socket_timeout": seconds,
    }
    app.conf.broker_connection_timeout = min(seconds, 2.0)


@celeryd_after_setup.connect
def consume_the_sweep_queue(instance: Any = None, **_: object) -> None:
    """A worker of the ``memory`` queue also consumes the sweep's own queue, whatever its
    command line says (``-Q memory``, as deployed before the sweep had a queue of its own): the
    sweep is never left without a consumer, and it is reached after at most one fold task
    (kombu's Redis transport takes a worker's queues in turn, queue_order_strategy
    round_robin), not after the whole backlog. Runs after ``-Q`` was applied (Celery's
    documented place for it)."""
    from django.conf import settings

    queues = instance.app.amqp.queues
    if settings.CELERY_TASK_DEFAULT_QUEUE in queues.consume_from:
        queues.select_add(settings.MEMORY_SWEEP_QUEUE)


@worker_init.connect
def clear_previous_metrics(**_: object) -> None:
    """Prometheus multiprocess mode: the worker's PROMETHEUS_MULTIPROC_DIR is its own (not the
    web server's, which gunicorn clears when it starts), and the samples left in it by a
    previous run would be summed into this one's. Runs in the main process before the pool
    forks; Django is set up by then and this process has opened its own sample files, which are
    kept (``<kind>_<pid>.db``)."""
    directory = os.environ.get("PROMETHEUS_MULTIPROC_DIR")
    if not directory:
        return
    own = f"_{os.getpid()}.db"
    for samples in Path(directory).glob("*.db"):
        if not samples.name.endswith(own):
            samples.unlink(missing_ok=True)


@worker_init.connect
def serve_worker_metrics(**_: object) -> None:
    """Celery workers have no web server: with WORKER_METRICS_PORT set, the main process serves
    the metrics of all its pool processes (multiprocess mode) on that port."""
    from django.conf import settings

    if not settings.WORKER_METRICS_PORT:
        return
    from prometheus_client import start_http_server

    from conversations.metrics import registry

    start_http_server(settings.WORKER_METRICS_PORT, registry=registry())


@task_prerun.connect
@task_postrun.connect
def close_old_connections(sender: Any = None, **_: object) -> None:
    """A task's database connections live as a request's do: kept for CONN_MAX_AGE (0: closed
    after each task; with a pool, handed back to it), closed when unusable (settings:
    CELERY_DB_REUSE_MAX turns off the fixup's close of every connection around every task).
    Not for a task applied eagerly: it runs inside its caller's request or transaction."""
    if getattr(getattr(sender, "request", None), "is_eager", False):
        return
    from django.db import close_old_connections as close

    close()


@worker_process_init.connect
def freeze_startup_objects(**_: object) -> None:
    """Each pool process keeps the collector off what it inherited and imported at start
    (chatmem_project.gc_tuning), and counts itself in the worker's metrics."""
    gc_tuning.freeze_startup_objects()
    from conversations.metrics import WORKER_POOL_PROCESSES

    WORKER_POOL_PROCESSES.set(1)


@worker_process_shutdown.connect
def forget_pool_process(pid: int | None = None, **_: object) -> None:
    if pid and os.environ.get("PROMETHEUS_MULTIPROC_DIR"):
        from prometheus_client import multiprocess

        multiprocess.mark_process_dead(pid)
