"""Which chat model answers turns: the configured OpenAI-compatible endpoint, or the offline
model when neither an endpoint nor an API key is set (the embedded default)."""

from functools import lru_cache

from django.conf import settings

from conversations.chat_model.contract import CappedChatModel, ChatModel
from conversations.chat_model.offline_backend import OFFLINE_MODEL_NAME, OfflineChatModel
from conversations.chat_model.openai_backend import OpenAIChatModel
from conversations.chat_model.transport import (
    endpoint_configured,
    make_openai_client,
    token_limit_field,
)
from conversations.metrics import TimedChatModel


def chat_backend_name() -> str:
    if settings.CHAT_BACKEND:
        return str(settings.CHAT_BACKEND)
    configured = endpoint_configured(settings.OPENAI_API_KEY, settings.OPENAI_BASE_URL)
    return "openai" if configured else "offline"


def answering_model(requested: str) -> str:
    """The model name a reply reports before the model has answered (a stream's chunks): the
    offline model's own when it is the one that answers."""
    return OFFLINE_MODEL_NAME if chat_backend_name() == "offline" else requested


@lru_cache(maxsize=4)
def _chat_model(
    backend: str,
    base_url: str | None,
    api_key: str,
    timeout: float,
    direct: bool,
    limit_field: str,
) -> ChatModel:
    if backend == "offline":
        return TimedChatModel(OfflineChatModel())
    if backend != "openai":
        raise ValueError(f'CHAT_BACKEND must be "openai" or "offline", got "{backend}"')
    client = make_openai_client(base_url=base_url, api_key=api_key, timeout=timeout, max_retries=0)
    field = token_limit_field(limit_field, base_url)
    return TimedChatModel(OpenAIChatModel(client, timeout, direct, token_limit_field=field))


def get_chat_model() -> ChatModel:
    # Cached per configuration: building an OpenAI client per turn costs a new connection pool.
    model = _chat_model(
        chat_backend_name(),
        settings.OPENAI_BASE_URL,
        settings.OPENAI_API_KEY,
        settings.LLM_TIMEOUT_SECONDS,
        settings.CHAT_DIRECT_HTTP,
        settings.OPENAI_TOKEN_LIMIT_FIELD,
    )
    return CappedChatModel(model, settings.CHATMEM_MAX_MESSAGE_CHARS)
