"""The Celery application: consolidation workers (queue ``memory``) and the beat sweep."""

import os

from celery import Celery
from celery.signals import beat_init, worker_init, worker_process_shutdown

os.environ.setdefault("DJANGO_SETTINGS_MODULE", "chatmem_project.settings")

app = Celery("chatmem")
app.config_from_object("django.conf:settings", namespace="CELERY")
app.autodiscover_tasks(["memory_worker"])


@worker_init.connect
@beat_init.connect
def refuse_misconfigured_start(**_: object) -> None:
    """Workers and beat run Django's checks at start-up: misordered deadlines stop them with
    the reason instead of surfacing later as expired locks or redelivered tasks."""
    from django.core.checks import run_checks
    from django.core.exceptions import ImproperlyConfigured

    serious = [error for error in run_checks() if error.is_serious()]
    if serious:
        raise ImproperlyConfigured("\n".join(str(error) for error in serious))


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


@worker_process_shutdown.connect
def forget_pool_process(pid: int | None = None, **_: object) -> None:
    if pid and os.environ.get("PROMETHEUS_MULTIPROC_DIR"):
        from prometheus_client import multiprocess

        multiprocess.mark_process_dead(pid)
