"""Retention benchmark: what the rolling summary keeps of the things a user said that matter.

Each session plants typed canaries (safety rules, hard constraints, facts, goal state, user
preferences), each carrying an unguessable value such as ``VX-81Q2``, early in a long
conversation of chit-chat, sent through the real turn API (DRF, in process) with the offline
chat model and the offline summarizer, on a fresh SQLite database. After every turn the script
plays the Celery worker (``fold_once`` until "nothing" or "deferred").

    python -m bench.retention [--seeds 12] [--rounds 5] [--presets all|name,...]
                              [--summarizer offline|scripted-model] [--model-forgets 0.0]
                              [--model-ignores-repairs] [--model-pads]
                              [--out bench/results/retention.json]

``--summarizer scripted-model`` folds through the Chat Completions summarizer instead, against
the fake OpenAI-compatible server answering with ``bench.scripted_model`` (a stand-in that
follows the prompt; ``--model-forgets P`` makes each rewrite leave out each existing bullet
with probability P, as lossy real rewrites do; ``--model-ignores-repairs`` answers the fold
guard's repair request with the same forgetful rewrite; ``--model-pads`` keeps its bullets in
half the cap and fills the rest with prose). The report counts the guard's repair calls and
the folds that failed, by kind.

Round 1 ends when every message sent up to the last canary has been folded; each further round
ends when everything that was verbatim at its start has been folded too, so every round rolls
the previous verbatim tail into the summary. After each round a canary survives if its value is
in what the model would receive for the next turn (``GET /chats/{id}/context/``: the summary,
the pinned block and every verbatim message). The ``…/canaries-pinned`` configurations pin each
canary's message as it is sent (the pins service, as ``POST …/pins/ {"seq": N}`` does). See
``docs/benchmarks.md``.
"""

from __future__ import annotations

import argparse
import random
import shlex
import subprocess
import sys
import tempfile
import time
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass
from datetime import UTC, datetime
from pathlib import Path
from typing import Any

from bench.common import api_client, configure_django, create_chat, machine_info, save_report
from bench.cost import play_worker
from bench.retention_crowded import PER_TYPE as CROWDED_PER_TYPE
from bench.retention_crowded import (
    crowded_filler,
    make_crowded_canaries,
    planting_messages,
)
from bench.retention_results import (
    PINNED_SUFFIX,
    Config,
    Session,
    check_goals,
    config_result,
    goal_lines,
    markdown_table,
)
from bench.retention_workload import (
    CANARIES_PER_TYPE,
    CANARY_TYPES,
    Canary,
    chit_chat,
    make_canaries,
    planting_message,
    survives,
)
from bench.scripted_model import ScriptedModel
from bench.topology_measures import is_repair_request
from memory_worker.engine.presets import DEFAULT_PRESET, PRESETS
from tests.support.fake_openai import FakeOpenAI

DEFAULT_SEEDS = 12
DEFAULT_ROUNDS = 5
# The canaries go into the first turns, one every PLANT_EVERY turns, between chit-chat.
PLANT_EVERY = 2
# A round that has not folded its start's verbatim tail after this many turns is reported as
# incomplete instead of running on (a policy that never folds would otherwise never end).
MAX_ROUND_TURNS = 600
GOAL_KEPT = 0.95
# Facts compete with the incidental details for what room the standing items leave.
GOAL_FACTS_CROWDED = 0.90
ROOT = Path(__file__).resolve().parent.parent

# --- configurations ------------------------------------------------------------------------

# The bound the peers were measured at (bench/cost.py): 4,000 verbatim tokens beside a
# 500-token summary, every token fold going down to the newest turn.
PEER_OVERRIDES = {
    "max_tokens": 5000,
    "max_summary_tokens": 500,
    "max_memory_tokens": 4500,
    "fold_target_tokens": 0,
}
PEER_NAME = "token-budget@4000+500/target=0"


ALL_CONFIGS = (
    *(Config(name, name) for name in PRESETS),
    Config(PEER_NAME, "token-budget", dict(PEER_OVERRIDES)),
    Config(DEFAULT_PRESET + PINNED_SUFFIX, DEFAULT_PRESET, pinned=True),
    Config(PEER_NAME + PINNED_SUFFIX, "token-budget", dict(PEER_OVERRIDES), pinned=True),
)
# The goal holds at the preset a chat gets when it names none, and at the peers' bound.
GOAL_CONFIGS = (DEFAULT_PRESET, PEER_NAME)


def select_configs(spec: str) -> list[Config]:
    """``all``, or comma-separated configuration names (a preset's name is its defaults)."""
    if spec == "all":
        return list(ALL_CONFIGS)
    wanted = [part.strip() for part in spec.split(",") if part.strip()]
    unknown = [name for name in wanted if not any(c.name == name for c in ALL_CONFIGS)]
    if unknown or not wanted:
        known = ", ".join(c.name for c in ALL_CONFIGS)
        raise SystemExit(f"unknown configuration(s) {unknown}; known: {known}")
    return [c for c in ALL_CONFIGS if c.name in wanted]


# --- one session ---------------------------------------------------------------------------


class Chat:
    """One chat driven through the API, one turn at a time."""

    def __init__(self, client: Any, config: Config) -> None:
        self.client = client
        self.chat_id = create_chat(client, config.name, config.preset, config.overrides)
        self.turns = 0
        self.failed = 0

    def send(self, content: str) -> None:
        response = self.client.post(
            f"/api/v1/chats/{self.chat_id}/turns/", {"content": content}, format="json"
        )
        self.turns += 1
        if response.status_code != 201:
            self.failed += 1
            if self.failed <= 3:
                detail = response.json().get("detail", "")
                print(f"  turn {self.turns}: HTTP {response.status_code} {detail}", file=sys.stderr)
        play_worker(self.chat_id)

    def pin_last_user_message(self) -> bool:
        """Pins the user message of the turn just stored; False when the pin was refused."""
        from conversations.models import Chat as ChatRow
        from conversations.services.pins import PinRefused, add_pin

        chat = ChatRow.objects.get(pk=self.chat_id)
        try:
            add_pin(chat, seq=chat.last_seq - 1)
        except PinRefused as error:
            print(f"  pin refused: {error}", file=sys.stderr)
            return False
        return True

    def brief(self) -> dict[str, Any]:
        brief: dict[str, Any] = self.client.get(f"/api/v1/chats/{self.chat_id}/brief/").json()
        return brief

    def last_seq(self) -> int:
        brief = self.brief()
        # The unfolded messages are exactly those after the watermark.
        return int(brief["last_consolidated"]) + int(brief["unfolded"])

    def watermark(self) -> int:
        """The brief's last_consolidated, read directly: the brief endpoint also judges whether
        a fold is due, which after every turn of a session costs more than the turn."""
        from conversations.models import Brief

        return int(Brief.objects.values_list("last_consolidated", flat=True).get(chat=self.chat_id))

    def context(self) -> tuple[str, str, list[str]]:
        """What the model would receive for the next turn: the summary's system message, the
        pinned block, and the contents of the other messages (the system prompt and every
        verbatim message)."""
        from conversations.services.context import SUMMARY_HEADER
        from memory_worker.pinned import PINNED_HEADER

        messages = self.client.get(f"/api/v1/chats/{self.chat_id}/context/").json()["messages"]
        summary, pinned, others = "", "", []
        for message in messages:
            content = str(message.get("content") or "")
            if message["role"] == "system" and content.startswith(SUMMARY_HEADER):
                summary = content
            elif message["role"] == "system" and content.startswith(PINNED_HEADER):
                pinned = content
            else:
                others.append(content)
        return summary, pinned, others

    def folds(self) -> int:
        from conversations.models import Consolidation, ConsolidationStatus

        succeeded = ConsolidationStatus.SUCCEEDED
        return Consolidation.objects.filter(chat_id=self.chat_id, status=succeeded).count()


def fold_counts() -> dict[str, Any]:
    """Every session's ledger: committed folds, and the failed ones by error kind."""
    from django.db.models import Count

    from conversations.models import Consolidation, ConsolidationStatus

    rows = Consolidation.objects.values("status", "error_kind").annotate(n=Count("id"))
    succeeded = sum(r["n"] for r in rows if r["status"] == ConsolidationStatus.SUCCEEDED)
    failed = {
        r["error_kind"] or "?": r["n"] for r in rows if r["status"] == ConsolidationStatus.FAILED
    }
    return {"succeeded": succeeded, "failed_by_kind": failed}


def where_kept(canary: Canary, summary: str, pinned: str, others: Sequence[str]) -> str:
    if survives(canary, [pinned]):
        return "pinned"
    in_summary = survives(canary, [summary])
    in_verbatim = survives(canary, others)
    if in_summary and in_verbatim:
        return "both"
    return "summary" if in_summary else "verbatim" if in_verbatim else ""


@dataclass(frozen=True)
class SessionKind:
    """How a session plants its canaries and what the user says between and after them."""

    canaries: Callable[[random.Random], list[Canary]]
    planting: Callable[[Canary, random.Random], list[str]]  # the last one plants the canary
    filler: Callable[[random.Random], str]
    thresholds: Mapping[str, float]  # each type's goal after the last round


def standard_planting(canary: Canary, rng: random.Random) -> list[str]:
    return [*(chit_chat(rng) for _ in range(PLANT_EVERY - 1)), planting_message(canary, rng)]


SESSION_KINDS = {
    # Three canaries of each type, each with an unguessable value; they fit the cap.
    "standard": SessionKind(
        make_canaries, standard_planting, chit_chat, dict.fromkeys(CANARY_TYPES, GOAL_KEPT)
    ),
    # More than fits beside the incidental details: bench.retention_crowded.
    "crowded": SessionKind(
        make_crowded_canaries,
        planting_messages,
        crowded_filler,
        {**dict.fromkeys(CANARY_TYPES, GOAL_KEPT), "fact": GOAL_FACTS_CROWDED},
    ),
}


def run_session(client: Any, config: Config, seed: int, rounds: int, kind: SessionKind) -> Session:
    rng = random.Random(f"retention-{seed}")
    canaries = kind.canaries(rng)
    session = Session(config.name, seed, canaries)
    started = time.monotonic()
    chat = Chat(client, config)
    for canary in canaries:
        for message in kind.planting(canary, rng):
            chat.send(message)
        if config.pinned and not chat.pin_last_user_message():
            session.refused_pins += 1
    for _ in range(rounds):
        mark = chat.last_seq()
        round_start = chat.turns
        done = False
        while chat.turns - round_start < MAX_ROUND_TURNS:
            chat.send(kind.filler(rng))
            if chat.watermark() >= mark:
                done = True
                break
        session.round_turns.append(chat.turns - round_start)
        summary, pinned, others = chat.context()
        session.kept.append([where_kept(c, summary, pinned, others) for c in canaries])
        if not done:
            break  # the policy stopped folding: later rounds would measure nothing new
        session.complete_rounds += 1
    session.turns, session.failed_turns = chat.turns, chat.failed
    session.folds = chat.folds()
    session.final_summary_tokens = int(chat.brief()["summary_tokens"])
    session.seconds = time.monotonic() - started
    return session


# --- setup ---------------------------------------------------------------------------------


SUMMARIZERS = ("offline", "scripted-model")


def configure(database_url: str, summarizer_url: str | None) -> str:
    """The offline chat model always; the offline summarizer, or the Chat Completions one
    against ``summarizer_url`` (the fake server answering with the scripted model)."""
    summarizer: dict[str, str] = {"MEMORY_SUMMARIZER_BACKEND": "offline", "OPENAI_API_KEY": ""}
    if summarizer_url:
        summarizer = {
            "MEMORY_SUMMARIZER_BACKEND": "chat",
            "OPENAI_API_KEY": "bench",
            "OPENAI_BASE_URL": summarizer_url,
            "MEMORY_SUMMARIZER_MODEL": "scripted-model",
        }
    return configure_django(
        database_url,
        {
            "MEMORY_DISPATCH": "off",
            "CHAT_BACKEND": "offline",
            "TURN_RATE_LIMIT": "",  # one user sends hundreds of turns a minute here
            **summarizer,
        },
    )


def code_state() -> dict[str, Any]:
    """Which code was measured: the commit, and the files changed in the work tree since (a run
    on uncommitted code says so)."""

    def git(*args: str) -> str:
        try:
            done = subprocess.run(
                ["git", *args], cwd=ROOT, capture_output=True, text=True, timeout=30
            )
        except OSError:
            return ""
        return done.stdout.strip() if done.returncode == 0 else ""

    # Status lines as git prints them ("M path", "?? path"); no optional locks, so a run never
    # writes to the index of a checkout someone is working in.
    status = git("--no-optional-locks", "status", "--porcelain")
    changed = [line.strip() for line in status.splitlines() if line.strip()]
    return {"commit": git("rev-parse", "--short", "HEAD"), "uncommitted": changed}


def code_line(code: dict[str, Any]) -> str:
    changed = ", ".join(code["uncommitted"])
    return f"code:    {code['commit']}" + (f", uncommitted: {changed}" if changed else "")


def parse_args(argv: Sequence[str] | None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(
        prog="python -m bench.retention", description=(__doc__ or "").split("\n")[0]
    )
    parser.add_argument("--seeds", type=int, default=DEFAULT_SEEDS, help="sessions per config")
    parser.add_argument("--rounds", type=int, default=DEFAULT_ROUNDS)
    parser.add_argument(
        "--presets", default="all", help="all, or comma-separated configuration names"
    )
    parser.add_argument("--summarizer", choices=SUMMARIZERS, default="offline")
    parser.add_argument(
        "--sessions",
        choices=list(SESSION_KINDS),
        default="standard",
        help="standard: canaries that fit the cap; crowded: more than fits (see docs)",
    )
    parser.add_argument(
        "--model-forgets", type=float, default=0.0, help="scripted-model only: P in [0, 1)"
    )
    parser.add_argument(
        "--model-ignores-repairs",
        action="store_true",
        help="scripted-model only: the repair request is answered like the draft",
    )
    parser.add_argument(
        "--model-pads", action="store_true", help="scripted-model only: prose fills the cap"
    )
    parser.add_argument("--out", default="bench/results/retention.json")
    args = parser.parse_args(argv)
    if args.seeds < 1 or args.rounds < 1:
        parser.error("--seeds and --rounds must be at least 1")
    if not 0 <= args.model_forgets < 1:
        parser.error("--model-forgets must be in [0, 1)")
    habits = args.model_forgets or args.model_ignores_repairs or args.model_pads
    if habits and args.summarizer != "scripted-model":
        parser.error(
            "--model-forgets, --model-ignores-repairs and --model-pads need "
            "--summarizer scripted-model"
        )
    return args


def main(argv: Sequence[str] | None = None) -> int:
    args = parse_args(argv)
    configs = select_configs(args.presets)
    kind = SESSION_KINDS[args.sessions]
    arguments = sys.argv[1:] if argv is None else list(argv)
    command = shlex.join(["python", "-m", "bench.retention", *arguments])
    date = datetime.now(UTC).strftime("%Y-%m-%d %H:%M UTC")
    info = machine_info()
    code = code_state()
    started = time.monotonic()
    results = []
    model = ScriptedModel(
        forget_rate=args.model_forgets,
        ignores_repairs=args.model_ignores_repairs,
        pads=args.model_pads,
    )
    with (
        tempfile.TemporaryDirectory(prefix="chatmem-retention-") as tmpdir,
        FakeOpenAI(summary_fn=model) as server,
    ):
        summarizer_url = server.base_url if args.summarizer == "scripted-model" else None
        vendor = configure(f"sqlite:///{tmpdir}/bench.sqlite3", summarizer_url)
        client = api_client()
        for config in configs:
            sessions = [
                run_session(client, config, s, args.rounds, kind) for s in range(args.seeds)
            ]
            result = config_result(config, sessions, args.rounds)
            results.append(result)
            print(f"  {config.name}: {result['seconds']:.1f} s", file=sys.stderr, flush=True)
        summarize_calls = server.counters().get("summarize", 0) if summarizer_url else 0
        repair_calls = sum(1 for record in server.requests if is_repair_request(record))
        folds = fold_counts()
    wall = time.monotonic() - started
    per_type = CANARIES_PER_TYPE if args.sessions == "standard" else CROWDED_PER_TYPE
    summarizer = args.summarizer + "".join(
        f" ({habit})"
        for habit, on in (
            (f"forgets {args.model_forgets:.0%} of bullets per rewrite", args.model_forgets),
            ("ignores repair requests", args.model_ignores_repairs),
            ("pads to its cap", args.model_pads),
        )
        if on
    )
    goals = check_goals(results, args.rounds, GOAL_CONFIGS, kind.thresholds)
    print(
        "\n".join(
            [
                f"command: {command}",
                f"date:    {date}",
                f"machine: {info['platform']}, {info['cpu_count']} CPUs, Python {info['python']}",
                f"database: {vendor}",
                f"summarizer: {summarizer}"
                + (
                    f", {summarize_calls} summarize calls ({repair_calls} the guard's repairs)"
                    if summarizer_url
                    else ""
                ),
                f"folds: {folds['succeeded']} committed, failed by kind: "
                f"{folds['failed_by_kind'] or 'none'}",
                code_line(code),
                f"sessions: {args.sessions}, seeds: {args.seeds}, rounds: {args.rounds}, "
                f"canaries per type per session: {per_type}; wall time: {wall:.1f} s",
                "",
                f"kept after round 1 → after round {args.rounds}:",
                "",
                markdown_table(results),
                "",
                *goal_lines(goals),
            ]
        )
    )
    for result in results:
        if result["incomplete_sessions"] or result["failed_turns"]:
            print(
                f"note: {result['config']}: {result['incomplete_sessions']} session(s) stopped "
                f"before the last round, {result['failed_turns']} failed turn(s)"
            )
    report = {
        "command": command,
        "date": date,
        "machine": info,
        "database": vendor,
        "summarizer": summarizer,
        "summarize_calls": summarize_calls,
        "guard_repair_calls": repair_calls,
        "folds": folds,
        "code": code,
        "seeds": args.seeds,
        "rounds": args.rounds,
        "sessions": args.sessions,
        "canaries_per_type": per_type,
        "wall_seconds": round(wall, 1),
        "results": results,
        "goals": goals,
    }
    print(f"\nwrote {save_report(report, args.out)}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
