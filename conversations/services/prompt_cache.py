"""What the provider's prompt cache served a chat: its model replies' prompt tokens and, of
those, the cached ones each reply's usage reported (kept in the reply's metadata by
turn_store), summed in the database (one aggregate over the chat's assistant messages)."""

from dataclasses import dataclass

from django.db.models import Count, IntegerField, Sum
from django.db.models.fields.json import KT
from django.db.models.functions import Cast, Coalesce

from conversations.chat_model.contract import CACHED_TOKENS
from conversations.models import Chat, Message, Role


@dataclass(frozen=True)
class PromptCacheTotals:
    replies: int  # model replies that reported their usage
    prompt_tokens: int
    cached_tokens: int

    @property
    def cached_share(self) -> float | None:
        return self.cached_tokens / self.prompt_tokens if self.prompt_tokens else None


def _count(key: str) -> Cast:
    return Cast(KT(f"metadata__{key}"), IntegerField())


def prompt_cache_totals(chat: Chat) -> PromptCacheTotals:
    """Over every reply of the chat. A server says cached tokens as OpenAI's ``cached_tokens``
    or Anthropic's ``cache_read_input_tokens`` (llm.cached_prompt_tokens): the first found."""
    found = Message.objects.filter(
        chat=chat, role=Role.ASSISTANT, metadata__has_key="prompt_tokens"
    ).aggregate(
        replies=Count("pk"),
        prompt_tokens=Coalesce(Sum(_count("prompt_tokens")), 0),
        cached_tokens=Coalesce(
            Sum(Coalesce(_count(CACHED_TOKENS), _count("cache_read_input_tokens"), 0)), 0
        ),
    )
    return PromptCacheTotals(**found)
