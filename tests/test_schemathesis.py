"""Schemathesis against the OpenAPI schema, on a live server: every check (server errors, status
codes, content types, response schemas, positive and negative data, auth), every phase including
the stateful one (links inferred from the schema's dependencies), by two users at once, each in a
process of its own against the same server, must find nothing. The one per-operation exception
and its reason are in schemathesis.toml.

SCHEMATHESIS_MAX_EXAMPLES sets the examples per operation and user (default 25: about 1,900
generated cases in all, what CI's budget allows); docs/testing.md has the longer run's command."""

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
EXAMPLES_PER_OPERATION = int(os.environ.get("SCHEMATHESIS_MAX_EXAMPLES") or 25)
SEED = 20261123  # fixed, so a CI failure reproduces with the same command
TIMEOUT = 600 + 20 * EXAMPLES_PER_OPERATION


def schemathesis_command() -> str:
    found = shutil.which("schemathesis", path=str(Path(sys.executable).parent))
    if found is None:
        require("schemathesis", "install the test extras: pip install -e '.[test]'")
    return str(found)


def start_run(url: str, token: str, seed: int) -> subprocess.Popen[str]:
    command = [
        schemathesis_command(),
        "run",
        f"{url}/api/v1/schema/?format=json",
        "--url",
        url,
        "-H",
        f"Authorization: Token {token}",
        "--max-examples",
        str(EXAMPLES_PER_OPERATION),
        "--seed",
        str(seed),
        "--workers",
        "1",
    ]
    # The /v1/ operations' Bearer header (schemathesis.toml).
    env = {**os.environ, "CHATMEM_SCHEMATHESIS_TOKEN": token}
    return subprocess.Popen(
        command, cwd=ROOT, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True, env=env
    )


def generated_cases(report: str) -> int:
    counts = re.findall(r"(\d+) generated", report)
    assert counts, report[-6000:]
    return int(counts[-1])


def test_schemathesis_finds_nothing_with_two_users_at_once(
    live_server: Any, user: Any, other_user: Any, settings: Any
) -> None:
    from memory_worker.dispatch import drain_inline

    # "Consolidate now" answers 503 when nothing can run a fold; the embedded runner can.
    settings.MEMORY_DISPATCH = "inline"
    tokens = [Token.objects.create(user=owner).key for owner in (user, other_user)]
    runs = [start_run(live_server.url, token, SEED + i) for i, token in enumerate(tokens)]
    try:
        reports = [run.communicate(timeout=TIMEOUT)[0] for run in runs]
    finally:
        for run in runs:
            if run.poll() is None:
                run.kill()
        drain_inline()  # folds it queued finish before the test database is flushed
    for run, report in zip(runs, reports, strict=True):
        tail = report[-6000:]
        assert run.returncode == 0, tail
        assert "Configuration:    " + str(ROOT / "schemathesis.toml") in report
        assert "No issues found" in report, tail
        assert re.search(r"Stateful\s", report), tail  # the phase ran, not skipped
    total = sum(generated_cases(report) for report in reports)
    assert total >= 1000, total
    print(f"schemathesis: {total} generated cases over two users, no issues")
