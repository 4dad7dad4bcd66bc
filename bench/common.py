"""What the benchmarks share: Django set up in this process against a chosen database, an API
client with a fresh user's token, the machine line, and writing the report."""

from __future__ import annotations

import http.client
import json
import os
import platform
import subprocess
import sys
import time
import uuid
from collections.abc import Callable, Mapping, Sequence
from pathlib import Path
from typing import Any
from urllib.parse import urlparse


def ensure_database(database_url: str) -> None:
    """Create a PostgreSQL database named by the URL if it does not exist (SQLite: nothing)."""
    parsed = urlparse(database_url)
    if not parsed.scheme.startswith("postgres"):
        return
    import psycopg

    name = parsed.path.lstrip("/")
    admin = parsed._replace(path="/postgres").geturl().replace("postgres://", "postgresql://", 1)
    with psycopg.connect(admin, autocommit=True) as connection:
        found = connection.execute("SELECT 1 FROM pg_database WHERE datname = %s", (name,))
        if found.fetchone() is None:
            connection.execute(f'CREATE DATABASE "{name}"')


def configure_django(database_url: str, environment: Mapping[str, str]) -> str:
    """Environment first, then django.setup() and migrate. Returns the database vendor."""
    os.environ.update(
        {
            "DJANGO_SETTINGS_MODULE": "chatmem_project.settings",
            "DATABASE_URL": database_url,
            "ALLOWED_HOSTS": "testserver,127.0.0.1,localhost",
            **environment,
        }
    )
    # Failures are counted in the results; the app's own log would drown them.
    os.environ.setdefault("LOG_LEVEL", "CRITICAL")
    import django

    django.setup()
    from django.core.management import call_command
    from django.db import connection

    call_command("migrate", verbosity=0, interactive=False)
    return str(connection.vendor)


def api_client() -> Any:
    from django.contrib.auth import get_user_model
    from rest_framework.authtoken.models import Token
    from rest_framework.test import APIClient

    user = get_user_model().objects.create_user(username=f"bench-{uuid.uuid4().hex[:10]}")
    client = APIClient()
    client.credentials(HTTP_AUTHORIZATION=f"Token {Token.objects.create(user=user).key}")
    return client


def create_chat(client: Any, name: str, preset: str, overrides: Mapping[str, Any]) -> int:
    """A chat through the API (``api_client``'s client); exits with the API's answer if refused."""
    response = client.post(
        "/api/v1/chats/",
        {"title": name, "policy": preset, "policy_overrides": dict(overrides)},
        format="json",
    )
    if response.status_code != 201:
        raise SystemExit(f"{name}: creating the chat failed: {response.json()}")
    return int(response.json()["id"])


def machine_info() -> dict[str, Any]:
    """The machine a report was measured on."""
    return {
        "platform": platform.platform(),
        "machine": platform.machine(),
        "processor": platform.processor(),
        "cpu_count": os.cpu_count(),
        "python": sys.version.split()[0],
    }


def machine_line() -> str:
    return f"{platform.platform()}, {os.cpu_count()} CPUs, Python {sys.version.split()[0]}"


def write_report(report: Mapping[str, Any], out: str) -> None:
    print(json.dumps(report, indent=2))
    save_report(report, out)


def save_report(report: Mapping[str, Any], out: str) -> Path:
    """``report`` as JSON at ``out`` (its folder made if need be); the path written."""
    path = Path(out)
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(json.dumps(report, indent=2, ensure_ascii=False) + "\n")
    return path


HISTORY_BATCH = 5000


def insert_history(
    chat_ids: Sequence[int], messages: int, content: Callable[[int], str], tokens: int
) -> None:
    """Give each chat ``messages`` messages (seq 1.., user and assistant by turns, each of
    ``tokens`` tokens, text ``content(seq)``) in bulk, and set its counter row to match; the
    brief is left to the caller (what is folded differs per benchmark)."""
    from conversations.models import Chat, Message

    rows = (
        Message(
            chat_id=chat_id,
            seq=seq,
            role="user" if seq % 2 else "assistant",
            content=content(seq),
            token_count=tokens,
        )
        for chat_id in chat_ids
        for seq in range(1, messages + 1)
    )
    batch: list[Message] = []
    for row in rows:
        batch.append(row)
        if len(batch) == HISTORY_BATCH:
            Message.objects.bulk_create(batch)
            batch = []
    Message.objects.bulk_create(batch)
    Chat.objects.filter(pk__in=chat_ids).update(last_seq=messages)


def wait_for(port: int, path: str, seconds: float = 30) -> None:
    deadline = time.monotonic() + seconds
    while time.monotonic() < deadline:
        try:
            connection = http.client.HTTPConnection("127.0.0.1", port, timeout=2)
            connection.request("GET", path)
            connection.getresponse().read()
            return
        except OSError:
            time.sleep(0.2)  # still starting: poll until the deadline
    raise SystemExit(f"nothing answered on port {port} within {seconds} s")


ROOT = Path(__file__).resolve().parent.parent


def start(command: list[str], env: dict[str, str], log_name: str) -> subprocess.Popen:
    """``command`` from the project's root, its output in ``artifacts/<log_name>``."""
    log = open(ROOT / "artifacts" / log_name, "w")  # noqa: SIM115
    return subprocess.Popen(command, cwd=ROOT, env=env, stdout=log, stderr=log)


def start_fake_model(
    port: int, latency: float, reply_words: int | None, env: dict[str, str], log_name: str
) -> subprocess.Popen:
    """The fake OpenAI-compatible server in its own process: chat replies after ``latency``
    seconds, ``reply_words`` long (None: its own short replies); summaries at once."""
    command = [sys.executable, "-m", "tests.support.fake_openai", "--port", str(port)]
    command += ["--latency", str(latency)]
    if reply_words is not None:
        command += ["--reply-words", str(reply_words)]
    return start(command, env, log_name)
