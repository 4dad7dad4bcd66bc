"""The pure memory policy engine: given a chat's state, its policy and ``now``, whether to fold
and which messages. Standard library only (an import contract in CI keeps it so)."""
