"""An index on the ledger's finished_at for the admin's fleet page, which reads one window of
folds (an hour, a day) by when they finished (conversations.services.fleet).

Built concurrently on PostgreSQL: a large ledger keeps taking folds' writes while it builds."""

from django.db import migrations, models

INDEX = "consolidation_finished"


def create_index(apps, schema_editor):
    concurrently = "CONCURRENTLY " if schema_editor.connection.vendor == "postgresql" else ""
    schema_editor.execute(
        f"CREATE INDEX {concurrently}IF NOT EXISTS {schema_editor.quote_name(INDEX)} "
        f"ON {schema_editor.quote_name('conversations_consolidation')} "
        f"({schema_editor.quote_name('finished_at')})"
    )


def drop_index(apps, schema_editor):
    concurrently = "CONCURRENTLY " if schema_editor.connection.vendor == "postgresql" else ""
    schema_editor.execute(f"DROP INDEX {concurrently}IF EXISTS {schema_editor.quote_name(INDEX)}")


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
                    index=models.Index(fields=["finished_at"], name=INDEX),
                ),
            ],
            database_operations=[migrations.RunPython(create_index, drop_index)],
        ),
    ]
