"""Real ``celery worker`` subprocesses for tests: same code, same settings, pointed at the test
database and the test Redis."""

import os
import signal
import subprocess
import sys
import time
from collections.abc import Callable
from pathlib import Path

from django.db import connection

ROOT = Path(__file__).resolve().parents[2]


def test_database_url() -> str:
    params = connection.settings_dict
    user = params.get("USER") or "postgres"
    host = params.get("HOST") or "127.0.0.1"
    port = params.get("PORT") or 5432
    return f"postgres://{user}@{host}:{port}/{params['NAME']}"


# Short, correctly ordered deadlines (checked at worker start-up) so that lock expiry and
# redelivery happen within a test's patience: a dead holder's lock lapses within 3 s (renewed
# every second while its holder lives), and hard limit + lock TTL (9 s) < visibility (10 s).
FAST_DEADLINES = {
    "MEMORY_LLM_TIMEOUT_SECONDS": "4",
    "MEMORY_TASK_SOFT_TIME_LIMIT": "5",
    "MEMORY_TASK_TIME_LIMIT": "6",
    "MEMORY_LOCK_TTL_SECONDS": "3",
    "BROKER_VISIBILITY_TIMEOUT": "10",
}


def worker_env(redis_url: str, **extra: str) -> dict[str, str]:
    env = {
        **os.environ,
        "DATABASE_URL": test_database_url(),
        "REDIS_URL": redis_url,
        "MEMORY_DISPATCH": "celery",
        "DB_CONN_MAX_AGE": "0",
        "PYTHONUNBUFFERED": "1",
    }
    env.update(extra)
    return env


class Worker:
    def __init__(
        self,
        redis_url: str,
        name: str,
        concurrency: int = 1,
        pool: str = "prefork",
        env: dict[str, str] | None = None,
    ) -> None:
        self.name = name
        self.log_path = ROOT / "artifacts" / f"worker-{name}-{os.getpid()}.log"
        self.log_path.parent.mkdir(exist_ok=True)
        self._log = self.log_path.open("w")
        self.process = subprocess.Popen(
            [
                sys.executable,
                "-m",
                "celery",
                "-A",
                "chatmem_project",
                "worker",
                "-Q",
                "memory",
                "-n",
                f"{name}@%h",
                "--concurrency",
                str(concurrency),
                "--pool",
                pool,
                "--loglevel",
                "INFO",
                "--without-heartbeat",
                "--without-mingle",
                "--without-gossip",
            ],
            cwd=ROOT,
            env=worker_env(redis_url, **(env or {})),
            stdout=self._log,
            stderr=subprocess.STDOUT,
            start_new_session=True,
        )

    def wait_ready(self, timeout: float = 60.0) -> None:
        assert wait_until(lambda: "ready." in self.log_path.read_text(), timeout), self.log()

    def log(self) -> str:
        return self.log_path.read_text()

    def signal(self, sig: int) -> None:
        os.killpg(self.process.pid, sig)

    def stop(self) -> None:
        if self.process.poll() is None:
            self.signal(signal.SIGTERM)
            try:
                self.process.wait(timeout=20)
            except subprocess.TimeoutExpired:
                self.signal(signal.SIGKILL)
                self.process.wait(timeout=10)
        self._log.close()


def wait_until(predicate: Callable[[], bool], timeout: float, interval: float = 0.05) -> bool:
    """Poll with a deadline: the synchronization primitive for cross-process tests."""
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        if predicate():
            return True
        time.sleep(interval)
    return predicate()


def point_celery_at(broker_url: str) -> str:
    """Make this process publish to ``broker_url`` (as a web process configured with it would);
    returns the previous URL. The producer pool is rebuilt so no old connection is reused."""
    from chatmem_project.celery import app

    previous = str(app.conf.broker_url)
    # Drop (do not close) the cached pools: a closed pool stays referenced by kombu's producer
    # pool and fails every later publish with "Acquire on closed pool".
    app._pool = None  # type: ignore[attr-defined]
    app.amqp._producer_pool = None  # type: ignore[attr-defined]
    app.conf["broker_url"] = broker_url
    return previous
