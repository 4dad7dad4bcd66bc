"""A person's edit of a chat's summary (docs/api.md, "Editing the summary"): written through the
same fencing step as a fold (memory_worker.folding.commit: one conditional UPDATE on the version
and W, row count checked), so an edit and a fold that read the same version cannot both commit.
The one that loses is a 412 (the edit) or ``superseded`` (the fold, which runs again from the
edited text). The ledger records the edit as a row of its own, trigger ``edit``."""

from dataclasses import dataclass

from django.db import connection, transaction

from conversations.models import Brief, Chat, Consolidation, hold_chat
from conversations.rows import database_now
from memory_worker.engine import policy as engine
from memory_worker.folding.commit import FoldWrite, commit_in_one_statement, commit_in_transaction
from memory_worker.folding.effective_policy import chat_tokens, policy_for_chat
from memory_worker.folding.snapshot import make_snapshot
from memory_worker.summaries.retention import summary_lines


class EditRefused(Exception):
    """The edit was not written; the message says why."""


class VersionMoved(EditRefused):
    """The brief's version is no longer the one the edit was made on (a fold or another edit
    committed since)."""

    def __init__(self, expected: int, current: int | None) -> None:
        self.current = current
        # Versions only grow: one above the current never was, and "changed since" would
        # send the client looking for a change that did not happen.
        if current is not None and expected > current:
            said = f"Version {expected} of the summary never existed (it is at version {current})"
        else:
            said = f"The summary changed since version {expected} (it is now version {current})"
        super().__init__(
            f"{said}: read the brief again (its ETag) and apply the edit to that summary."
        )


class OverCap(EditRefused):
    def __init__(self, tokens: int, cap: int) -> None:
        super().__init__(
            f"The summary is {tokens} tokens; this chat's summary cap (summary_token_cap) is "
            f"{cap} tokens."
        )


@dataclass(frozen=True)
class Edited:
    version: int  # the brief's new version (its ETag)
    summary_tokens: int
    user_lines: list[str]
    ledger_id: int


def user_written(old_summary: str, old_user_lines: list[str], new_summary: str) -> list[str]:
    """The new summary's lines a person wrote: those the old summary lacked, and those of the
    old summary a person had written before, each once, in the new summary's order."""
    before = {line.text for line in summary_lines(old_summary)}
    kept = set(old_user_lines)
    found = (line.text for line in summary_lines(new_summary))
    return list(dict.fromkeys(text for text in found if text not in before or text in kept))


def edit_summary(chat: Chat, summary: str, expected_version: int, *, editor: str) -> Edited:
    """Replaces the summary of ``chat`` if its brief is still at ``expected_version``, else
    raises VersionMoved; OverCap over the chat's summary cap; Chat.DoesNotExist for a chat
    deleted meanwhile (not a 412 that has the client re-read it). Nothing is written on a
    refusal."""
    cap = policy_for_chat(chat).summary_token_cap
    # As the folds count it: the cap and every later context count the summary for the model.
    tokens = chat_tokens(chat, summary)
    if tokens > cap:
        raise OverCap(tokens, cap)
    brief = Brief.objects.filter(chat_id=chat.pk).first()
    if brief is None:  # a brief goes only with its chat
        raise Chat.DoesNotExist(f"chat {chat.pk} does not exist")
    if brief.version != expected_version:
        raise VersionMoved(expected_version, brief.version)
    lines = user_written(brief.summary, list(brief.user_lines or []), summary)
    # What the fencing step compares: the version and W this edit was made on.
    read = make_snapshot(chat.pk, brief, ("", 0, False), ())
    now = database_now()  # stamps the brief: cooldowns read it on other hosts
    watermark = brief.last_consolidated
    commit = commit_in_one_statement if connection.vendor == "postgresql" else commit_in_transaction
    with transaction.atomic():
        # The chat held first, as a deletion takes it before the brief and the ledger: a
        # deletion then waits for the edit, or the edit finds the chat gone.
        if not hold_chat(chat.pk):
            raise Chat.DoesNotExist(f"chat {chat.pk} does not exist")
        # Inserted and settled in one transaction: the recovery of dead runs never sees it
        # "running", and a lost fencing step leaves no row.
        ledger = Consolidation.objects.create(
            chat_id=chat.pk,
            trigger=engine.Trigger.EDIT,
            from_seq=watermark + 1,
            to_seq=watermark,
            base_version=expected_version,
            summary_tokens_before=brief.summary_tokens,
            edited_by=editor[:150],
        )
        write = FoldWrite(
            chat_id=chat.pk,
            snapshot=read,
            ledger_id=ledger.pk,
            summary_tokens=tokens,
            dropped_details=[],
            brief_values={
                "summary": summary,
                "summary_tokens": tokens,
                "user_lines": lines,
                "updated_at": now,
            },
            ledger_values={"finished_at": now, "duration_ms": 0, "to_seq": watermark},
        )
        if not commit(write):
            current = Brief.objects.filter(chat_id=chat.pk).values_list("version", flat=True)
            version = current.first()
            if version is None:
                raise Chat.DoesNotExist(f"chat {chat.pk} does not exist")
            raise VersionMoved(expected_version, version)
    return Edited(expected_version + 1, tokens, lines, ledger.pk)
