"""The turn's model request under many threads: CPU per call of
``OpenAIChatModel.complete`` sent directly (the default, conversations.chat_model.http) and through
the ``openai`` SDK (``CHAT_DIRECT_HTTP=false``), as a gunicorn process of 200 threads makes it.

    python -m bench.model_call [--threads 200] [--seconds 8] [--rounds 2] [--latency 1.0]
                               [--messages 60] [--out bench/results/model_call.json]

The fake OpenAI-compatible server (tests/support/fake_openai/) runs in its own process and answers
after ``--latency`` seconds, so ``--threads`` requests are in flight at once, as in
bench.slow_model. Each phase runs one way of sending for ``--seconds``: every thread sends a
``--messages``-message context (a turn's tail on sliding-window) back to back. Reported: this
process's CPU time (user + system, all threads) per call, per phase, and their medians; the
phases alternate direct, SDK, direct, SDK... so both see the same machine. No Django, no
database.
"""

from __future__ import annotations

import argparse
import os
import statistics
import sys
import threading
import time
from collections.abc import Sequence
from datetime import UTC, datetime
from pathlib import Path
from typing import Any

from bench.common import machine_line, start_fake_model, wait_for, write_report
from bench.throughput import free_port

ROOT = Path(__file__).resolve().parent.parent


def parse_args(argv: Sequence[str] | None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(prog="python -m bench.model_call")
    parser.add_argument("--threads", type=int, default=200)
    parser.add_argument("--seconds", type=float, default=8.0)
    parser.add_argument("--rounds", type=int, default=2)
    parser.add_argument("--latency", type=float, default=1.0)
    parser.add_argument("--messages", type=int, default=60)
    parser.add_argument("--out", default="bench/results/model_call.json")
    return parser.parse_args(argv)


def context(messages: int) -> list[dict[str, Any]]:
    words = " ".join(["practice"] * 40)
    return [{"role": "system", "content": "You are a piano teacher."}] + [
        {"role": "user" if index % 2 == 0 else "assistant", "content": f"{words} {index}"}
        for index in range(messages)
    ]


def run_phase(
    model: Any, messages: list[dict[str, Any]], args: argparse.Namespace
) -> dict[str, Any]:
    calls = errors = 0
    lock = threading.Lock()
    stop_at = time.monotonic() + args.seconds

    def client() -> None:
        nonlocal calls, errors
        while time.monotonic() < stop_at:
            try:
                model.complete(messages, "fake-chat")
                failed = 0
            except Exception:
                failed = 1
            with lock:
                calls += 1 - failed
                errors += failed

    threads = [threading.Thread(target=client) for _ in range(args.threads)]
    cpu_before = time.process_time()
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join()
    cpu = time.process_time() - cpu_before
    return {
        "calls": calls,
        "errors": errors,
        "cpu_ms_per_call": round(cpu / calls * 1000, 3) if calls else None,
    }


def main(argv: Sequence[str] | None = None) -> int:
    args = parse_args(argv)
    from conversations.chat_model.openai_backend import OpenAIChatModel
    from conversations.chat_model.transport import make_openai_client

    port = free_port()
    (ROOT / "artifacts").mkdir(exist_ok=True)
    server = start_fake_model(port, args.latency, 60, dict(os.environ), "bench-model-call.log")
    try:
        wait_for(port, "/v1/models")
        client = make_openai_client(f"http://127.0.0.1:{port}/v1", "bench", timeout=30.0)
        ways = {
            "direct": OpenAIChatModel(client, timeout=30.0),
            "sdk": OpenAIChatModel(client, timeout=30.0, direct=False),
        }
        assert ways["direct"].direct is not None, "a proxy in the environment: nothing to compare"
        messages = context(args.messages)
        phases: dict[str, list[dict[str, Any]]] = {name: [] for name in ways}
        for _ in range(args.rounds):
            for name, model in ways.items():
                phases[name].append(run_phase(model, messages, args))
    finally:
        server.terminate()
        server.wait(timeout=30)
    medians = {
        name: round(statistics.median(phase["cpu_ms_per_call"] or 0 for phase in runs), 3)
        for name, runs in phases.items()
    }
    report = {
        "command": "python -m bench.model_call " + " ".join(sys.argv[1:] if argv is None else argv),
        "date": datetime.now(UTC).strftime("%Y-%m-%d %H:%M UTC"),
        "machine": machine_line(),
        "threads": args.threads,
        "model_latency_s": args.latency,
        "context_messages": args.messages + 1,
        "phases": phases,
        "cpu_ms_per_call_median": medians,
        "sdk_over_direct": round(medians["sdk"] / medians["direct"], 2)
        if medians["direct"]
        else None,
    }
    write_report(report, args.out)
    return 0


if __name__ == "__main__":
    sys.exit(main())
