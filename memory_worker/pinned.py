"""The pinned block (pure): the user's pins as the model receives them, one system message after
the summary, and what the block counts in the policy's bound (memory_worker.engine.policy)."""

from collections.abc import Iterable

from conversations.chat_model.tokens import count_tokens
from memory_worker.engine.policy import PROMPT_WINDOW_SHARE, Policy, token_bound
from memory_worker.engine.state import ChatState, prompt_total

PINNED_HEADER = "Pinned by the user (always kept verbatim; not part of the summary):\n"
# Each item's line prefix and the newline before it, beside the item's own counted tokens.
PIN_LINE_TOKENS = 2


def pin_line(text: str) -> str:
    return f"- {text}"


def pinned_block(texts: Iterable[str]) -> str:
    """The block's text, empty when there is nothing to show."""
    lines = [pin_line(text) for text in texts]
    return PINNED_HEADER + "\n".join(lines) if lines else ""


def pinned_block_tokens(pin_tokens: Iterable[int]) -> int:
    """The block with every pin in it, from each pin's stored count: what the bound reserves
    for the pins (0 with none)."""
    counts = list(pin_tokens)
    if not counts:
        return 0
    return count_tokens(PINNED_HEADER) + sum(tokens + PIN_LINE_TOKENS for tokens in counts)


def pinned_message_text(role: str, content: str) -> str:
    """A pinned message as its pin shows it."""
    return f"{role}: {content}"


# Of what a bound leaves once the system prompt and a summary at its cap are in, the share the
# pins may take: the rest stays for verbatim messages, so folds still have a history to batch.
PIN_SHARE = 0.5


def pin_room(state: ChatState, policy: Policy) -> int:
    """Tokens the pinned block may take in all (memory_worker.pinned.pinned_block_tokens), by
    the tightest of the history token bound and the prompt bound."""
    summary = max(state.summary_tokens, policy.summary_token_cap)
    prompt_bound = int(PROMPT_WINDOW_SHARE * state.model_context_tokens)
    # The prompt's fixed parts: priming, the system part and the summary with their overheads,
    # and the pinned block's own overhead.
    fixed = prompt_total(state.system_tokens, summary, 1, 0, 0)
    rooms = [prompt_bound - fixed]
    bound = token_bound(policy)
    if bound is not None:
        rooms.append(bound - summary)
    return max(0, int(min(rooms) * PIN_SHARE))
