"""A long chat's unfolded tail is read by (chat, seq), not by chat alone: the turn's and the
fold's snapshot statements must cost the same at message 5,000 as at message 50.

The watermark W comes from the brief row, so PostgreSQL plans the tail's ``seq > W`` without
knowing W. With a chat_id-only index beside (chat, seq) it chose that index here and filtered
every message of the chat (a database of 200 chats is enough to make it do so), which made a
turn at message 100,000 cost 2.5 times a turn at message 10 (docs/benchmarks.md). The plan is
read with EXPLAIN ANALYZE after ANALYZE, so it is the one the statistics lead to."""

import json
from datetime import timedelta
from typing import Any

import pytest
from django.db import connection
from django.db.models.functions import Now

from conversations.models import (
    PRUNABLE_STATUSES,
    Brief,
    Chat,
    Consolidation,
    ConsolidationStatus,
    Message,
)
from conversations.services.chats import create_chat
from memory_worker.folding.snapshot import chat_with_snapshot_query, snapshot_query

LONG, SHORT, OTHER_CHATS, TAIL = 5000, 200, 199, 40


def add_messages(chat_id: int, count: int) -> None:
    table = connection.ops.quote_name(Message._meta.db_table)
    with connection.cursor() as cursor:
        cursor.execute(
            f"INSERT INTO {table} (chat_id, seq, role, content, token_count, model_variant, "
            "metadata, created_at) "
            "SELECT %s, n, CASE WHEN n %% 2 = 1 THEN 'user' ELSE 'assistant' END, "
            "'message ' || n, 3, '', '{}'::jsonb, now() FROM generate_series(1, %s) AS n",
            [chat_id, count],
        )
    Chat.objects.filter(pk=chat_id).update(last_seq=count)
    Brief.objects.filter(chat_id=chat_id).update(last_consolidated=count - TAIL)


def message_scans(plan: Any) -> list[dict[str, Any]]:
    """Every plan node that reads conversations_message."""
    found = []
    if plan.get("Relation Name") == Message._meta.db_table:
        found.append(plan)
    for child in plan.get("Plans", []):
        found.extend(message_scans(child))
    return found


def explain(sql: str, params: list[Any]) -> list[dict[str, Any]]:
    with connection.cursor() as cursor:
        cursor.execute(f"EXPLAIN (ANALYZE, FORMAT JSON) {sql}", params)
        (document,) = cursor.fetchone()
    plan = (json.loads(document) if isinstance(document, str) else document)[0]["Plan"]
    return message_scans(plan)


@pytest.mark.usefixtures("require_postgres")
def test_the_tail_of_a_long_chat_is_read_by_chat_and_seq(user) -> None:  # type: ignore[no-untyped-def]
    long_chat = create_chat(user, title="long").pk
    add_messages(long_chat, LONG)
    for index in range(OTHER_CHATS):
        add_messages(create_chat(user, title=f"other {index}").pk, SHORT)
    with connection.cursor() as cursor:
        for model in (Message, Brief, Chat):
            cursor.execute(f"ANALYZE {connection.ops.quote_name(model._meta.db_table)}")
    statements = {
        "snapshot (load_snapshot, the re-read after a synchronous fold)": (
            snapshot_query("%s"),
            [long_chat],
        ),
        "chat with snapshot (a turn's claim, a fold's first read)": (
            f"{chat_with_snapshot_query(connection.ops.quote_name(Chat._meta.db_table))} "
            "WHERE chat.id = %s",
            [long_chat],
        ),
    }
    for label, (sql, params) in statements.items():
        [scan] = explain(sql, params)
        assert "seq >" in scan.get("Index Cond", ""), (label, scan)
        assert scan["Actual Rows"] == TAIL, (label, scan)
        assert scan.get("Rows Removed by Filter", 0) == 0, (label, scan)


def plan_nodes(plan: Any) -> list[dict[str, Any]]:
    return [plan, *(node for child in plan.get("Plans", []) for node in plan_nodes(child))]


@pytest.mark.usefixtures("require_postgres")
def test_the_ledger_queries_of_the_sweep_read_only_their_rows(user) -> None:  # type: ignore[no-untyped-def]
    """The abandonment looks at the running rows every recovery interval, the retention at the
    old failed ones every sweep: each by its partial index, not by reading a large ledger."""
    chat_id = create_chat(user, title="ledger").pk
    table = connection.ops.quote_name(Consolidation._meta.db_table)
    with connection.cursor() as cursor:
        cursor.execute(
            f"INSERT INTO {table} (chat_id, trigger, status, from_seq, to_seq, base_version, "
            "synchronous, input_tokens, output_tokens, summary_tokens_before, "
            "summary_tokens_after, summarizer_calls, started_at, finished_at, error, error_kind, "
            "withheld_seqs, worker, dropped_details, edited_by) "
            "SELECT %s, 'window', CASE WHEN n <= 5 THEN 'running' WHEN n <= 50 THEN 'failed' "
            "ELSE 'succeeded' END, n, n, n, false, 0, 0, 0, 0, 1, now(), "
            "now() - interval '40 days', '', '', '[]', '', '[]', '' "
            "FROM generate_series(1, 50000) AS n",
            [chat_id],
        )
        cursor.execute(f"ANALYZE {table}")
    running = Consolidation.objects.filter(status=ConsolidationStatus.RUNNING)
    too_old = Now() - timedelta(seconds=60)
    prunable = Consolidation.objects.filter(
        status__in=PRUNABLE_STATUSES, finished_at__lt=Now() - timedelta(days=30)
    )
    queries = {
        "the running rows (recover_dead_runs)": running.order_by("pk").values_list("pk"),
        "the expired running rows": running.filter(started_at__lt=too_old).values_list("pk"),
        "the old rows to delete (prune_ledger)": prunable.order_by().values_list("pk")[:1000],
    }
    for label, query in queries.items():
        sql, params = query.query.sql_with_params()
        with connection.cursor() as cursor:
            cursor.execute(f"EXPLAIN (ANALYZE, FORMAT JSON) {sql}", params)
            (document,) = cursor.fetchone()
        plan = (json.loads(document) if isinstance(document, str) else document)[0]["Plan"]
        nodes = plan_nodes(plan)
        table_scans = [n for n in nodes if n.get("Relation Name") == Consolidation._meta.db_table]
        assert table_scans and all(n["Node Type"] != "Seq Scan" for n in table_scans), label
        indexes = {n.get("Index Name") for n in nodes}
        assert indexes & {"consolidation_running", "consolidation_prunable"}, (label, plan)
