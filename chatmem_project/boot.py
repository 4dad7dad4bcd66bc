"""What a server process does once it has loaded the application, before it serves: gunicorn
workers (gunicorn.conf.py's post_worker_init), Celery workers and beat (chatmem_project.celery)."""

import logging

from django.conf import settings
from django.core.checks import WARNING, CheckMessage, Error, run_checks
from django.core.exceptions import ImproperlyConfigured

log = logging.getLogger("chatmem.boot")

PLACEHOLDER_SECRET_KEY = "change-me-to-a-long-random-string"  # .env.example's
# Shorter than this cannot be a random key of 192 bits or more; a strong key need not reach the
# 50 characters Django's deployment check warns under (security.W009): `openssl rand -base64
# 32` is 44 characters of 256 random bits, and refusing it stopped valid deployments.
MIN_SECRET_KEY_LENGTH = 32


def refuse_misconfigured_start() -> None:
    """Run Django's checks: an error (misordered deadlines, a greenlet server with no pool...)
    stops the process with the reason instead of surfacing later as expired locks, redelivered
    tasks or "too many clients". A warning (chatmem.W001: the defaults leave a new chat no room)
    is logged and the process starts. Then the secret key (check_secret_key) and the model
    (check_model_configured)."""
    messages = run_checks()
    serious = [message for message in messages if message.is_serious()]
    for message in messages:
        if not message.is_serious() and not message.is_silenced():
            log_check_message(message)
    serious += check_secret_key()
    serious += check_model_configured()
    if serious:
        raise ImproperlyConfigured("\n".join(str(error) for error in serious))


def log_check_message(message: CheckMessage) -> None:
    """A check message below ERROR, in the log every server writes (`manage.py check` prints
    them; a server would otherwise drop them)."""
    text = f"{message.id}: {message.msg}" + (f" HINT: {message.hint}" if message.hint else "")
    level = logging.WARNING if message.level >= WARNING else logging.INFO
    log.log(level, "start-up check %s", text, extra={"check": message.id})


def unconfigured_checkout() -> bool:
    """Neither DEBUG nor SECRET_KEY given: a source checkout run as it is, not a deployment
    (settings.UNCONFIGURED_CHECKOUT)."""
    return bool(settings.UNCONFIGURED_CHECKOUT)


def weak_secret_key(key: str) -> str | None:
    """Why ``key`` must not sign anything served, or None."""
    if key == settings.DEV_SECRET_KEY:
        return "is the development default written in chatmem's source"
    if key == PLACEHOLDER_SECRET_KEY:
        return "is the placeholder from .env.example"
    if len(key) < MIN_SECRET_KEY_LENGTH:
        return f"has {len(key)} characters, fewer than {MIN_SECRET_KEY_LENGTH}"
    return None


def check_secret_key() -> list[Error]:
    """With DEBUG off, a known or short SECRET_KEY lets anyone forge the admin's session cookies
    and password-reset links: the process refuses to start (chatmem.E008). Not one of
    `manage.py check`'s checks: it is about serving, and CI runs those on a bare checkout."""
    if settings.DEBUG:
        return []
    problem = weak_secret_key(settings.SECRET_KEY)
    if problem is None:
        return []
    if unconfigured_checkout():
        log.warning(
            "serving with the development SECRET_KEY: neither DEBUG nor SECRET_KEY is set "
            "(a checkout, not a deployment: set SECRET_KEY to serve anything real)"
        )
        return []
    return [
        Error(
            f"SECRET_KEY {problem}. With DEBUG off it signs the admin's sessions, CSRF tokens "
            "and password-reset links, and anyone who knows or guesses it can forge them. Set "
            f"SECRET_KEY to a random string of at least {MIN_SECRET_KEY_LENGTH} characters, e.g. "
            "python -c 'import secrets; print(secrets.token_urlsafe(50))'.",
            id="chatmem.E008",
        )
    ]


def check_model_configured() -> list[Error]:
    """With DEBUG off and no endpoint, every turn would be answered by the offline echo model,
    and a deployment that forgot OPENAI_BASE_URL would look healthy: the process refuses to
    start (chatmem.E009) unless CHAT_BACKEND=offline says the echo is meant. Like
    check_secret_key, about serving: `manage.py check --deploy` does not run it."""
    configured = settings.OPENAI_BASE_URL or settings.OPENAI_API_KEY
    if settings.DEBUG or configured or unconfigured_checkout():
        return []
    if settings.CHAT_BACKEND == "offline":
        log.warning("serving with the offline echo model, as CHAT_BACKEND=offline says")
        return []
    if settings.CHAT_BACKEND:  # its own check (chatmem.E007) judges the value
        return []
    return [
        Error(
            "No model is configured: OPENAI_BASE_URL and OPENAI_API_KEY are empty, so every "
            "turn would be answered by the offline echo model. Set OPENAI_BASE_URL (a local "
            "server such as Ollama, vLLM or llama.cpp needs no key) and, for a hosted endpoint, "
            "OPENAI_API_KEY; or CHAT_BACKEND=offline if the echo model is meant.",
            id="chatmem.E009",
        )
    ]
