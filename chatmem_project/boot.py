"""What a server process does once it has loaded the application, before it serves: gunicorn
workers (gunicorn.conf.py's post_worker_init), Celery workers and beat (chatmem_project.celery)."""

from django.core.checks import run_checks
from django.core.exceptions import ImproperlyConfigured


def refuse_misconfigured_start() -> None:
    """Run Django's checks: an error (misordered deadlines, a greenlet server with no pool...)
    stops the process with the reason instead of surfacing later as expired locks, redelivered
    tasks or "too many clients"."""
    serious = [error for error in run_checks() if error.is_serious()]
    if serious:
        raise ImproperlyConfigured("\n".join(str(error) for error in serious))
