"""Stored chats brought within rules added after they were written, so that none of them fails
every turn, fold and listing of its owner's chats once the new checks read it:

- policy overrides: every knob at most 1,000,000,000, and ``summary_token_cap`` from 64 (room
  for the five headings; the offline summarizer refused less) to 8,000 (beyond, models refuse
  the summarizer's output limit). A value outside is set to the nearest bound: the chat behaves
  as close to what was asked as the bounds allow.
- a brief for every chat: chats added in the admin got none, and every turn reads it.

The bounds are copied here, not imported: a migration keeps meaning what it meant when written."""

from django.db import migrations

MAX_KNOB = 10**9
SUMMARY_CAP = (64, 8000)


def within_bounds(knob, value):
    if isinstance(value, bool) or not isinstance(value, int | float):
        return value  # not a number: the API refuses it, as it always did
    if knob == "summary_token_cap":
        low, high = SUMMARY_CAP
        return min(max(value, low), high)
    return min(value, MAX_KNOB)


def bring_within_rules(apps, schema_editor):
    Chat = apps.get_model("conversations", "Chat")
    Brief = apps.get_model("conversations", "Brief")
    for chat in Chat.objects.exclude(policy_overrides={}).only("id", "policy_overrides").iterator():
        overrides = chat.policy_overrides
        if not isinstance(overrides, dict):
            continue
        bounded = {knob: within_bounds(knob, value) for knob, value in overrides.items()}
        if bounded != overrides:
            Chat.objects.filter(pk=chat.pk).update(policy_overrides=bounded)
    missing = Chat.objects.filter(brief__isnull=True).values_list("id", flat=True)
    Brief.objects.bulk_create([Brief(chat_id=chat_id) for chat_id in missing.iterator()])


class Migration(migrations.Migration):
    dependencies = [("conversations", "0006_message_chat_index_is_chat_seq")]

    operations = [migrations.RunPython(bring_within_rules, migrations.RunPython.noop)]
