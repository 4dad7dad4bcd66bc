"""The Celery application: consolidation workers (queue ``memory``) and the beat sweep."""

import os

from celery import Celery
from celery.signals import beat_init, worker_init

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
