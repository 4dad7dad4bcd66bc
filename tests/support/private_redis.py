"""A private ``redis-server`` on a free port, for tests and the chaos script that must stop and
restart Redis: the shared one (6379) is never touched. No persistence, so a restart loses
everything (queue, locks, pending set), like a crashed cache without a volume."""

import shutil
import signal
import socket
import subprocess
import tempfile
from pathlib import Path

import redis

from tests.support.workers import wait_until


def free_port() -> int:
    with socket.socket() as probe:
        probe.bind(("127.0.0.1", 0))
        return int(probe.getsockname()[1])


def redis_server_available() -> bool:
    return shutil.which("redis-server") is not None


class PrivateRedis:
    def __init__(self, port: int | None = None) -> None:
        self.port = port or free_port()
        self.url = f"redis://127.0.0.1:{self.port}/0"
        self.process: subprocess.Popen[bytes] | None = None
        self._dir = tempfile.mkdtemp(prefix="chatmem-redis-")
        self.log_path = Path(self._dir) / "redis.log"

    def start(self, timeout: float = 10.0) -> None:
        """Start (or restart, on the same port) and wait until it answers PING."""
        self.process = subprocess.Popen(
            [
                "redis-server",
                "--port",
                str(self.port),
                "--bind",
                "127.0.0.1",
                "--save",
                "",
                "--appendonly",
                "no",
                "--dir",
                self._dir,
                "--logfile",
                str(self.log_path),
            ],
            stdout=subprocess.DEVNULL,
            stderr=subprocess.DEVNULL,
            start_new_session=True,
        )
        assert wait_until(self.answers, timeout), f"redis-server on {self.port} did not start"

    def answers(self) -> bool:
        try:
            return bool(redis.Redis.from_url(self.url, socket_connect_timeout=0.5).ping())
        except redis.RedisError:
            return False

    def crash(self) -> None:
        """SIGKILL: clients see their connections reset, and all data is gone."""
        self._end(signal.SIGKILL)

    def stop(self) -> None:
        self._end(signal.SIGTERM)
        shutil.rmtree(self._dir, ignore_errors=True)

    def _end(self, sig: int) -> None:
        if self.process is not None and self.process.poll() is None:
            self.process.send_signal(sig)
            self.process.wait(timeout=10)
        self.process = None
