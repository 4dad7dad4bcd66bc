"""``python -m tests.support.fake_openai``: the fake server standalone."""

from __future__ import annotations

import argparse
import json
import signal
import sys
import threading

from tests.support.fake_openai.faults import validate_faults
from tests.support.fake_openai.replies import SUMMARY_HABITS
from tests.support.fake_openai.server import FakeOpenAI
from tests.support.fake_openai.wire import FAULT_NAMES, KINDS

# --------------------------------------------------------------------------------------------
# Command line
# --------------------------------------------------------------------------------------------


def parse_args(argv: list[str] | None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(
        prog="python -m tests.support.fake_openai", description="Fake OpenAI-compatible server."
    )
    parser.add_argument("--host", default="127.0.0.1")
    parser.add_argument("--port", type=int, default=8999, help="0 picks a free port")
    parser.add_argument("--latency", type=float, default=0.0, help="seconds per chat request")
    parser.add_argument("--summarize-latency", type=float, default=0.0)
    parser.add_argument("--fault-rate", type=float, default=0.0)
    parser.add_argument("--faults", default="", help=f"comma-separated, of {','.join(FAULT_NAMES)}")
    parser.add_argument("--fault-kind", choices=KINDS, default="any")
    parser.add_argument("--seed", type=int, default=1)
    parser.add_argument("--api-key", default=None, help="require 'Authorization: Bearer KEY'")
    parser.add_argument("--reply-words", type=int, default=None)
    parser.add_argument("--summary-cap-words", type=int, default=300)
    parser.add_argument(
        "--summary-habits", default="", help=f"comma-separated, of {','.join(SUMMARY_HABITS)}"
    )
    parser.add_argument("--timeout-sleep", type=float, default=2.0)
    parser.add_argument(
        "--chunk-delay", type=float, default=0.0, help="seconds between streamed chunks"
    )
    return parser.parse_args(argv)


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    faults = [name for name in args.faults.split(",") if name]
    if args.fault_rate and not faults:
        faults = ["429", "500"]
    try:
        validate_faults(args.fault_kind, faults)
    except ValueError as error:
        sys.exit(f"error: {error}")
    server = FakeOpenAI(
        args.host,
        args.port,
        latency=args.latency,
        summarize_latency=args.summarize_latency,
        api_key=args.api_key,
        reply_words=args.reply_words,
        summary_cap_words=args.summary_cap_words,
        summary_habits=[name for name in args.summary_habits.split(",") if name],
        timeout_sleep=args.timeout_sleep,
        chunk_delay=args.chunk_delay,
        fault_rate=args.fault_rate,
        faults=faults,
        fault_kind=args.fault_kind,
        seed=args.seed,
    )
    stop = threading.Event()
    for signum in (signal.SIGTERM, signal.SIGINT):
        signal.signal(signum, lambda *_: stop.set())
    with server:
        print(f"listening on {server.base_url}", flush=True)
        while not stop.wait(0.5):
            pass
    print(f"stopped; counters: {json.dumps(server.counters())}", flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
