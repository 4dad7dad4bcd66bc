"""Gunicorn settings and hooks (gunicorn reads ./gunicorn.conf.py by itself): a stop lets the
turns in flight finish; Prometheus multiprocess mode needs a clean sample directory at start
(the web server's own: Celery workers keep theirs elsewhere) and each dead worker's live gauges
dropped; each worker runs the start-up checks and freezes its start-up objects out of the
garbage collector's reach (chatmem_project.boot, chatmem_project.gc_tuning). What gunicorn
refuses itself, before the application sees it, is answered in JSON (write_json_error)."""

import json
import math
import os
import shutil
import subprocess
import sys
from typing import Any

import gunicorn.util


def turn_lifetime_seconds() -> int:
    """The settings' WEB_GRACEFUL_TIMEOUT_SECONDS (a synchronous fold and the model's reply),
    read in a child process: importing the settings here would load them (and .env) into the
    master, whose forked workers would then keep those values and ignore gunicorn's -e ones."""
    script = "from django.conf import settings; print(settings.WEB_GRACEFUL_TIMEOUT_SECONDS)"
    read = subprocess.run(
        [sys.executable, "-c", script],
        cwd=os.path.dirname(os.path.abspath(__file__)),
        env={"DJANGO_SETTINGS_MODULE": "chatmem_project.settings", **os.environ},
        capture_output=True,
        text=True,
    )
    if read.returncode != 0:  # the workers would fail on the same settings: say why now
        raise RuntimeError(f"could not read the settings:\n{read.stderr}")
    return math.ceil(float(read.stdout.split()[-1]))


# On SIGTERM (a deploy, `docker compose stop`) workers stop accepting and finish the requests
# in flight for this long before they are killed. Gunicorn's 30 s default cut turns short: the
# model alone may take LLM_TIMEOUT_SECONDS (60), after a synchronous fold.
graceful_timeout = turn_lifetime_seconds()


def on_starting(server: Any) -> None:
    directory = os.environ.get("PROMETHEUS_MULTIPROC_DIR")
    if directory:
        # This server's own directory (never the Celery worker's): samples of its previous run.
        shutil.rmtree(directory, ignore_errors=True)
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


# What gunicorn's own refusals mean, as the API's error codes.
GUNICORN_ERROR_CODES = {
    400: "bad_request",
    403: "forbidden",
    414: "uri_too_long",
    417: "expectation_failed",
    431: "headers_too_large",
    500: "server_error",
    501: "not_implemented",
}


def write_json_error(sock: Any, status_int: int, reason: str, mesg: str) -> None:
    """gunicorn answers a request it refuses before the application (a request line over
    limit_request_line: 414; headers over their limits: 431; a malformed request: 400) with an
    HTML page and has no hook for its body, so this replaces the one function that writes it
    (workers call gunicorn.util.write_error): the API's JSON error shape instead, and
    x-should-retry: false on what a resend cannot change (all but a 500)."""
    detail = f"{reason}: {mesg}" if mesg else reason
    code = GUNICORN_ERROR_CODES.get(status_int, "bad_request")
    body = json.dumps({"detail": detail, "code": code}).encode()
    retry = "" if status_int == 500 else "x-should-retry: false\r\n"
    head = (
        f"HTTP/1.1 {status_int} {reason}\r\nConnection: close\r\n"
        f"Content-Type: application/json\r\nContent-Length: {len(body)}\r\n{retry}\r\n"
    )
    gunicorn.util.write_nonblock(sock, head.encode("latin-1") + body)


gunicorn.util.write_error = write_json_error
