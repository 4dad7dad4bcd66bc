"""Schemathesis against the OpenAPI schema, on a live server: every check (server errors, status
codes, content types, response schemas, positive and negative data, auth, stateful links), over
at least 1,000 generated requests, must find nothing. The one per-operation exception and its
reason are in schemathesis.toml."""

from __future__ import annotations

import os
import re
import shutil
import subprocess
import sys
from pathlib import Path
from typing import Any

from rest_framework.authtoken.models import Token

from tests.conftest import require

ROOT = Path(__file__).resolve().parent.parent
EXAMPLES_PER_OPERATION = 50  # about 1,900 requests over the 16 operations
SEED = 20261123  # fixed, so a CI failure reproduces with the same command


def schemathesis_command() -> str:
    found = shutil.which("schemathesis", path=str(Path(sys.executable).parent))
    if found is None:
        require("schemathesis", "install the test extras: pip install -e '.[test]'")
    return str(found)


def test_schemathesis_finds_nothing(live_server: Any, user: Any, settings: Any) -> None:
    from memory_worker.dispatch import drain_inline

    # "Consolidate now" answers 503 when nothing can run a fold; the embedded runner can.
    settings.MEMORY_DISPATCH = "inline"
    token = Token.objects.create(user=user).key
    command = [
        schemathesis_command(),
        "run",
        f"{live_server.url}/api/v1/schema/?format=json",
        "--url",
        live_server.url,
        "-H",
        f"Authorization: Token {token}",
        "--max-examples",
        str(EXAMPLES_PER_OPERATION),
        "--seed",
        str(SEED),
        "--workers",
        "1",
    ]
    try:
        # The /v1/ operations' Bearer header (schemathesis.toml).
        env = {**os.environ, "CHATMEM_SCHEMATHESIS_TOKEN": token}
        run = subprocess.run(
            command, cwd=ROOT, capture_output=True, text=True, timeout=600, env=env
        )
    finally:
        drain_inline()  # folds it queued finish before the test database is flushed
    report = run.stdout[-6000:]
    assert run.returncode == 0, report
    assert "Configuration:    " + str(ROOT / "schemathesis.toml") in run.stdout
    generated = re.search(r"(\d+) generated", run.stdout)
    assert generated is not None, report
    assert int(generated.group(1)) >= 1000, report
    assert "No issues found" in run.stdout, report
