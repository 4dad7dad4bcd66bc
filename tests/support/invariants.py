"""The ledger's invariants, checked from the database alone (docs/design.md, data model): the
succeeded folds of a chat cover 1..W exactly once, in order; messages are numbered 1..last_seq
without gaps; the brief's version counts the succeeded folds and edits. Used by tests and the chaos
script."""

from conversations.models import Brief, Chat, Consolidation, ConsolidationStatus, Message
from memory_worker.engine.policy import Trigger


def chat_violations(chat_id: int) -> list[str]:
    problems: list[str] = []
    chat = Chat.objects.get(pk=chat_id)
    brief = Brief.objects.get(chat_id=chat_id)
    seqs = list(
        Message.objects.filter(chat_id=chat_id).order_by("seq").values_list("seq", flat=True)
    )
    if seqs != list(range(1, chat.last_seq + 1)):
        problems.append(f"chat {chat_id}: messages are not numbered 1..{chat.last_seq}")
    succeeded = Consolidation.objects.filter(chat_id=chat_id, status=ConsolidationStatus.SUCCEEDED)
    # A person's edit of the summary advances the version like a fold and folds no message.
    edits = succeeded.filter(trigger=Trigger.EDIT).count()
    folds = list(
        succeeded.exclude(trigger=Trigger.EDIT)
        .order_by("from_seq")
        .values_list("from_seq", "to_seq")
    )
    expected_start = 1
    for from_seq, to_seq in folds:
        if from_seq != expected_start or to_seq < from_seq:
            problems.append(
                f"chat {chat_id}: fold {from_seq}..{to_seq} does not start at {expected_start}"
            )
        expected_start = to_seq + 1
    if expected_start - 1 != brief.last_consolidated:
        problems.append(
            f"chat {chat_id}: succeeded folds cover 1..{expected_start - 1}, "
            f"but W = {brief.last_consolidated}"
        )
    if brief.version != len(folds) + edits:
        problems.append(
            f"chat {chat_id}: version {brief.version} != {len(folds)} succeeded folds "
            f"+ {edits} edits"
        )
    if brief.last_consolidated > chat.last_seq:
        problems.append(f"chat {chat_id}: W {brief.last_consolidated} beyond last_seq")
    return problems
