"""A turn's cost in this checkout against another commit's, measured interleaved.

    python -m bench.compare --base <git ref> [--rounds 30] [--batch 100]
                            [--database-url postgres://postgres@127.0.0.1:5432/chatmem_compare]

This machine's speed drifts by tens of percent within an hour, so two runs taken one after the
other cannot tell a 10 % change from the machine. Here both versions run at once: the base
commit is checked out in a temporary git worktree, each version serves turns in its own process
(its own database, ``<name>_base`` and ``<name>_head``), and the two take turns doing
``--batch`` turns each, ``--rounds`` times (ABAB, then BABA...), so drift reaches both alike.
Reported: each side's median per-turn wall time and CPU time of its process (the turn through the
real API in process, as bench.turn_overhead: DRF, PostgreSQL, Redis for the throttle and the
dispatch marker, the offline model), and the median of the per-round ratios head/base.

Both versions run on this checkout's virtualenv: a base whose dependencies differ will not run.
"""

from __future__ import annotations

import argparse
import os
import statistics
import subprocess
import sys
import tempfile
import time
import uuid
from collections.abc import Sequence
from datetime import UTC, datetime
from pathlib import Path
from typing import IO, Any
from urllib.parse import urlparse

ROOT = Path(__file__).resolve().parent.parent
CHATS = 16
WARMUP_TURNS = 300
SERVICE_ENV = {
    "CHAT_BACKEND": "offline",
    "MEMORY_SUMMARIZER_BACKEND": "offline",
    # As the throughput benchmark's server: Redis for the throttle and the queued marker; no
    # worker, so the turns fold synchronously when the tail reaches its hard limit.
    "REDIS_URL": "redis://127.0.0.1:6379/9",
    "TURN_RATE_LIMIT": "100000000/min",
    "LOG_LEVEL": "WARNING",
}


def serve(database_url: str) -> None:
    """The per-version process: set up, then for each batch size read on stdin, run that many
    turns and print "wall_ms cpu_ms" per turn. It runs this file against the other version's
    code (``PYTHONPATH``), so it imports nothing from ``bench``, which that version may lack."""
    client = set_up(database_url)
    chats = [client.post("/api/v1/chats/", {}, format="json").json()["id"] for _ in range(CHATS)]
    number = 0

    def turn() -> None:
        nonlocal number
        number += 1
        response = client.post(
            f"/api/v1/chats/{chats[number % CHATS]}/turns/",
            {"content": f"Message {number}: what is the next step?"},
            format="json",
        )
        assert response.status_code == 201, response.content

    for _ in range(WARMUP_TURNS):
        turn()
    print("ready", flush=True)
    for line in sys.stdin:
        batch = int(line)
        started, cpu = time.perf_counter(), time.process_time()
        for _ in range(batch):
            turn()
        wall_ms = (time.perf_counter() - started) / batch * 1000
        cpu_ms = (time.process_time() - cpu) / batch * 1000
        print(f"{wall_ms:.4f} {cpu_ms:.4f}", flush=True)


def set_up(database_url: str) -> Any:
    """Django on a migrated database of its own, and an API client with a new user's token."""
    import psycopg

    parsed = urlparse(database_url)
    name = parsed.path.lstrip("/")
    admin = parsed._replace(path="/postgres").geturl().replace("postgres://", "postgresql://", 1)
    with psycopg.connect(admin, autocommit=True) as connection:
        if not connection.execute(
            "SELECT 1 FROM pg_database WHERE datname = %s", (name,)
        ).fetchone():
            connection.execute(f'CREATE DATABASE "{name}"')
    os.environ.update(
        {
            "DJANGO_SETTINGS_MODULE": "chatmem_project.settings",
            "DATABASE_URL": database_url,
            "ALLOWED_HOSTS": "testserver",
            **SERVICE_ENV,
        }
    )
    import django

    django.setup()
    from django.contrib.auth import get_user_model
    from django.core.management import call_command
    from rest_framework.authtoken.models import Token
    from rest_framework.test import APIClient

    call_command("migrate", verbosity=0, interactive=False)
    user = get_user_model().objects.create_user(username=f"compare-{uuid.uuid4().hex[:10]}")
    client = APIClient()
    client.credentials(HTTP_AUTHORIZATION=f"Token {Token.objects.create(user=user).key}")
    return client


def start(checkout: Path, database_url: str) -> subprocess.Popen[str]:
    # This file, run against the checkout's code: the base may predate it.
    command = [sys.executable, str(Path(__file__).resolve()), "--serve", database_url]
    env = {**os.environ, "PYTHONPATH": str(checkout)}
    process = subprocess.Popen(
        command, cwd=checkout, env=env, stdin=subprocess.PIPE, stdout=subprocess.PIPE, text=True
    )
    assert process.stdout is not None
    while (line := process.stdout.readline()) != "ready\n":
        if not line:
            raise SystemExit(f"the version in {checkout} exited before it was ready")
    return process


def measure(process: subprocess.Popen[str], batch: int) -> tuple[float, float]:
    stdin, stdout = process.stdin, process.stdout
    assert stdin is not None and stdout is not None
    stdin.write(f"{batch}\n")
    stdin.flush()
    wall, cpu = stdout.readline().split()
    return float(wall), float(cpu)


def stop(process: subprocess.Popen[str]) -> None:
    stdin: IO[str] | None = process.stdin
    if stdin is not None:
        stdin.close()
    process.wait(timeout=60)


def side(samples: Sequence[tuple[float, float]]) -> dict[str, float]:
    return {
        "wall_ms_per_turn_median": round(statistics.median(s[0] for s in samples), 3),
        "cpu_ms_per_turn_median": round(statistics.median(s[1] for s in samples), 3),
    }


def parse_args(argv: Sequence[str] | None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(prog="python -m bench.compare")
    parser.add_argument("--base", help="the git ref to compare this checkout against")
    parser.add_argument("--rounds", type=int, default=30)
    parser.add_argument("--batch", type=int, default=100, help="turns per side per round")
    parser.add_argument(
        "--database-url", default="postgres://postgres@127.0.0.1:5432/chatmem_compare"
    )
    parser.add_argument("--out", default="bench/results/compare.json")
    parser.add_argument("--serve", help=argparse.SUPPRESS)  # the per-version process
    return parser.parse_args(argv)


def compare(args: argparse.Namespace, base_checkout: Path) -> dict[str, Any]:
    base = start(base_checkout, args.database_url + "_base")
    head = start(ROOT, args.database_url + "_head")
    samples: dict[str, list[tuple[float, float]]] = {"base": [], "head": []}
    try:
        for round_number in range(args.rounds):
            order = [("base", base), ("head", head)]
            for name, process in order if round_number % 2 == 0 else reversed(order):
                samples[name].append(measure(process, args.batch))
    finally:
        stop(base)
        stop(head)
    pairs = list(zip(samples["base"], samples["head"], strict=True))
    return {
        "base": side(samples["base"]),
        "head": side(samples["head"]),
        "head_over_base_cpu_median": round(statistics.median(h[1] / b[1] for b, h in pairs), 3),
        "head_over_base_wall_median": round(statistics.median(h[0] / b[0] for b, h in pairs), 3),
    }


def main(argv: Sequence[str] | None = None) -> int:
    args = parse_args(argv)
    if args.serve:
        serve(args.serve)
        return 0
    from bench.common import machine_line, write_report

    if not args.base:
        raise SystemExit("--base <git ref> is required")
    revision = git_output("rev-parse", "--short", args.base)
    head = git_output("rev-parse", "--short", "HEAD")
    with tempfile.TemporaryDirectory(prefix="chatmem-compare-") as scratch:
        checkout = Path(scratch) / "base"
        git = ["git", "-C", str(ROOT), "worktree"]
        subprocess.run([*git, "add", "--detach", "-q", str(checkout), revision], check=True)
        try:
            figures = compare(args, checkout)
        finally:
            subprocess.run([*git, "remove", "--force", str(checkout)], check=True)
    report = {
        "command": "python -m bench.compare " + " ".join(sys.argv[1:] if argv is None else argv),
        "date": datetime.now(UTC).strftime("%Y-%m-%d %H:%M UTC"),
        "machine": machine_line(),
        "base": revision,
        "head": head + (" (with uncommitted changes)" if dirty() else ""),
        "rounds": args.rounds,
        "turns_per_side_per_round": args.batch,
        **{key: value for key, value in figures.items() if key not in ("base", "head")},
        "base_figures": figures["base"],
        "head_figures": figures["head"],
    }
    write_report(report, args.out)
    return 0


def dirty() -> bool:
    return bool(git_output("status", "--porcelain", "--untracked-files=no"))


def git_output(*args: str) -> str:
    found = subprocess.run(["git", *args], cwd=ROOT, check=True, capture_output=True, text=True)
    return found.stdout.strip()


if __name__ == "__main__":
    sys.exit(main())
