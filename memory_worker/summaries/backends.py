"""Which summarizer folds messages: Chat Completions (default with an API key), the Responses API
with a hosted prompt id and version, or the offline extractive summarizer (embedded default)."""

from functools import lru_cache

from django.conf import settings

from conversations.chat_model.transport import (
    endpoint_configured,
    make_openai_client,
    token_limit_field,
)
from memory_worker.summaries.chat_completions import ChatCompletionsSummarizer
from memory_worker.summaries.contract import Summarizer
from memory_worker.summaries.offline import OfflineSummarizer
from memory_worker.summaries.responses import ResponsesSummarizer

SUMMARIZER_BACKENDS = ("chat", "responses", "offline")


def summarizer_backend_name() -> str:
    if settings.MEMORY_SUMMARIZER_BACKEND:
        return str(settings.MEMORY_SUMMARIZER_BACKEND)
    configured = endpoint_configured(settings.OPENAI_API_KEY, settings.OPENAI_BASE_URL)
    return "chat" if configured else "offline"


# One per cap in use (chats may override theirs): each holds its own HTTP client.
@lru_cache(maxsize=16)
def _summarizer(
    backend: str,
    base_url: str | None,
    api_key: str,
    model: str,
    cap: int,
    timeout: float,
    prompt_id: str,
    prompt_version: str | None,
    strict: bool,
    limit_field: str,
) -> Summarizer:
    if backend == "offline":
        return OfflineSummarizer(cap_tokens=cap)
    if backend not in SUMMARIZER_BACKENDS:
        raise ValueError(
            f"MEMORY_SUMMARIZER_BACKEND must be one of {', '.join(SUMMARIZER_BACKENDS)}, "
            f'got "{backend}"'
        )
    # Celery owns retries and deadlines: the client itself never retries.
    client = make_openai_client(base_url=base_url, api_key=api_key, timeout=timeout, max_retries=0)
    if backend == "responses":
        return ResponsesSummarizer(
            client,
            prompt_id=prompt_id,
            prompt_version=prompt_version,
            cap_tokens=cap,
            timeout=timeout,
        )
    return ChatCompletionsSummarizer(
        client,
        model=model,
        cap_tokens=cap,
        timeout=timeout,
        token_limit_field=token_limit_field(limit_field, base_url),
        strict=strict,
    )


def offline_summarizer(cap_tokens: int) -> Summarizer:
    """The fallback of a turn whose fold the configured summarizer failed (promise 2,
    docs/design.md), and of a background fold with MEMORY_SUMMARIZER_FALLBACK=offline."""
    return OfflineSummarizer(cap_tokens=cap_tokens)


def get_summarizer(cap_tokens: int | None = None) -> Summarizer:
    """``cap_tokens``: the chat's summary cap (its policy's ``summary_token_cap``, which a chat
    may override); MEMORY_SUMMARY_TOKEN_CAP when not given."""
    return _configured(cap_tokens, strict=False)


def stricter_summarizer(cap_tokens: int | None = None) -> Summarizer:
    """``get_summarizer`` with the stricter prompt, for the retry after an invalid summary (a
    hosted prompt's instructions are the operator's, and the offline summarizer needs none)."""
    return _configured(cap_tokens, strict=True)


def _configured(cap_tokens: int | None, *, strict: bool) -> Summarizer:
    return _summarizer(
        summarizer_backend_name(),
        settings.OPENAI_BASE_URL,
        settings.OPENAI_API_KEY,
        settings.MEMORY_SUMMARIZER_MODEL,
        cap_tokens or settings.MEMORY_SUMMARY_TOKEN_CAP,
        settings.MEMORY_LLM_TIMEOUT_SECONDS,
        settings.PROMPT_ID_SUMMARY_GLOBAL,
        settings.PROMPT_VERSION_SUMMARY_GLOBAL,
        strict,
        settings.OPENAI_TOKEN_LIMIT_FIELD,
    )
