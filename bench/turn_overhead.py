"""Turn overhead against history length: a turn at message 100,000 of a chat costs what
it costs at message 10.

    python -m bench.turn_overhead [--turns 300] [--history 100000]
                                  [--database-url postgres://postgres@127.0.0.1:5432/chatmem_bench]
                                  [--out bench/results/turn_overhead.json]

Two chats on the default preset (``sliding-window``): one with 10 messages, one with
``--history`` messages of which all but the newest 40 are folded, as a worker keeping up would
leave it. Turns alternate between them through the real API (DRF, in process) with the offline
model (instant, no network), so what is timed is the turn's own overhead: authentication, the
turn slot, the snapshot of the unfolded tail, the context build, storing both messages with their
seqs, the fold decision. After each turn a fold runs untimed (what a worker does), so both tails
stay bounded. The history is inserted in bulk; the database is created if it does not exist.
"""

from __future__ import annotations

import argparse
import math
import statistics
import sys
import time
from collections.abc import Sequence
from datetime import UTC, datetime
from typing import Any

from bench.common import (
    api_client,
    configure_django,
    ensure_database,
    insert_history,
    machine_line,
    write_report,
)
from memory_worker.coordination.dispatch import RequestReason

DEFAULT_DATABASE_URL = "postgres://postgres@127.0.0.1:5432/chatmem_bench"
TAIL = 40
WARMUP_TURNS = 20
# In process, instant offline model, no broker: what is timed is the turn itself.
SERVICE_ENV = {
    "MEMORY_DISPATCH": "off",
    "CHAT_BACKEND": "offline",
    "MEMORY_SUMMARIZER_BACKEND": "offline",
    "MEMORY_DAILY_NOTES": "false",
    # The throttle stays on (its cost is part of a turn) with a limit no run reaches.
    "TURN_RATE_LIMIT": "100000000/min",
}


def new_chat(client: Any) -> int:
    response = client.post("/api/v1/chats/", {"title": "bench"}, format="json")
    assert response.status_code == 201, response.content
    return int(response.json()["id"])


def grow(chat_id: int, messages: int) -> None:
    """Give the chat ``messages`` old messages in bulk and fold all but the newest TAIL."""
    from conversations.models import Brief

    insert_history(
        [chat_id],
        messages,
        lambda seq: f"old message {seq} about the release plan and its open items.",
        tokens=14,
    )
    Brief.objects.filter(chat_id=chat_id).update(
        last_consolidated=max(messages - TAIL, 0),
        summary="## Facts / Constraints\n- The release plan is on track.",
        summary_tokens=14,
        version=1,
    )


def timed_turn(client: Any, chat_id: int, number: int) -> float:
    started = time.perf_counter()
    response = client.post(
        f"/api/v1/chats/{chat_id}/turns/",
        {"content": f"Question {number}: what is the next step of the release plan?"},
        format="json",
    )
    elapsed = time.perf_counter() - started
    assert response.status_code == 201, response.content
    return elapsed * 1000


def fold_untimed(chat_id: int) -> None:
    from memory_worker.folding.execute import fold_once

    fold_once(chat_id, RequestReason.TURN)


def percentile(values: Sequence[float], share: float) -> float:
    ordered = sorted(values)
    index = max(min(math.ceil(share * len(ordered)) - 1, len(ordered) - 1), 0)
    return ordered[index]


def summarise(samples: Sequence[float]) -> dict[str, float]:
    return {
        "p50_ms": round(statistics.median(samples), 3),
        "p99_ms": round(percentile(samples, 0.99), 3),
        "mean_ms": round(statistics.fmean(samples), 3),
    }


def parse_args(argv: Sequence[str] | None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(prog="python -m bench.turn_overhead")
    parser.add_argument("--turns", type=int, default=300, help="timed turns per chat")
    parser.add_argument("--history", type=int, default=100_000)
    parser.add_argument("--database-url", default=DEFAULT_DATABASE_URL)
    parser.add_argument("--out", default="bench/results/turn_overhead.json")
    return parser.parse_args(argv)


def main(argv: Sequence[str] | None = None) -> int:
    args = parse_args(argv)
    ensure_database(args.database_url)
    vendor = configure_django(args.database_url, SERVICE_ENV)
    client = api_client()
    short_chat, long_chat = new_chat(client), new_chat(client)
    grow(short_chat, 8)  # the first timed turn adds messages 9 and 10
    started = time.perf_counter()
    grow(long_chat, args.history - 2)
    print(f"history of {args.history:,} messages inserted in {time.perf_counter() - started:.1f} s")
    samples: dict[str, list[float]] = {"short": [], "long": []}
    for number in range(WARMUP_TURNS + args.turns):
        # Alternate, so both chats see the same machine state (caches, other load).
        for label, chat_id in (("short", short_chat), ("long", long_chat)):
            elapsed = timed_turn(client, chat_id, number)
            fold_untimed(chat_id)
            if number >= WARMUP_TURNS:
                samples[label].append(elapsed)
    short, long = summarise(samples["short"]), summarise(samples["long"])
    ratios = {
        "p50": round(long["p50_ms"] / short["p50_ms"], 3),
        "p99": round(long["p99_ms"] / short["p99_ms"], 3),
    }
    report = {
        "command": "python -m bench.turn_overhead " + " ".join(sys.argv[1:]),
        "date": datetime.now(UTC).strftime("%Y-%m-%d %H:%M UTC"),
        "machine": machine_line(),
        "database": vendor,
        "turns_per_chat": args.turns,
        "history_messages": args.history,
        "at_10_messages": short,
        "at_history": long,
        "ratio_long_to_short": ratios,
        "goal": "ratio <= 1.1 at p50 and p99",
        "met": ratios["p50"] <= 1.1 and ratios["p99"] <= 1.1,
    }
    write_report(report, args.out)
    return 0


if __name__ == "__main__":
    sys.exit(main())
