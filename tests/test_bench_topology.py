"""The topology benchmark (bench/topology.py): its measuring parts on hand-made requests, and a
short real run (a fresh PostgreSQL database, Redis, gunicorn, a real celery worker) whose report
must agree with itself and with the fake model server."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path
from typing import Any

import pytest

from bench import cost, topology, topology_chats, topology_measures
from memory_worker.summaries.contract import FoldMessage, format_fold_input
from tests.support.fake_openai import RecordedRequest

ROOT = Path(__file__).resolve().parent.parent
BASE = cost.build_workload(6, seed=3)


def number(ordinal: int, turn: int) -> int:
    return topology_chats.chat_workload(BASE, ordinal)[turn - 1].number


def request(kind: str, messages: list[dict[str, str]], position: int) -> RecordedRequest:
    body = {"messages": messages}
    return RecordedRequest(kind, "/v1/chat/completions", body, {}, 0.0, None, position)


def turn_request(position: int, *history: str, new: str, summary: str = "") -> RecordedRequest:
    """A turn's model call: system prompt, the summary if any, ``history`` and the new user
    message (each text opens with its tag)."""
    from conversations.services.context import SUMMARY_HEADER

    messages = [{"role": "system", "content": "You are helpful."}]
    if summary:
        messages.append({"role": "system", "content": SUMMARY_HEADER + summary})
    messages += [{"role": "user", "content": f"{text} words"} for text in (*history, new)]
    return request("chat", messages, position)


def summarize_request(position: int, *lines: str) -> RecordedRequest:
    """A summarize request folding ``lines`` ("User: …" / "Assistant: …"), in the real input
    format."""
    messages = []
    for seq, line in enumerate(lines, 1):
        speaker, _, text = line.partition(": ")
        messages.append(FoldMessage(seq, speaker.lower(), text))
    source = format_fold_input("", messages)
    return request("summarize", [{"role": "user", "content": source}], position)


def agent_request(position: int, reply: str) -> RecordedRequest:
    content = f"Assistant reply:\n{reply}"
    return request("chat", [{"role": "user", "content": content}], position)


def chat_run(records: list[RecordedRequest], served: list[int]) -> cost.Run:
    return cost.Run(cost.BenchConfig("unit", "contract"), 1, records, served, [], "", [], [], 0.0)


# --- workloads, replies, configurations -------------------------------------------------------


def test_each_chat_has_its_own_tags_on_the_same_text() -> None:
    first, second = topology_chats.chat_workload(BASE, 1), topology_chats.chat_workload(BASE, 2)
    for one, two, base in zip(first, second, BASE, strict=True):
        assert one.user.startswith(cost.user_tag(one.number))
        assert one.reply.startswith(cost.reply_tag(one.number))
        assert one.user.split(" ", 1)[1] == two.user.split(" ", 1)[1] == base.user.split(" ", 1)[1]
        assert (
            topology_chats.chat_ordinal(one.number),
            topology_chats.chat_ordinal(two.number),
        ) == (1, 2)
        # One width: a tag costs the same tokens in every chat.
        assert cost.tokens(cost.user_tag(one.number)) == cost.tokens(cost.user_tag(two.number))


def test_a_turn_request_gets_its_own_chats_reply_and_an_agent_request_a_digest() -> None:
    workloads = {1: topology_chats.chat_workload(BASE, 1), 2: topology_chats.chat_workload(BASE, 2)}
    replies = topology_chats.ChatReplies(workloads)
    one, two = workloads[1][2], workloads[2][4]
    replies.sending(1, one.number)
    replies.sending(2, two.number)
    assert replies({"messages": [{"role": "user", "content": two.user}]}) == two.reply
    assert replies({"messages": [{"role": "user", "content": one.user}]}) == one.reply
    assert replies.served == {1: [one.number], 2: [two.number]}
    digest = replies({"messages": [{"role": "user", "content": f"Assistant reply:\n{one.reply}"}]})
    assert digest.startswith(f"(digest of {cost.reply_tag(one.number)})")
    assert replies.served == {1: [one.number], 2: [two.number]}
    # A turn request of a chat that sends nothing (another configuration's) is a stray.
    stray = topology_chats.chat_workload(BASE, 9)[0]
    replies({"messages": [{"role": "user", "content": stray.user}]})
    assert replies.strays == 1


def test_configurations_cover_every_preset_and_seed_002_at_4500() -> None:
    names = [config.name for config in topology.select_configs("all")]
    assert names == [*cost.PRESET_NAMES, "seed002@4500+500"]
    (seed002,) = topology.select_configs("seed002@4500+500")
    assert (seed002.preset, seed002.overrides) == (
        "token-budget",
        {"max_tokens": 4500, "max_summary_tokens": 500},
    )
    (extra,) = topology.select_configs("token-budget", '{"max_tokens": 4500}')
    assert extra.overrides == {"max_tokens": 4500}
    assert extra.name == 'token-budget+{"max_tokens":4500}'
    with pytest.raises(SystemExit):
        topology.select_configs("no-such-preset")


# --- attributing requests and measuring them ---------------------------------------------------


def test_requests_are_attributed_to_their_chat() -> None:
    a1, a2, b1 = number(1, 1), number(1, 2), number(2, 1)
    stray = number(7, 1)
    records = [
        turn_request(1, new=cost.user_tag(a1)),
        turn_request(2, new=cost.user_tag(b1)),
        summarize_request(3, f"User: {cost.user_tag(a1)} x", f"Assistant: {cost.reply_tag(a1)} y"),
        agent_request(4, f"{cost.reply_tag(b1)} text"),
        turn_request(5, new=cost.user_tag(a2)),
        turn_request(6, new=cost.user_tag(stray)),
    ]
    split = topology_measures.split_records(records, [1, 2])
    assert [r.number for r in split.by_chat[1]] == [1, 3, 5]
    assert [r.number for r in split.by_chat[2]] == [2]
    assert [r.number for r in split.agent_calls[2]] == [4] and split.agent_calls[1] == []
    assert [r.number for r in split.unattributed] == [6]


def test_a_drop_is_seen_in_its_chat_and_a_digest_only_when_counted() -> None:
    a1, a2, b1, b2 = number(1, 1), number(1, 2), number(2, 1), number(2, 2)
    u, a = cost.user_tag, cost.reply_tag
    records = [
        turn_request(1, new=u(a1)),
        turn_request(2, new=u(b1)),
        # Chat 1's turn 1 is folded with its reply as a digest; chat 2's leaves unfolded.
        summarize_request(3, f"User: {u(a1)} x", f"Assistant: (digest of {a(a1)}) y"),
        turn_request(4, new=u(a2)),
        turn_request(5, new=u(b2)),
    ]
    split = topology_measures.split_records(records, [1, 2])
    one, two = chat_run(split.by_chat[1], [a1, a2]), chat_run(split.by_chat[2], [b1, b2])
    assert cost.drops_without_fold(two, cost.stored_messages(two)) == 2  # b1's user and reply
    assert cost.drops_without_fold(one, cost.stored_messages(one)) == 1  # a1's reply, as itself
    counting = topology_measures.carried_with_digests
    assert cost.drops_without_fold(one, cost.stored_messages(one), counting) == 0
    assert topology_measures.reply_fold_forms(split.by_chat[1]) == {"digest": 1}
    assert (
        topology_measures.repeated_agent_calls([agent_request(1, a(a1)), agent_request(2, a(a1))])
        == 1
    )


def test_history_is_the_summary_and_the_messages_before_the_new_one() -> None:
    summary = "## Decisions\n- ship on Friday"
    record = turn_request(1, "[t1u] a", "[t1a] b", "[t2u] c", new="[t2a] d", summary=summary)
    texts = ["[t1u] a words", "[t1a] b words", "[t2u] c words"]
    tokens = cost.tokens(summary) + sum(cost.tokens(text) for text in texts)
    assert topology_measures.history_of(record) == (3, tokens)
    assert topology_measures.check_bound({"context_size": 3}, [record]).over_bound == 0
    assert topology_measures.check_bound({"context_size": 2}, [record]).over_bound == 1
    tight = {"max_memory_tokens": None, "max_tokens": tokens - 1}
    check = topology_measures.check_bound(tight, [record])
    assert (check.token_bound, check.over_bound, check.max_tokens) == (tokens - 1, 1, tokens)
    both = {"max_memory_tokens": tokens, "max_tokens": tokens + 100}
    assert topology_measures.token_bound(both) == tokens


def test_ledger_and_sync_fold_counts() -> None:
    rows = [
        {"status": "succeeded", "synchronous": False, "summarizer_calls": 1},
        {"status": "succeeded", "synchronous": True, "summarizer_calls": 2},
        {"status": "superseded", "synchronous": False, "summarizer_calls": 1},
        {"status": "failed", "synchronous": True, "summarizer_calls": 0},
    ]
    counts = topology_measures.ledger_counts(rows)
    assert (counts.attempts, counts.succeeded, counts.superseded, counts.failed) == (4, 2, 1, 1)
    assert (counts.synchronous, counts.summarizer_calls) == (2, 4)
    assert (counts.superseded_pct, counts.failed_pct) == (25.0, 25.0)
    assert counts.by_kind == {
        "background succeeded": 1,
        "synchronous succeeded": 1,
        "background superseded": 1,
        "synchronous failed": 1,
    }
    # A turn whose synchronous fold took two attempts is one turn; other lines are not folds.
    lines = [
        {"event": "sync_fold", "request_id": "t-1"},
        {"event": "sync_fold", "request_id": "t-1"},
        {"event": "sync_fold", "request_id": "t-2"},
        {"event": "fold", "request_id": "t-3"},
    ]
    assert topology_measures.sync_fold_turns(lines) == 2
    assert topology_measures.web_events(lines) == {"sync_fold": 3, "fold": 1}


# --- a short real run ---------------------------------------------------------------------------


def postgres_server_url() -> str:
    from django.db import connection

    params = connection.settings_dict
    user, host = params.get("USER") or "postgres", params.get("HOST") or "127.0.0.1"
    return f"postgres://{user}@{host}:{params.get('PORT') or 5432}"


def database_exists(server: str, name: str) -> bool:
    import psycopg

    url = server.replace("postgres://", "postgresql://", 1) + "/postgres"
    with psycopg.connect(url) as connection:
        found = connection.execute("SELECT 1 FROM pg_database WHERE datname = %s", (name,))
        return found.fetchone() is not None


def run_bench(tmp_path: Path, server: str, redis_url: str) -> dict[str, Any]:
    out = tmp_path / "topology.json"
    command = [sys.executable, "-m", "bench.topology", "--configs", "contract", "--chats", "2"]
    command += ["--turns", "12", "--celery-workers", "1", "--workers", "1", "--threads", "4"]
    command += ["--postgres-url", server, "--redis-url", redis_url, "--out", str(out)]
    finished = subprocess.run(command, cwd=ROOT, capture_output=True, text=True, timeout=180)
    assert finished.returncode == 0, finished.stderr[-3000:]
    report: dict[str, Any] = json.loads(out.read_text())
    return report


@pytest.mark.postgres
@pytest.mark.redis
@pytest.mark.worker
def test_a_short_run_on_the_real_topology_measures_what_happened(
    require_postgres: None, clean_redis: str, tmp_path: Path
) -> None:
    server = postgres_server_url()
    report = run_bench(tmp_path, server, clean_redis)
    (result,) = report["results"]
    assert result["turns_sent"] == result["turns_stored"] == 24
    assert result["turns_failed"] == 0 and result["idle_at_end"]
    folds = result["folds"]
    assert folds["running"] == 0 and folds["attempts"] > 0
    assert folds["attempts"] == folds["succeeded"] + folds["superseded"] + folds["failed"]
    # Every summarize request the server answered is counted, and each is one chat's.
    assert result["summarizer_calls"] == result["summarizer_calls_at_server"] > 0
    assert result["unattributed_requests"] == 0 and result["stray_turn_requests"] == 0
    per_chat = result["per_chat"]
    assert sum(chat["summarizer_calls"] for chat in per_chat) == result["summarizer_calls"]
    assert [chat["chat_requests"] for chat in per_chat] == [12, 12]
    if folds["superseded"] == folds["failed"] == 0:
        assert folds["summarizer_calls"] == result["summarizer_calls"]
    assert result["drop_without_fold"] == result["newest_not_verbatim"] == 0
    # contract's bound is K + B = 10 history messages, and a turn may meet it.
    assert result["over_bound_turns"] == 0
    assert all(chat["bound"]["max_messages"] <= 10 for chat in per_chat)
    name, state = report["database"].split()
    assert state == "(dropped)" and not database_exists(server, name)
