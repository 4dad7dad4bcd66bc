"""Start-up checks of the web side (``manage.py check``, and every gunicorn worker at boot:
chatmem_project.boot)."""

import sys
from functools import partial
from typing import Any

from django.conf import settings
from django.core.checks import Error, Warning, register

from conversations.chat_model.tokens import tokenizer_problems
from conversations.chat_model.transport import token_limit_field
from conversations.services.chats import operator_defaults_room_problem
from conversations.throttling import rate_problem
from conversations.variants import model_variants
from memory_worker.memory import out_of_range


def greenlets_patched() -> bool:
    """Whether gevent has replaced threads by greenlets in this process (gunicorn -k gevent)."""
    monkey = sys.modules.get("gevent.monkey")
    return bool(monkey is not None and monkey.is_module_patched("threading"))


@register()
def check_greenlet_server_has_a_pool(app_configs: Any = None, **kwargs: Any) -> list[Error]:
    # Under gevent every request in flight is a greenlet, and Django keeps a connection per
    # greenlet: up to gunicorn's worker_connections (1,000 by default) per process, far past
    # PostgreSQL's max_connections. The pool bounds them and lets a turn hand its connection
    # back while the model answers.
    if not greenlets_patched() or settings.DB_POOL_MAX_SIZE:
        return []
    if settings.DATABASES["default"]["ENGINE"] != "django.db.backends.postgresql":
        return []
    return [
        Error(
            "A gevent server needs DB_POOL_MAX_SIZE on PostgreSQL: without a pool every "
            "request in flight holds its own connection (up to gunicorn's worker_connections "
            "per process). Set DB_POOL_MAX_SIZE (docs/operations.md, gevent workers).",
            id="chatmem.E005",
        )
    ]


CHAT_BACKENDS = ("openai", "offline")
AGENT_SUMMARY_BACKENDS = ("llm", "offline")
POSITIVE_WEB_SETTINGS = (
    "LLM_TIMEOUT_SECONDS",
    "TURN_SLOT_STALE_SECONDS",
    "CHATMEM_MAX_MESSAGE_CHARS",
    "CHATMEM_MAX_BODY_BYTES",
    "CHAT_MODEL_CONTEXT_TOKENS",
)
NON_NEGATIVE_WEB_SETTINGS = ("DB_POOL_MAX_SIZE", "DB_POOL_MIN_SIZE", "CHAT_MAX_REPLY_TOKENS")
# DB_CONNECT_TIMEOUT: libpq reads 0 as "no limit", which is allowed.


@register()
def check_web_settings(app_configs: Any = None, **kwargs: Any) -> list[Error]:
    """Values that would otherwise pass start-up and fail every turn with a 500 (a backend
    name's typo, a malformed MODEL_VARIANTS, MODEL_TOKENIZERS or TURN_RATE_LIMIT, a negative
    pool size)."""
    problems = []
    for name, choices in (
        ("CHAT_BACKEND", CHAT_BACKENDS),
        ("AGENT_SUMMARY_BACKEND", AGENT_SUMMARY_BACKENDS),
    ):
        value = getattr(settings, name)
        if value and value not in choices:
            problems.append(f'{name} "{value}" is not one of: {", ".join(choices)} (or empty).')
    for check in (
        model_variants,
        partial(token_limit_field, settings.OPENAI_TOKEN_LIMIT_FIELD, settings.OPENAI_BASE_URL),
    ):
        try:
            check()
        except ValueError as error:
            problems.append(str(error))
    problems += tokenizer_problems(
        settings.MODEL_TOKENIZERS,
        settings.TOKEN_COUNT_MARGIN,
        settings.UNKNOWN_MODEL_NON_LATIN_MARGIN,
    )
    problem = rate_problem(settings.TURN_RATE_LIMIT)
    if problem:
        problems.append(problem)
    problems += out_of_range(POSITIVE_WEB_SETTINGS, NON_NEGATIVE_WEB_SETTINGS)
    return [Error(problem, id="chatmem.E007") for problem in problems]


@register()
def check_default_chats_have_room(app_configs: Any = None, **kwargs: Any) -> list[Warning]:
    """The operator's defaults (CHATMEM_DEFAULT_SYSTEM_PROMPT, MEMORY_SUMMARY_TOKEN_CAP and the
    presets' knobs, CHAT_MODEL_CONTEXT_TOKENS) leave a new chat too little of the model's
    window: its turns will be 503s once it has to fold. A warning: chats are still created."""
    try:
        problem = operator_defaults_room_problem(settings.MEMORY_POLICY)
    except Exception:  # a malformed setting (an unknown preset among them): its own check says
        return []
    if problem is None:
        return []
    return [Warning(f"The defaults of a new chat: {problem}", id="chatmem.W001")]
