"""Indexes for the admin's fleet page: the ledger's finished_at (it reads one window of folds, an
hour or a day, by when they finished), and the few degraded, failing and paused chats it counts
and lists (conversations.services.fleet).

Built concurrently on PostgreSQL: a large ledger keeps taking folds' writes while they build. A
build that was interrupted leaves an invalid index of the same name, which IF NOT EXISTS would
keep for good: it is dropped and built again."""

from django.db import migrations, models

# name -> (table, columns, condition), as the models' Meta declares them
INDEXES = {
    "consolidation_finished": ("conversations_consolidation", "finished_at", ""),
    "brief_degraded": ("conversations_brief", "chat_id", "degraded"),
    "brief_failing": ("conversations_brief", "consecutive_failures", "consecutive_failures > 0"),
    "chat_folds_paused": ("conversations_chat", "id", "folds_paused"),
}


def create_indexes(apps, schema_editor):
    postgres = schema_editor.connection.vendor == "postgresql"
    concurrently = "CONCURRENTLY " if postgres else ""
    for name, (table, column, condition) in INDEXES.items():
        quoted = schema_editor.quote_name(name)
        if postgres and not valid_or_absent(schema_editor, name):
            schema_editor.execute(f"DROP INDEX CONCURRENTLY IF EXISTS {quoted}")
        where = f" WHERE {condition}" if condition else ""
        schema_editor.execute(
            f"CREATE INDEX {concurrently}IF NOT EXISTS {quoted} ON "
            f"{schema_editor.quote_name(table)} ({schema_editor.quote_name(column)}){where}"
        )


def valid_or_absent(schema_editor, name):
    with schema_editor.connection.cursor() as cursor:
        cursor.execute(
            "SELECT i.indisvalid FROM pg_index i JOIN pg_class c ON c.oid = i.indexrelid "
            "WHERE c.relname = %s",
            [name],
        )
        found = cursor.fetchone()
    return found is None or found[0]


def drop_indexes(apps, schema_editor):
    concurrently = "CONCURRENTLY " if schema_editor.connection.vendor == "postgresql" else ""
    for name in INDEXES:
        schema_editor.execute(f"DROP INDEX {concurrently}IF EXISTS {schema_editor.quote_name(name)}")


class Migration(migrations.Migration):
    atomic = False  # CREATE INDEX CONCURRENTLY cannot run in a transaction

    dependencies = [
        ("conversations", "0016_ledger_heartbeat"),
    ]

    operations = [
        migrations.SeparateDatabaseAndState(
            state_operations=[
                migrations.AddIndex(
                    model_name="consolidation",
                    index=models.Index(fields=["finished_at"], name="consolidation_finished"),
                ),
                migrations.AddIndex(
                    model_name="brief",
                    index=models.Index(
                        condition=models.Q(("degraded", True)),
                        fields=["chat"],
                        name="brief_degraded",
                    ),
                ),
                migrations.AddIndex(
                    model_name="brief",
                    index=models.Index(
                        condition=models.Q(("consecutive_failures__gt", 0)),
                        fields=["consecutive_failures"],
                        name="brief_failing",
                    ),
                ),
                migrations.AddIndex(
                    model_name="chat",
                    index=models.Index(
                        condition=models.Q(("folds_paused", True)),
                        fields=["id"],
                        name="chat_folds_paused",
                    ),
                ),
            ],
            database_operations=[migrations.RunPython(create_indexes, drop_indexes)],
        ),
    ]
