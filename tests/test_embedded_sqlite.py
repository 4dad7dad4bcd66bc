"""The quickstart's embedded default runs on SQLite, which CI's PostgreSQL runs never touch: the
turn's claim (UPDATE ... RETURNING the chat), the append in a transaction (UPDATE ... RETURNING
the counter, then the messages) and the plain-SQL reads (conversations.rows: SQLite's datetimes
and UUIDs come back as text) must work there too, beside the in-process folder."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parent.parent

SCRIPT = """
import json, django
django.setup()
from django.core.management import call_command
call_command("migrate", verbosity=0)
from django.contrib.auth import get_user_model
from rest_framework.test import APIClient
from conversations.models import Message
from memory_worker.coordination.dispatch import drain_inline

def client_of(name):
    client = APIClient()
    client.force_authenticate(get_user_model().objects.create_user(name))
    return client

owner, stranger = client_of("owner"), client_of("stranger")
chat = owner.post("/api/v1/chats/", {}, format="json").json()["id"]
turn, missing = f"/api/v1/chats/{chat}/turns/", "/api/v1/chats/99999/turns/"
statuses = [
    owner.post(turn, {"content": f"message {n}"}, format="json").status_code for n in range(30)
]
drain_inline()
from django.db import connection
from rest_framework.authtoken.models import Token
from tests.test_rows import mismatches
token = Token.objects.create(user=get_user_model().objects.get(username="owner"))
print(json.dumps({
    "vendor": connection.vendor,
    "statuses": statuses,
    "seqs": list(Message.objects.filter(chat_id=chat).values_list("seq", flat=True)),
    "stranger": stranger.post(turn, {"content": "x"}, format="json").status_code,
    "missing": owner.post(missing, {"content": "x"}, format="json").status_code,
    "folded": owner.get(f"/api/v1/chats/{chat}/brief/").json()["last_consolidated"],
    "plain_reads": mismatches(chat, token.key),
}))
"""


def test_turns_on_the_embedded_sqlite_default(tmp_path: Any) -> None:
    env = {
        **os.environ,
        "DJANGO_SETTINGS_MODULE": "chatmem_project.settings",
        "DATABASE_URL": f"sqlite:///{tmp_path}/embedded.sqlite3",
        "REDIS_URL": "",
        "CACHE_URL": "",
        "CHAT_BACKEND": "offline",
        "MEMORY_SUMMARIZER_BACKEND": "offline",
        "ALLOWED_HOSTS": "testserver",
        "LOG_LEVEL": "WARNING",
    }
    env.pop("MEMORY_DISPATCH", None)  # the embedded default: folds in process
    out = subprocess.run(
        [sys.executable, "-c", SCRIPT],
        cwd=ROOT,
        env=env,
        capture_output=True,
        text=True,
        timeout=120,
    )
    assert out.returncode == 0, out.stderr[-3000:]
    result = json.loads(out.stdout.strip().splitlines()[-1])
    assert result["vendor"] == "sqlite"
    assert result["statuses"] == [201] * 30
    assert result["seqs"] == list(range(1, 61))
    assert result["stranger"] == 404
    assert result["missing"] == 404
    assert result["folded"] > 0  # sliding-window folded in the background meanwhile
    assert result["plain_reads"] == []  # the hot path's plain SQL reads as the ORM does
