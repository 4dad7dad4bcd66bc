"""Chats, their append-only messages, the memory brief and the consolidation ledger
(docs/design.md, data model).

Invariants kept here:
- ``Message.seq`` is 1, 2, 3… per chat, allocated from ``Chat.last_seq`` under the chat's row
  lock in the transaction that stores the message, so sequence order is commit order.
- ``Brief.last_consolidated`` (W) only moves forward, by one conditional UPDATE per fold that
  also bumps ``version`` (the fencing token).
"""

from django.conf import settings
from django.db import connection, models
from django.db.models.signals import pre_delete
from django.dispatch import receiver


class Role(models.TextChoices):
    SYSTEM = "system"
    USER = "user"
    ASSISTANT = "assistant"
    TOOL = "tool"


class Chat(models.Model):
    owner = models.ForeignKey(
        settings.AUTH_USER_MODEL, on_delete=models.CASCADE, related_name="chats"
    )
    title = models.CharField(max_length=200, blank=True)
    system_prompt = models.TextField(blank=True)
    system_prompt_tokens = models.PositiveIntegerField(default=0)
    policy = models.CharField(max_length=40)
    policy_overrides = models.JSONField(default=dict, blank=True)
    model_variant = models.CharField(max_length=100, blank=True)
    # The name an OpenAI-compatible client gives the conversation (X-Chatmem-Chat-Id, `user` or
    # metadata): unique per owner, empty for chats made through the REST API.
    external_id = models.CharField(max_length=200, blank=True, default="")
    last_seq = models.PositiveBigIntegerField(default=0)
    # The owner paused background folds (API PATCH, /v1 "chatmem": {"fold": "pause"}): dispatch
    # and the sweep skip the chat; a turn over its hard bound still folds (promise 2,
    # docs/design.md).
    folds_paused = models.BooleanField(default=False)
    # The turn slot: one turn at a time per chat, claimed by a conditional UPDATE.
    turn_token = models.UUIDField(null=True, blank=True)
    turn_started_at = models.DateTimeField(null=True, blank=True)
    created_at = models.DateTimeField(auto_now_add=True)
    updated_at = models.DateTimeField(auto_now=True)

    class Meta:
        ordering = ["-created_at", "-id"]
        indexes = [
            models.Index(fields=["owner", "-created_at"]),
            # The fleet page counts the few chats whose folds a person paused.
            models.Index(
                fields=["id"], name="chat_folds_paused", condition=models.Q(folds_paused=True)
            ),
        ]
        constraints = [
            models.UniqueConstraint(
                fields=["owner", "external_id"],
                condition=~models.Q(external_id=""),
                name="chat_owner_external_id_unique",
            )
        ]

    def __str__(self) -> str:
        return self.title or f"Chat {self.pk}"


class Message(models.Model):
    # No index of its own: message_unique_chat_seq (chat, seq) serves every lookup by chat. A
    # chat_id-only index beside it lets PostgreSQL read a long chat's unfolded tail (seq > W, W
    # known only at run time) through that index, filtering every message of the chat
    # (docs/benchmarks.md, turn overhead).
    chat = models.ForeignKey(
        Chat, on_delete=models.CASCADE, related_name="messages", db_index=False
    )
    seq = models.PositiveBigIntegerField()
    role = models.CharField(max_length=16, choices=Role.choices)
    content = models.TextField()
    token_count = models.PositiveIntegerField()
    model_variant = models.CharField(max_length=100, blank=True)
    metadata = models.JSONField(default=dict, blank=True)
    created_at = models.DateTimeField(auto_now_add=True)

    class Meta:
        ordering = ["chat", "seq"]
        constraints = [
            models.UniqueConstraint(fields=["chat", "seq"], name="message_unique_chat_seq"),
            models.CheckConstraint(condition=models.Q(seq__gte=1), name="message_seq_positive"),
        ]

    def __str__(self) -> str:
        return f"{self.chat_id}#{self.seq} {self.role}"


class Brief(models.Model):
    """The chat's memory: the rolling summary and the watermark W of what it covers."""

    chat = models.OneToOneField(
        Chat, on_delete=models.CASCADE, primary_key=True, related_name="brief"
    )
    summary = models.TextField(blank=True)
    summary_tokens = models.PositiveIntegerField(default=0)
    last_consolidated = models.PositiveBigIntegerField(default=0)
    last_consolidated_at = models.DateTimeField(null=True, blank=True)
    version = models.PositiveBigIntegerField(default=0)
    # chat.last_seq when the last fold was decided: later user messages count for the safety
    # trigger (it counts user turns since the last fold, docs/policies.md, contract).
    turns_mark = models.PositiveBigIntegerField(default=0)
    consecutive_failures = models.PositiveIntegerField(default=0)
    degraded = models.BooleanField(default=False)
    next_attempt_at = models.DateTimeField(null=True, blank=True, db_index=True)
    last_error = models.TextField(blank=True)
    # Messages folded past without their content (the summarizer refused them; docs/policies.md,
    # poison messages): [{"seq", "reason"}, ...], oldest first. Their text stays in the history.
    withheld = models.JSONField(default=list, blank=True)
    # The error kind of the failure in last_error, until a model fold commits: a retry after an
    # invalid summary asks with the stricter prompt.
    failure_kind = models.CharField(max_length=32, blank=True)
    # Set while the summary is the offline summarizer's fallback (since the first such fold, and
    # why); the next model fold clears both.
    fallback_since = models.DateTimeField(null=True, blank=True)
    fallback_reason = models.TextField(blank=True)
    # The summary's lines a person wrote (an edit through the API or the admin), as
    # memory_worker.summaries.retention.summary_lines gives them: folds keep them unless a folded
    # message revokes them (memory_worker.summaries.guard), and a fold drops those its summary no
    # longer has.
    user_lines = models.JSONField(default=list, blank=True)
    # A fold came due and could not be queued (the broker timed out or refused; database time):
    # the sweep takes the chat at its next tick, whatever its last fold's age, and clears it.
    enqueue_missed_at = models.DateTimeField(null=True, blank=True)
    updated_at = models.DateTimeField(auto_now=True)

    class Meta:
        indexes = [
            models.Index(fields=["last_consolidated_at"], name="brief_last_consolidated_at"),
            models.Index(
                fields=["enqueue_missed_at"],
                name="brief_enqueue_missed",
                condition=models.Q(enqueue_missed_at__isnull=False),
            ),
            # The admin's fleet page counts and lists the few degraded and failing chats without
            # reading every brief (conversations.services.fleet).
            models.Index(fields=["chat"], name="brief_degraded", condition=models.Q(degraded=True)),
            models.Index(
                fields=["consecutive_failures"],
                name="brief_failing",
                condition=models.Q(consecutive_failures__gt=0),
            ),
        ]

    def __str__(self) -> str:
        return f"Brief of chat {self.chat_id} (W={self.last_consolidated}, v{self.version})"


class ConsolidationStatus(models.TextChoices):
    RUNNING = "running"
    SUCCEEDED = "succeeded"
    FAILED = "failed"
    SUPERSEDED = "superseded"
    # Its worker died mid-fold (kill -9, out of memory): nothing was written, and it is not the
    # chat's failure (memory_worker.scheduling.sweep).
    INTERRUPTED = "interrupted"
    # A manual fold asked for when every message it may fold was folded: its trace.
    NOTHING_TO_FOLD = "nothing_to_fold"


# Ledger rows the retention deletes once older than MEMORY_LEDGER_RETENTION_DAYS: every outcome
# but "succeeded" (the committed rows prove coverage of 1..W) and "running".
PRUNABLE_STATUSES = [
    ConsolidationStatus.FAILED.value,
    ConsolidationStatus.SUPERSEDED.value,
    ConsolidationStatus.INTERRUPTED.value,
    ConsolidationStatus.NOTHING_TO_FOLD.value,
]


class Consolidation(models.Model):
    """The ledger: one row per fold attempt. Succeeded rows of a chat cover 1..W exactly once."""

    chat = models.ForeignKey(Chat, on_delete=models.CASCADE, related_name="consolidations")
    trigger = models.CharField(max_length=32)
    status = models.CharField(
        max_length=16, choices=ConsolidationStatus.choices, default=ConsolidationStatus.RUNNING
    )
    from_seq = models.PositiveBigIntegerField()
    to_seq = models.PositiveBigIntegerField()
    base_version = models.PositiveBigIntegerField()
    synchronous = models.BooleanField(default=False)
    input_tokens = models.PositiveIntegerField(default=0)
    output_tokens = models.PositiveIntegerField(default=0)
    summary_tokens_before = models.PositiveIntegerField(default=0)
    summary_tokens_after = models.PositiveIntegerField(default=0)
    summarizer_calls = models.PositiveIntegerField(default=0)
    # When the turn that asked for this fold found it due; empty for sweeps, manual and
    # synchronous folds. finished_at - due_at is the consolidation lag.
    due_at = models.DateTimeField(null=True, blank=True)
    started_at = models.DateTimeField(auto_now_add=True)
    # A running fold's sign of life, in database time: stamped when its row is written and renewed
    # by a thread while the fold lives (memory_worker.folding.ledger.Heartbeat). The recovery takes
    # a running row whose heartbeat is older than deadlines.fold_heartbeat_stale_after() for dead,
    # whatever the chat's lock says (memory_worker.scheduling.sweep). Empty on rows from before it.
    heartbeat_at = models.DateTimeField(auto_now_add=True, null=True)
    finished_at = models.DateTimeField(null=True, blank=True)
    duration_ms = models.PositiveIntegerField(null=True, blank=True)
    error = models.TextField(blank=True)
    # The summarizer's error kind of a failed attempt: consecutive refusals of one range start
    # its bisection (memory_worker.folding.isolation).
    error_kind = models.CharField(max_length=32, blank=True)
    # Seqs of this fold's range it withheld from the summarizer (it refused them alone).
    withheld_seqs = models.JSONField(default=list, blank=True)
    worker = models.CharField(max_length=200, blank=True)
    # A committed fold's loss report: the exact details of its input (old summary and folded
    # messages) absent from its summary, the first DROPPED_DETAILS_KEPT of them.
    dropped_details = models.JSONField(default=list, blank=True)
    # An edit's (trigger "edit"): the username of the person who wrote the summary.
    edited_by = models.CharField(max_length=150, blank=True)

    class Meta:
        ordering = ["chat", "-id"]
        indexes = [
            models.Index(fields=["chat", "status"]),
            # The recovery looks at the running rows every few seconds: few of a large ledger.
            models.Index(
                fields=["started_at"],
                condition=models.Q(status="running"),
                name="consolidation_running",
            ),
            # The fleet page's figures read one window of folds (an hour, a day) by when they
            # finished, not the whole ledger (conversations.services.fleet).
            models.Index(fields=["finished_at"], name="consolidation_finished"),
            # The retention's deletions (memory_worker.folding.ledger.prune_ledger) find the old
            # rows of these outcomes without reading the succeeded ones, which stay.
            models.Index(
                fields=["finished_at"],
                condition=models.Q(status__in=PRUNABLE_STATUSES),
                name="consolidation_prunable",
            ),
        ]

    def __str__(self) -> str:
        return f"{self.chat_id} [{self.from_seq}..{self.to_seq}] {self.status}"


class DailyNote(models.Model):
    """The daily tier: durable facts extracted from folded messages, one note per chat and day (the
    day the messages were written). Filled off the fold path by a flush hook."""

    chat = models.ForeignKey(Chat, on_delete=models.CASCADE, related_name="daily_notes")
    day = models.DateField()
    facts = models.JSONField(default=list, blank=True)  # [{"seq", "role", "text"}, ...]
    # Fold ranges already extracted into this note: hook tasks may run twice (late ack) or out
    # of order (parallel workers), so each range is taken at most once rather than by a mark.
    ranges = models.JSONField(default=list, blank=True)  # [[from_seq, to_seq], ...]
    extractor = models.CharField(max_length=32, blank=True)
    updated_at = models.DateTimeField(auto_now=True)

    class Meta:
        ordering = ["chat", "-day"]
        constraints = [
            models.UniqueConstraint(fields=["chat", "day"], name="daily_note_chat_day_unique")
        ]

    def __str__(self) -> str:
        return f"{self.chat_id} {self.day}: {len(self.facts)} facts"


class AgentState(models.Model):
    """A chat's agent state (docs/agent-state.md), written off the request path after replies.
    ``processed_seq`` is the watermark of turns already applied, so a task that runs twice or late
    never applies a turn twice."""

    chat = models.OneToOneField(
        Chat, on_delete=models.CASCADE, primary_key=True, related_name="agent_state"
    )
    processed_seq = models.PositiveBigIntegerField(default=0)
    turns = models.PositiveIntegerField(default=0)  # turns applied: the entity GC clock
    engagement_summary = models.TextField(blank=True)
    active_entities = models.JSONField(default=list, blank=True)
    entity_registry = models.JSONField(default=dict, blank=True)  # id -> lifecycle record
    pending_clarification = models.JSONField(null=True, blank=True)
    recent_steps = models.JSONField(default=list, blank=True)  # newest FULL_DETAIL_STEPS
    step_summaries = models.JSONField(default=list, blank=True)  # older ones, one line each
    # What the model receives from this state, rendered and counted at write time so the turn's
    # bound check reads a stored count (like Message.token_count).
    context_block = models.TextField(blank=True)
    context_tokens = models.PositiveIntegerField(default=0)
    updated_at = models.DateTimeField(auto_now=True)

    def __str__(self) -> str:
        return f"Agent state of chat {self.chat_id} (up to #{self.processed_seq})"


class ResponseSummary(models.Model):
    """A response summary (AssistantResponseSummary, docs/agent-state.md): one sentence per
    assistant reply (long replies, and every propose/clarify reply). The turn-digest fold sends it
    instead of the full reply."""

    chat = models.ForeignKey(Chat, on_delete=models.CASCADE, related_name="response_summaries")
    seq = models.PositiveBigIntegerField()  # the assistant message's seq
    decision = models.CharField(max_length=16, blank=True)
    summary = models.TextField()
    source = models.CharField(max_length=16)  # deterministic | llm | offline
    created_at = models.DateTimeField(auto_now_add=True)

    class Meta:
        ordering = ["chat", "seq"]
        constraints = [
            models.UniqueConstraint(fields=["chat", "seq"], name="response_summary_chat_seq")
        ]

    def __str__(self) -> str:
        return f"{self.chat_id}#{self.seq}: {self.summary[:60]}"


class Pin(models.Model):
    """A text or a stored message the user pinned: always in the context, verbatim, in a block
    after the summary (conversations.services.context), counted in the policy's bound and never
    folded away. A pinned message keeps its seq and its text as the context renders it ("user:
    ..."): messages are append-only, so the copy cannot go stale."""

    chat = models.ForeignKey(Chat, on_delete=models.CASCADE, related_name="pins")
    text = models.TextField()
    seq = models.PositiveBigIntegerField(null=True, blank=True)
    tokens = models.PositiveIntegerField(default=0)  # the text's, counted once at write
    created_at = models.DateTimeField(auto_now_add=True)
    created_by = models.ForeignKey(
        settings.AUTH_USER_MODEL, on_delete=models.SET_NULL, null=True, blank=True, related_name="+"
    )

    class Meta:
        ordering = ["chat", "id"]
        constraints = [
            models.UniqueConstraint(
                fields=["chat", "seq"], condition=models.Q(seq__isnull=False), name="pin_chat_seq"
            )
        ]

    def __str__(self) -> str:
        return f"{self.chat_id} pin {self.pk}: {self.text[:60]}"


@receiver(pre_delete, sender=Chat)
def lock_chat_being_deleted(sender: type[Chat], instance: Chat, **kwargs: object) -> None:
    """Django deletes a chat's rows table by table (messages, brief, ledger, notes...) and the
    chat row last, and the foreign keys are checked at commit: a message, ledger row or note
    committed for the chat between its table's DELETE and the chat's would make the whole
    deletion fail at commit (a 500, nothing deleted), from the API, the admin or a user's
    deletion. Sent inside the deletion's transaction, before any row goes: with the chat row
    locked, a turn's append waits and then finds no chat (its 404), a fold's ledger row waits
    and then fails its own foreign key (the fold ends: the chat is gone), a note's hook attempt
    fails and its retry finds no messages, and an agent state commit holds the chat before its
    rows (hold_chat), so the two cannot wait for each other.
    SQLite: no row locks, and a deletion holds the database's one write lock anyway."""
    Chat.objects.select_for_update().filter(pk=instance.pk).values_list("pk").first()


HOLD_CHAT_SQL = f"SELECT 1 FROM {Chat._meta.db_table} WHERE id = %s FOR KEY SHARE"


def hold_chat(chat_id: int) -> bool:
    """Whether the chat still exists, holding it against deletion until the transaction ends.
    A deletion locks the chat row first, then deletes its rows table by table
    (lock_chat_being_deleted); a transaction that writes a chat's rows and whose foreign keys
    are checked at commit (a row inserted, or updated twice) would otherwise hold those rows
    while waiting for the chat at commit, as the deletion holds the chat and waits for the rows:
    a deadlock. Every such transaction calls this first. FOR KEY SHARE blocks only a deletion
    (or a key change), not a turn's updates of the chat row."""
    if connection.vendor != "postgresql":
        return Chat.objects.filter(pk=chat_id).exists()
    with connection.cursor() as cursor:
        cursor.execute(HOLD_CHAT_SQL, [chat_id])
        return cursor.fetchone() is not None
