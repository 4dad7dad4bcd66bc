"""The admin's memory pages at scale: a 10,000-turn chat's memory timeline, and the fleet page
over a ledger of 1,000,000 rows.

    python -m bench.admin_pages [--turns 10000] [--ledger-rows 1000000] [--repeats 7]
                                [--database-url postgres://postgres@127.0.0.1:5432/chatmem_pages]
                                [--out bench/results/admin_pages.json]

PostgreSQL, in this process (the admin's own code, as a web process runs it, without HTTP). The
rows are written with generate_series in SQL: a chat of ``--turns`` turns whose replies report
their prompt tokens, folded every 15 turns; and ``--ledger-rows`` ledger rows over 2,000 chats
and 30 days, finished at an even pace (a day holds 1/30 of them), a tenth failed or superseded.
Timed: the timeline (its queries and the SVG) and the fleet page (GET through Django's test
client as a staff user: the view, its queries and the template), each ``--repeats`` times after
one warm-up; medians reported, with the SVG's size and the plan PostgreSQL chose for a window's
counts. The database is created if need be and emptied of chats first.
"""

from __future__ import annotations

import argparse
import statistics
import sys
import time
from collections.abc import Sequence
from datetime import UTC, datetime
from typing import Any

from bench.common import configure_django, ensure_database, machine_info, write_report
from bench.topology_measures import code_revision

DEFAULT_DATABASE_URL = "postgres://postgres@127.0.0.1:5432/chatmem_pages"
FOLD_EVERY = 15
LEDGER_CHATS = 2000
ENV = {"MEMORY_DISPATCH": "off", "CHAT_BACKEND": "offline", "MEMORY_DAILY_NOTES": "false"}

CHAT_MESSAGES_SQL = """
INSERT INTO conversations_message (chat_id, seq, role, content, token_count, model_variant,
                                   metadata, created_at)
SELECT %(chat)s, seq, CASE WHEN seq %% 2 = 1 THEN 'user' ELSE 'assistant' END,
       'message ' || seq, 20, '',
       CASE WHEN seq %% 2 = 0
            THEN jsonb_build_object('prompt_tokens', 800 + 40 * ((seq / 2) %% %(every)s))
            ELSE '{}'::jsonb END,
       %(start)s::timestamptz + make_interval(secs => seq)
FROM generate_series(1, %(messages)s) AS seq
"""
CHAT_FOLDS_SQL = """
INSERT INTO conversations_consolidation (chat_id, trigger, status, from_seq, to_seq,
    base_version, synchronous, input_tokens, output_tokens, summary_tokens_before,
    summary_tokens_after, summarizer_calls, started_at, heartbeat_at, finished_at, error,
    error_kind, withheld_seqs, worker, dropped_details, edited_by)
SELECT %(chat)s, 'overflow', 'succeeded', (n - 1) * 2 * %(every)s + 1, n * 2 * %(every)s,
       n - 1, false, 900, 300, 280, 300 + n %% 150, 1,
       f, f, f, '', '', '[]', 'bench', '[]', ''
FROM generate_series(1, %(folds)s) AS n,
     LATERAL (SELECT %(start)s::timestamptz + make_interval(secs => n * 2 * %(every)s + 1) AS f) t
"""
LEDGER_SQL = """
INSERT INTO conversations_consolidation (chat_id, trigger, status, from_seq, to_seq,
    base_version, synchronous, input_tokens, output_tokens, summary_tokens_before,
    summary_tokens_after, summarizer_calls, due_at, started_at, heartbeat_at, finished_at,
    error, error_kind, withheld_seqs, worker, dropped_details, edited_by)
SELECT (SELECT min(id) FROM conversations_chat WHERE title = 'fleet') + n %% %(chats)s,
       'overflow',
       CASE WHEN n %% 20 = 0 THEN 'failed' WHEN n %% 20 = 1 THEN 'superseded' ELSE 'succeeded' END,
       1, 30, 0, false, 900, 300, 280, 300, 1,
       f - make_interval(secs => 1 + n %% 7), f, f, f, '', '', '[]', 'bench', '[]', ''
FROM generate_series(1, %(rows)s) AS n,
     LATERAL (SELECT now() - make_interval(secs => (n::float / %(rows)s) * 30 * 86400) AS f) t
"""


def setup(turns: int, ledger_rows: int) -> int:
    from django.contrib.auth import get_user_model
    from django.db import connection

    from conversations.models import Brief, Chat

    user_model = get_user_model()
    Chat.objects.all().delete()
    user_model.objects.filter(username__in=["bench", "staff"]).delete()
    owner = user_model.objects.create_user("bench")
    user_model.objects.create_superuser("staff", "staff@example.com", "pw")
    chat = Chat.objects.create(owner=owner, title="long", policy="sliding-window")
    Chat.objects.bulk_create(
        Chat(owner=owner, title="fleet", policy="sliding-window") for _ in range(LEDGER_CHATS)
    )
    Brief.objects.bulk_create(
        Brief(chat=c) for c in Chat.objects.exclude(brief__isnull=False).only("id")
    )
    start = datetime(2026, 11, 1, tzinfo=UTC)
    folds = turns // FOLD_EVERY
    values: dict[str, Any] = {
        "chat": chat.pk,
        "every": FOLD_EVERY,
        "start": start,
        "messages": 2 * turns,
    }
    with connection.cursor() as cursor:
        cursor.execute(CHAT_MESSAGES_SQL, values)
        cursor.execute(CHAT_FOLDS_SQL, {**values, "folds": folds})
        cursor.execute(LEDGER_SQL, {"rows": ledger_rows, "chats": LEDGER_CHATS})
        cursor.execute("ANALYZE conversations_consolidation")
        cursor.execute("ANALYZE conversations_message")
    Chat.objects.filter(pk=chat.pk).update(last_seq=2 * turns)
    Brief.objects.filter(chat_id=chat.pk).update(last_consolidated=folds * 2 * FOLD_EVERY)
    return chat.pk


def timed(action: Any, repeats: int) -> tuple[float, Any]:
    result = action()  # warm-up
    samples = []
    for _ in range(repeats):
        started = time.perf_counter()
        result = action()
        samples.append((time.perf_counter() - started) * 1000)
    return statistics.median(samples), result


def window_plan() -> str:
    from django.db import connection

    with connection.cursor() as cursor:
        # The page's own aggregate of a window (services.fleet.window), as Django writes it.
        cursor.execute(
            "EXPLAIN SELECT count(id) FILTER (WHERE status = 'succeeded' AND trigger <> 'edit'), "
            "count(id) FILTER (WHERE status = 'failed'), "
            "count(id) FILTER (WHERE status = 'superseded') "
            "FROM conversations_consolidation WHERE finished_at >= now() - interval '1 day'"
        )
        return "\n".join(row[0] for row in cursor.fetchall())


def parse_args(argv: Sequence[str] | None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(prog="python -m bench.admin_pages")
    parser.add_argument("--turns", type=int, default=10_000)
    parser.add_argument("--ledger-rows", type=int, default=1_000_000)
    parser.add_argument("--repeats", type=int, default=7)
    parser.add_argument("--database-url", default=DEFAULT_DATABASE_URL)
    parser.add_argument("--out", default="bench/results/admin_pages.json")
    return parser.parse_args(argv)


def main(argv: Sequence[str] | None = None) -> int:
    args = parse_args(argv)
    ensure_database(args.database_url)
    configure_django(args.database_url, ENV)
    from django.test import Client

    from conversations.admin_timeline import timeline_svg
    from conversations.models import Chat, Consolidation
    from conversations.services.memory_timeline import memory_timeline

    started = time.perf_counter()
    chat_id = setup(args.turns, args.ledger_rows)
    print(f"rows written in {time.perf_counter() - started:.1f} s")
    chat = Chat.objects.get(pk=chat_id)
    timeline_ms, svg = timed(lambda: str(timeline_svg(memory_timeline(chat))), args.repeats)
    staff = Client()
    staff.login(username="staff", password="pw")

    def fleet_page() -> int:
        response = staff.get("/admin/conversations/chat/fleet/")
        assert response.status_code == 200, response.status_code
        return len(response.content)

    fleet_ms, page_bytes = timed(fleet_page, args.repeats)
    report = {
        "command": "python -m bench.admin_pages " + " ".join(sys.argv[1:]),
        "date": datetime.now(UTC).strftime("%Y-%m-%d %H:%M UTC"),
        "code": code_revision(),
        "machine": machine_info(),
        "repeats": args.repeats,
        "timeline": {
            "turns": args.turns,
            "folds": Consolidation.objects.filter(chat_id=chat_id).count(),
            "median_ms": round(timeline_ms, 1),
            "svg_bytes": len(svg.encode()),
        },
        "fleet": {
            "ledger_rows": Consolidation.objects.count(),
            "median_ms": round(fleet_ms, 1),
            "page_bytes": page_bytes,
            "window_plan": window_plan(),
        },
        "goals": {"timeline_ms": 1000, "svg_bytes": 300_000, "fleet_ms": 300},
    }
    write_report(report, args.out)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
