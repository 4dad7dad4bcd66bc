"""The hot path's plain-SQL reads (conversations.rows) give what the ORM gives: the same field
values, converted the same way (JSON, datetimes, UUIDs). ``mismatches`` also runs on SQLite, in
tests/test_embedded_sqlite.py."""

from typing import Any

import pytest
from django.db.models import Model

from memory_worker.agents.summaries import summarize_turns


def field_values(instance: Model, names: Any = None) -> dict[str, Any]:
    return {
        field.attname: getattr(instance, field.attname)
        for field in instance._meta.concrete_fields
        if names is None or field.name in names or field.attname in names
    }


def mismatches(chat_id: int, token_key: str) -> list[str]:
    """What differs between each plain-SQL read of the chat and the ORM's read of the same."""
    from rest_framework.authtoken.models import Token

    from conversations.authentication import TokenAuthentication
    from conversations.models import AgentState, Brief, Chat, Message
    from memory_worker.folding.snapshot import (
        UNFOLDED_FIELDS,
        load_snapshot,
        read_brief,
        read_chat,
        read_chat_and_snapshot,
        read_unfolded,
    )

    found: list[str] = []

    def compare(label: str, plain: dict[str, Any], orm: dict[str, Any]) -> None:
        if plain != orm:
            found.append(f"{label}: {plain!r} != {orm!r}")

    plain_chat = read_chat(chat_id)
    assert plain_chat is not None
    compare("chat", field_values(plain_chat), field_values(Chat.objects.get(pk=chat_id)))
    brief, (agent_block, agent_tokens, agent_exists) = read_brief(chat_id)
    compare("brief", field_values(brief), field_values(Brief.objects.get(chat_id=chat_id)))
    agent = AgentState.objects.filter(chat_id=chat_id).first()
    compare(
        "agent state",
        {"block": agent_block, "tokens": agent_tokens, "exists": bool(agent_exists)},
        {
            "block": agent and agent.context_block,
            "tokens": agent and agent.context_tokens,
            "exists": agent is not None,
        },
    )
    orm_tail = Message.objects.filter(chat_id=chat_id, seq__gt=brief.last_consolidated)
    compare(
        "unfolded",
        {
            "rows": [
                field_values(m, UNFOLDED_FIELDS)
                for m in read_unfolded(chat_id, brief.last_consolidated)
            ]
        },
        {"rows": [field_values(m, UNFOLDED_FIELDS) for m in orm_tail.order_by("seq")]},
    )
    # PostgreSQL reads the brief and the tail in one statement, the tail as JSON.
    snapshot = load_snapshot(chat_id)
    compare(
        "snapshot",
        {
            "watermark": snapshot.last_consolidated,
            "summary": snapshot.summary,
            "agent": snapshot.agent_context,
            "rows": [field_values(m, UNFOLDED_FIELDS) for m in snapshot.unfolded],
        },
        {
            "watermark": brief.last_consolidated,
            "summary": brief.summary,
            "agent": agent.context_block if agent else "",
            "rows": [field_values(m, UNFOLDED_FIELDS) for m in orm_tail.order_by("seq")],
        },
    )
    # A fold's first read: the chat and the same snapshot, in one statement on PostgreSQL.
    pair = read_chat_and_snapshot(chat_id)
    assert pair is not None
    compare("fold's chat", field_values(pair[0]), field_values(Chat.objects.get(pk=chat_id)))
    compare(
        "fold's snapshot",
        {**pair[1].__dict__, "unfolded": [field_values(m) for m in pair[1].unfolded]},
        {**snapshot.__dict__, "unfolded": [field_values(m) for m in snapshot.unfolded]},
    )
    user, token = TokenAuthentication().authenticate_credentials(token_key)
    expected = Token.objects.select_related("user").get(key=token_key)
    compare("user", field_values(user), field_values(expected.user))
    compare("token", field_values(token), field_values(expected))
    if token.user is not user:
        found.append("token.user is not the user returned")
    return found


@pytest.mark.django_db
def test_plain_reads_match_the_orm(api, user) -> None:  # type: ignore[no-untyped-def]
    from rest_framework.authtoken.models import Token

    from conversations.models import AgentState

    chat = api.post("/api/v1/chats/", {"title": "rows"}, format="json").json()["id"]
    for number in range(3):
        body = {"content": f"message {number}", "agent": {"decision": "plan_direct"}}
        assert api.post(f"/api/v1/chats/{chat}/turns/", body, format="json").status_code == 201
    summarize_turns(chat)
    assert AgentState.objects.filter(chat_id=chat).exists()  # the brief's join has one to find
    assert mismatches(chat, Token.objects.get(user=user).key) == []


@pytest.mark.django_db
def test_a_difference_is_reported(api, user) -> None:  # type: ignore[no-untyped-def]
    """The comparison can fail: a message changed behind the plain read's back shows."""
    from unittest import mock

    from rest_framework.authtoken.models import Token

    from memory_worker.folding import snapshot as state

    chat = api.post("/api/v1/chats/", {"title": "rows"}, format="json").json()["id"]
    assert (
        api.post(f"/api/v1/chats/{chat}/turns/", {"content": "hi"}, format="json").status_code
        == 201
    )
    real = state.read_unfolded

    def altered(chat_id: int, watermark: int) -> Any:
        messages = real(chat_id, watermark)
        messages[0].metadata = {"changed": True}
        return messages

    with mock.patch.object(state, "read_unfolded", altered):
        found = mismatches(chat, Token.objects.get(user=user).key)
    # On SQLite the snapshot reads the tail through read_unfolded too, and differs as well.
    assert found and found[0].startswith("unfolded")
    assert all(line.startswith(("unfolded", "snapshot")) for line in found), found


@pytest.mark.django_db
def test_the_tail_read_as_json_is_the_orms(api, user) -> None:  # type: ignore[no-untyped-def]
    """The one-statement snapshot (PostgreSQL) has the tail go through PostgreSQL's JSON and
    back: text with quotes, escapes and characters outside the BMP, and metadata with nested
    values, floats, large integers, nulls and booleans come back as the ORM reads them."""
    from rest_framework.authtoken.models import Token

    from conversations.models import Message

    chat = api.post("/api/v1/chats/", {"title": "rows"}, format="json").json()["id"]
    contents = [
        'quotes " and \\ backslash, tab\t, newline\n, é, 漢字, 🎉, \u2028',
        "  padded  ",
        "x" * 5000,
    ]
    for content in contents:
        assert (
            api.post(
                f"/api/v1/chats/{chat}/turns/", {"content": content}, format="json"
            ).status_code
            == 201
        )
    Message.objects.filter(chat_id=chat, seq=2).update(
        metadata={
            "nested": {"list": [1, 2.5, None, True, False, "s"], "deep": {"a": {"b": []}}},
            "big": 2**62,
            "float": 0.1,
            "unicode": "🎉 é",
        }
    )
    assert mismatches(chat, Token.objects.get(user=user).key) == []


def test_json_rows_refuse_fields_json_would_change() -> None:
    """A datetime (or a UUID, a decimal) comes out of JSON as a string, not what the ORM gives:
    reading it that way is refused, not silently wrong."""
    from conversations import rows
    from conversations.models import Chat, Message

    assert rows.json_exact(Message, ("id", "chat_id", "seq", "role", "metadata"))
    with pytest.raises(ValueError, match="cannot all be read from JSON"):
        rows.instances_from_json(Chat, rows.selected_fields(Chat, ["id", "created_at"]), [])


@pytest.mark.django_db
def test_instances_are_what_from_db_builds(api) -> None:  # type: ignore[no-untyped-def]
    """rows.instantiate skips Model.__init__; the instance must not differ: same values, same
    deferred fields (which still load on access), not adding, the same database."""
    from conversations import rows
    from conversations.models import Message
    from memory_worker.folding.snapshot import UNFOLDED_FIELDS

    chat = api.post("/api/v1/chats/", {"title": "rows"}, format="json").json()["id"]
    assert api.post(f"/api/v1/chats/{chat}/turns/", {"content": "hi"}, format="json").status_code
    fields = rows.selected_fields(Message, UNFOLDED_FIELDS)
    attnames = [field.attname for field in fields]
    stored = Message.objects.filter(chat_id=chat).order_by("seq").first()
    assert stored is not None
    values = [getattr(stored, name) for name in attnames]
    fast = rows.instantiate(Message, "default", attnames, values)
    slow = Message.from_db("default", attnames, values)
    assert type(fast) is Message
    assert {k: v for k, v in fast.__dict__.items() if k != "_state"} == {
        k: v for k, v in slow.__dict__.items() if k != "_state"
    }
    deferred = {"model_variant", "created_at"}
    assert fast.get_deferred_fields() == slow.get_deferred_fields() == deferred
    assert (fast._state.adding, fast._state.db) == (slow._state.adding, slow._state.db)
    assert fast.created_at == stored.created_at  # a deferred field loads on access
    assert fast == stored and fast.chat.pk == chat


def test_init_receivers_get_their_signals() -> None:
    """A model someone listens to is built through Model.__init__, so the receiver runs."""
    from django.db.models import signals

    from conversations import rows
    from conversations.models import Message

    seen: list[object] = []

    def receiver(sender: object, instance: object, **kwargs: object) -> None:
        seen.append(instance)

    signals.post_init.connect(receiver, sender=Message)
    try:
        built = rows.instantiate(Message, "default", ["id", "seq"], [5, 3])
    finally:
        signals.post_init.disconnect(receiver, sender=Message)
    assert seen == [built]
    assert rows.instantiate(Message, "default", ["id", "seq"], [5, 3]).seq == 3


def ledger_row(chat_id: int, from_seq: int) -> Any:
    from conversations.models import Consolidation

    return Consolidation(
        chat_id=chat_id,
        trigger="window",
        from_seq=from_seq,
        to_seq=from_seq + 11,
        base_version=3,
        summary_tokens_before=42,
        worker="worker@host",
    )


@pytest.mark.usefixtures("require_postgres")
def test_a_row_inserted_without_flush_wait_is_the_orms(api) -> None:  # type: ignore[no-untyped-def]
    from conversations.models import Consolidation
    from conversations.rows import insert_without_flush_wait

    chat = api.post("/api/v1/chats/", {"title": "ledger"}, format="json").json()["id"]
    by_orm, plain = ledger_row(chat, 1), ledger_row(chat, 1)
    by_orm.save(force_insert=True)
    insert_without_flush_wait(plain)
    assert plain.pk is not None and plain.pk != by_orm.pk
    assert not plain._state.adding
    stored = {row.pk: field_values(row) for row in Consolidation.objects.filter(chat_id=chat)}
    ignored = {"id", "started_at", "heartbeat_at"}  # stamped by the database at the insert
    assert {k: v for k, v in stored[plain.pk].items() if k not in ignored} == {
        k: v for k, v in stored[by_orm.pk].items() if k not in ignored
    }
    assert stored[plain.pk]["status"] == "running" and stored[plain.pk]["due_at"] is None
    assert stored[plain.pk]["started_at"] == plain.started_at
    assert stored[plain.pk]["heartbeat_at"] is not None


def statements_during(action: Any) -> list[str]:
    from django.db import connection
    from django.test.utils import CaptureQueriesContext

    with CaptureQueriesContext(connection) as seen:
        action()
    return [query["sql"] for query in seen.captured_queries]


def synchronous_commit() -> str:
    from django.db import connection

    with connection.cursor() as cursor:
        cursor.execute("SHOW synchronous_commit")
        (setting,) = cursor.fetchone()
    return str(setting)


@pytest.mark.usefixtures("require_postgres")
def test_the_no_flush_wait_subquery_turns_synchronous_commit_off_for_its_transaction_only() -> None:
    """What a write joined with rows.NO_FLUSH_WAIT commits with: no wait for the WAL flush in its
    own transaction, the usual wait again in the next. Checked by the setting, not by counting
    pg_stat_wal's flushes, which are the cluster's (the suite's other processes add theirs)."""
    from django.db import connection, transaction

    from conversations.rows import NO_FLUSH_WAIT

    assert synchronous_commit() == "on"
    with transaction.atomic():
        with connection.cursor() as cursor:
            cursor.execute(f"SELECT no_flush_wait FROM {NO_FLUSH_WAIT}")
        assert synchronous_commit() == "off"
    assert synchronous_commit() == "on"


@pytest.mark.usefixtures("require_postgres")
def test_the_running_ledger_row_does_not_wait_for_a_flush(api) -> None:  # type: ignore[no-untyped-def]
    """The running row's insert is one statement joined with NO_FLUSH_WAIT (the fold's own
    commit later flushes it); the ORM's insert is not."""
    from conversations.rows import NO_FLUSH_WAIT, insert_without_flush_wait

    chat = api.post("/api/v1/chats/", {"title": "flushes"}, format="json").json()["id"]
    by_orm = statements_during(lambda: ledger_row(chat, 1).save(force_insert=True))
    running = statements_during(lambda: insert_without_flush_wait(ledger_row(chat, 13)))
    assert not any(NO_FLUSH_WAIT in sql for sql in by_orm)
    inserts = [sql for sql in running if sql.lstrip().upper().startswith("INSERT")]
    assert len(inserts) == 1 and NO_FLUSH_WAIT in inserts[0]


@pytest.mark.usefixtures("require_postgres")
def test_a_turns_claim_does_not_wait_for_a_flush(api, user) -> None:  # type: ignore[no-untyped-def]
    """The claim of a turn's slot commits without waiting for a WAL flush (the append's commit
    flushes it): its UPDATE is joined with NO_FLUSH_WAIT; freeing the slot is not."""
    from conversations.models import Chat
    from conversations.rows import NO_FLUSH_WAIT
    from conversations.services.turn_slot import claim_owned_chat, release_turn_slot

    chat_id = api.post("/api/v1/chats/", {"title": "claim"}, format="json").json()["id"]
    claimed: list[Any] = []
    claim = statements_during(lambda: claimed.append(claim_owned_chat(user.pk, chat_id)))
    # The claim's UPDATE sits in a WITH that reads the snapshot in the same statement.
    updates = [sql for sql in claim if "UPDATE" in sql and "turn_token" in sql]
    assert updates and all(NO_FLUSH_WAIT in sql for sql in updates)
    assert Chat.objects.get(pk=chat_id).turn_token == claimed[0].token
    release = statements_during(lambda: release_turn_slot(claimed[0].chat, claimed[0].token))
    assert not any(NO_FLUSH_WAIT in sql for sql in release)
