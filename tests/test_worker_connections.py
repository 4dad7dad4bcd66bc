"""A worker's database connections (chatmem_project.celery): kept across tasks as a web
process keeps them across requests, not opened anew for every fold. Celery's Django fixup closes
every connection around every task unless CELERY_DB_REUSE_MAX is set; that cost a PostgreSQL
backend process per fold (and with DB_POOL_MAX_SIZE a whole new pool)."""

import time
from collections.abc import Iterator
from typing import Any

import pytest

from memory_worker.tasks import fold_chat
from tests.support.workers import Worker, point_celery_at, wait_until

pytestmark = [pytest.mark.postgres, pytest.mark.redis, pytest.mark.worker]

CHATS = 20


@pytest.fixture
def broker(settings, clean_redis) -> Iterator[str]:  # type: ignore[no-untyped-def]
    previous = point_celery_at(clean_redis)
    settings.REDIS_URL = clean_redis
    settings.MEMORY_DISPATCH = "celery"
    yield clean_redis
    point_celery_at(previous)


def chats_with_a_fold_due(owner: Any) -> list[int]:
    from conversations.models import Chat, Message
    from conversations.services.chats import create_chat

    ids = [create_chat(owner, policy="sliding-window").pk for _ in range(CHATS)]
    length = 40 + 12  # sliding-window: tail 40, a fold due at 12 messages of backlog
    Message.objects.bulk_create(
        Message(
            chat_id=chat_id,
            seq=seq,
            role="user" if seq % 2 else "assistant",
            content=f"Message {seq}: the release is on Friday.",
            token_count=10,
        )
        for chat_id in ids
        for seq in range(1, length + 1)
    )
    Chat.objects.filter(pk__in=ids).update(last_seq=length)
    return ids


def sessions_started() -> int:
    """PostgreSQL's count of sessions ever opened on this database, once it has settled (the
    statistics of a session that just ended arrive a moment later)."""
    from django.db import connection

    def read() -> int:
        with connection.cursor() as cursor:
            cursor.execute("SELECT pg_stat_clear_snapshot()")
            cursor.execute(
                "SELECT sessions FROM pg_stat_database WHERE datname = current_database()"
            )
            return int(cursor.fetchone()[0])

    last = read()
    deadline = time.monotonic() + 10
    while time.monotonic() < deadline:
        time.sleep(0.5)  # the statistics collector's interval: nothing to wait on but the clock
        now = read()
        if now == last:
            return now
        last = now
    return last


@pytest.mark.parametrize("pool_size", ["", "2"], ids=["persistent", "pooled"])
def test_a_worker_reuses_its_connection_across_tasks(
    require_postgres: None, broker: str, user: Any, pool_size: str
) -> None:
    from conversations.models import Brief

    chat_ids = chats_with_a_fold_due(user)
    extra = {"DB_CONN_MAX_AGE": "60"} if not pool_size else {"DB_POOL_MAX_SIZE": pool_size}
    worker = Worker(broker, f"connections-{pool_size or 'persistent'}", env=extra)
    try:
        worker.wait_ready()
        before = sessions_started()
        for chat_id in chat_ids:
            fold_chat.apply_async(args=(chat_id, "sweep"))

        def all_folded() -> bool:
            folded = Brief.objects.filter(chat_id__in=chat_ids, last_consolidated__gt=0)
            return folded.count() == CHATS

        assert wait_until(all_folded, timeout=60), worker.log()
    finally:
        worker.stop()  # its sessions end, so all of them are counted
    opened = sessions_started() - before
    # One for the pool child that ran the 20 tasks; the main process may open one too. Closing
    # around every task opened about one per task (21 for these 20, 42 with a pool).
    assert opened <= 3, f"{opened} PostgreSQL sessions for {CHATS} tasks"
