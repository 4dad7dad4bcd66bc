"""Message.chat loses its own index: message_unique_chat_seq (chat, seq) serves every lookup by
chat, and with a chat_id-only index beside it PostgreSQL could read a long chat's unfolded tail
by chat_id alone and filter every message of the chat (models.Message).

Only the index goes. Django's own AlterField would also drop and re-add the foreign key, which
re-checks every message under lock; here the model state changes and the database only loses
the index, concurrently on PostgreSQL (no lock on the table while it goes)."""

import django.db.models.deletion
from django.db import migrations, models

# The name Django gave the foreign key's index in 0001 (same on every backend).
INDEX = "conversations_message_chat_id_7bd9dfad"


def drop_index(apps, schema_editor):
    concurrently = "CONCURRENTLY " if schema_editor.connection.vendor == "postgresql" else ""
    schema_editor.execute(f"DROP INDEX {concurrently}IF EXISTS {schema_editor.quote_name(INDEX)}")


def create_index(apps, schema_editor):
    concurrently = "CONCURRENTLY " if schema_editor.connection.vendor == "postgresql" else ""
    schema_editor.execute(
        f"CREATE INDEX {concurrently}IF NOT EXISTS {schema_editor.quote_name(INDEX)} "
        f"ON {schema_editor.quote_name('conversations_message')} "
        f"({schema_editor.quote_name('chat_id')})"
    )


class Migration(migrations.Migration):
    atomic = False  # DROP INDEX CONCURRENTLY cannot run in a transaction

    dependencies = [
        ("conversations", "0005_consolidation_due_at"),
    ]

    operations = [
        migrations.SeparateDatabaseAndState(
            state_operations=[
                migrations.AlterField(
                    model_name="message",
                    name="chat",
                    field=models.ForeignKey(
                        db_index=False,
                        on_delete=django.db.models.deletion.CASCADE,
                        related_name="messages",
                        to="conversations.chat",
                    ),
                ),
            ],
            database_operations=[migrations.RunPython(drop_index, create_index)],
        ),
    ]
