"""A turn request sent by hand over ``http.client``, for tests against a real server (uvicorn,
gunicorn) where Django's test client cannot go."""

import http.client
import json
import subprocess
import time
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path
from typing import Any

import pytest

from bench.throughput import free_port, gunicorn_command

ROOT = Path(__file__).resolve().parents[2]


def send_turn(
    connection: http.client.HTTPConnection,
    token: str,
    chat_id: int,
    body: dict[str, Any],
    accept: str,
) -> None:
    connection.request(
        "POST",
        f"/api/v1/chats/{chat_id}/turns/",
        body=json.dumps(body),
        headers={
            "Authorization": f"Token {token}",
            "Content-Type": "application/json",
            "Accept": accept,
        },
    )


def answers(port: int) -> bool:
    """Whether a server on 127.0.0.1:``port`` answers /healthz."""
    try:
        probe = http.client.HTTPConnection("127.0.0.1", port, timeout=2)
        probe.request("GET", "/healthz")
        return probe.getresponse().status == 200
    except OSError:
        return False


@contextmanager
def serving_gunicorn(
    env: dict[str, str], worker_class: str, threads: int, deadline: float
) -> Iterator[int]:
    """A real gunicorn (one worker) serving chatmem with ``env`` on a free port, once it answers
    /healthz (the test fails if it exits or is not up within ``deadline`` seconds); stopped
    after. Yields the port."""
    port = free_port()
    command = gunicorn_command(port, workers=1, threads=threads, worker_class=worker_class)
    server = subprocess.Popen(
        command, cwd=ROOT, env=env, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True
    )
    try:
        until = time.monotonic() + deadline
        while not answers(port):
            if server.poll() is not None:
                pytest.fail(f"gunicorn -k {worker_class} exited: {server.stdout.read()}")  # type: ignore[union-attr]
            assert time.monotonic() < until, f"gunicorn -k {worker_class} did not answer /healthz"
            time.sleep(0.1)  # still booting: poll until the deadline
        yield port
    finally:
        server.terminate()
        try:
            server.wait(deadline)
        except subprocess.TimeoutExpired:
            server.kill()  # never leave a server running behind a failed shutdown
            server.wait(deadline)
