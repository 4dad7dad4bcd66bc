"""The production path: turns queue consolidation through Redis to a real celery worker."""

import pytest

from conversations.models import Brief, Consolidation
from tests.conftest import client_for, contract_chat_after_turns
from tests.support.workers import Worker, point_celery_at, wait_until

pytestmark = [pytest.mark.postgres, pytest.mark.redis, pytest.mark.worker]


@pytest.fixture
def celery_broker(settings, clean_redis):  # type: ignore[no-untyped-def]
    """Publish from the test process to the test Redis, as the web process would."""

    previous = point_celery_at(clean_redis)
    settings.REDIS_URL = clean_redis
    settings.MEMORY_DISPATCH = "celery"
    from memory_worker.coordination.runtime import _lock

    _lock.cache_clear()
    yield clean_redis
    point_celery_at(previous)
    _lock.cache_clear()


def test_turns_are_folded_by_a_real_worker(require_postgres, celery_broker, user) -> None:  # type: ignore[no-untyped-def]
    worker = Worker(celery_broker, "fold")
    try:
        worker.wait_ready()
        api = client_for(user)
        chat_id = contract_chat_after_turns(api, 12)
        # The folds may go on while the test reads: compare once the ledger and the brief
        # agree, and only a fold that skipped or repeated a message keeps them apart.
        assert wait_until(lambda: folded_by_the_ledger(chat_id), timeout=30), worker.log()
        assert Brief.objects.get(chat_id=chat_id).summary
        succeeded = Consolidation.objects.filter(chat_id=chat_id, status="succeeded")
        assert all(row.worker for row in succeeded)
        assert_lag_recorded(api)
    finally:
        worker.stop()


def folded_by_the_ledger(chat_id: int) -> bool:
    """Something is folded, and the succeeded ledger rows cover 1..W exactly once."""
    succeeded = Consolidation.objects.filter(chat_id=chat_id, status="succeeded").order_by(
        "from_seq"
    )
    covered = [seq for row in succeeded for seq in range(row.from_seq, row.to_seq + 1)]
    watermark = Brief.objects.get(chat_id=chat_id).last_consolidated
    return watermark > 0 and covered == list(range(1, watermark + 1))


def assert_lag_recorded(api) -> None:  # type: ignore[no-untyped-def]
    """The task message carries when the turn found the fold due, so the worker's ledger row
    has it: sliding-window's 26th turn (backlog 12 beyond the tail of 40) asks for a fold."""
    chat_id = api.post("/api/v1/chats/", {"policy": "sliding-window"}, format="json").json()["id"]
    for number in range(26):
        response = api.post(
            f"/api/v1/chats/{chat_id}/turns/", {"content": f"note {number}"}, format="json"
        )
        assert response.status_code == 201
    assert wait_until(
        lambda: Consolidation.objects.filter(chat_id=chat_id, status="succeeded").exists(),
        timeout=30,
    )
    fold = Consolidation.objects.get(chat_id=chat_id, status="succeeded")
    assert not fold.synchronous
    assert fold.due_at is not None and fold.finished_at is not None
    assert fold.due_at < fold.finished_at


def test_turn_succeeds_with_the_broker_down(require_postgres, settings, user, caplog) -> None:  # type: ignore[no-untyped-def]
    import socket

    with socket.socket() as probe:  # a port nothing listens on
        probe.bind(("127.0.0.1", 0))
        dead_port = probe.getsockname()[1]
    previous = point_celery_at(f"redis://127.0.0.1:{dead_port}/0")
    settings.MEMORY_DISPATCH = "celery"
    try:
        api = client_for(user)
        chat_id = api.post("/api/v1/chats/", {"policy": "contract"}, format="json").json()["id"]
        statuses = [
            api.post(
                f"/api/v1/chats/{chat_id}/turns/", {"content": f"m{n}"}, format="json"
            ).status_code
            for n in range(8)
        ]
        assert statuses == [201] * 8
        assert any(getattr(r, "event", "") == "enqueue_failed" for r in caplog.records)
    finally:
        point_celery_at(previous)
