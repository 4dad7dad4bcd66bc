"""Beat's two tasks, ``chatmem.recover_runs`` and ``chatmem.sweep``, run in a loop by a process of
its own, as a beat and worker on another host would run them (tests/test_host_clocks.py starts
it with a skewed clock). One pass every ``interval`` seconds until stdin closes; each pass prints
a line: PASS and a JSON object (this process's clock less the database's, the dead runs
refolded, the chats queued).

    python -m tests.support.clock_sweeper 0.2
"""

import json
import os
import sys
import threading
import time

import django

os.environ.setdefault("DJANGO_SETTINGS_MODULE", "chatmem_project.settings")
django.setup()

from django.db import close_old_connections  # noqa: E402
from django.utils import timezone  # noqa: E402

from conversations.rows import database_now  # noqa: E402
from memory_worker import tasks  # noqa: E402

PASS = "PASS"  # apart from the JSON log lines on the same output


def wait_for_eof(closed: threading.Event) -> None:
    sys.stdin.read()  # the test closes our stdin to stop us
    closed.set()


def main(interval: float) -> None:
    stdin_closed = threading.Event()
    threading.Thread(target=wait_for_eof, args=(stdin_closed,), daemon=True).start()
    while not stdin_closed.is_set():
        close_old_connections()
        now = database_now()
        skew = (timezone.now() - now).total_seconds()
        recovered = tasks.recover_runs()
        queued = tasks.sweep()
        print(
            PASS,
            json.dumps(
                {"db_now": now.isoformat(), "skew": skew, "recovered": recovered, "queued": queued}
            ),
            flush=True,
        )
        time.sleep(interval)  # the pass's pace, as beat's schedule: nothing waits on it


if __name__ == "__main__":
    main(float(sys.argv[1]))
