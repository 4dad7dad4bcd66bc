"""The memory flush hook (docs/policies.md, token-budget): sent after a fold commits, never
before."""

from django.dispatch import Signal

# sender=Brief; kwargs: chat_id, from_seq, to_seq, version, summary
messages_folded = Signal()
