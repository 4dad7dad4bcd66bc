"""Start-up checks (``manage.py check``, and every worker and web process at boot): the deadlines
must nest, or a lock can expire under a live run, or the broker can redeliver a running task."""

from itertools import pairwise
from typing import Any

from django.conf import settings
from django.core.checks import Error, Warning, register

from memory_worker.engine.presets import PRESETS, synchronous_only
from memory_worker.folding.effective_policy import effective_policy
from memory_worker.summaries.backends import SUMMARIZER_BACKENDS

LOCK_LIFETIME = "MEMORY_TASK_TIME_LIMIT + MEMORY_LOCK_TTL_SECONDS"


def deadline_chain() -> list[tuple[str, float]]:
    """The lock's TTL is per renewal: its holder renews it until the run's hard time limit, so
    the lock lasts at most that plus one TTL, and covers the run for as long as it can live."""
    hard = settings.MEMORY_TASK_TIME_LIMIT
    return [
        ("MEMORY_LLM_TIMEOUT_SECONDS", settings.MEMORY_LLM_TIMEOUT_SECONDS),
        ("MEMORY_TASK_SOFT_TIME_LIMIT", settings.MEMORY_TASK_SOFT_TIME_LIMIT),
        ("MEMORY_TASK_TIME_LIMIT", hard),
        (LOCK_LIFETIME, hard + settings.MEMORY_LOCK_TTL_SECONDS),
        ("BROKER_VISIBILITY_TIMEOUT", settings.BROKER_VISIBILITY_TIMEOUT),
    ]


@register()
def check_deadlines(app_configs: Any = None, **kwargs: Any) -> list[Error]:
    errors = []
    chain = deadline_chain()
    for (lower_name, lower), (upper_name, upper) in pairwise(chain):
        if not lower < upper:
            errors.append(
                Error(
                    f"{lower_name} ({lower}) must be less than {upper_name} ({upper}): "
                    "LLM deadline < soft time limit < hard time limit < the lock's last "
                    "expiry (hard time limit + lock TTL) < broker visibility timeout.",
                    id="chatmem.E001",
                )
            )
    if not settings.TURN_SLOT_STALE_SECONDS > settings.LLM_TIMEOUT_SECONDS:
        errors.append(
            Error(
                f"TURN_SLOT_STALE_SECONDS ({settings.TURN_SLOT_STALE_SECONDS}) must exceed "
                f"LLM_TIMEOUT_SECONDS ({settings.LLM_TIMEOUT_SECONDS}), or a live turn could be "
                "pre-empted.",
                id="chatmem.E002",
            )
        )
    return errors


@register()
def check_lock_ttl(app_configs: Any = None, **kwargs: Any) -> list[Warning]:
    """A lock TTL from before its holder renewed it (it had to outlast the hard time limit)
    still works, but a dead worker's chats then wait that long before another worker folds
    them."""
    ttl, hard = settings.MEMORY_LOCK_TTL_SECONDS, settings.MEMORY_TASK_TIME_LIMIT
    if ttl < hard:
        return []
    return [
        Warning(
            f"MEMORY_LOCK_TTL_SECONDS ({ttl}) is not below MEMORY_TASK_TIME_LIMIT ({hard}): the "
            "lock is renewed by its holder, so its TTL only bounds how long a dead worker keeps "
            "a chat; 20 is the default.",
            id="chatmem.W003",
        )
    ]


@register()
def check_default_policy(app_configs: Any = None, **kwargs: Any) -> list[Error]:
    if settings.MEMORY_POLICY in PRESETS:
        return []
    return [
        Error(
            f'MEMORY_POLICY "{settings.MEMORY_POLICY}" is not a preset; '
            f"choose one of: {', '.join(sorted(PRESETS))}.",
            id="chatmem.E003",
        )
    ]


@register()
def check_preset_headroom(app_configs: Any = None, **kwargs: Any) -> list[Warning]:
    """The operator's knobs for a preset (MEMORY_* environment settings) that leave its
    background folds no headroom below the hard bound: a chat's own overrides that do so are a
    400, the operator's are this warning, and the chats still run (their turns fold)."""
    warnings = []
    for preset in PRESETS:
        try:
            problem = synchronous_only(effective_policy(preset))
        except Exception:  # a malformed knob: the settings refuse it at start-up already
            continue
        if problem:
            warnings.append(
                Warning(
                    f"Preset {preset!r} with the environment's knobs: {problem}", id="chatmem.W002"
                )
            )
    return warnings


DAILY_NOTES_BACKENDS = ("offline", "chat")


@register()
def check_daily_notes_backend(app_configs: Any = None, **kwargs: Any) -> list[Error]:
    backend = settings.MEMORY_DAILY_NOTES_BACKEND
    if backend in DAILY_NOTES_BACKENDS:
        return []
    return [
        Error(
            f'MEMORY_DAILY_NOTES_BACKEND "{backend}" is not one of: '
            f"{', '.join(DAILY_NOTES_BACKENDS)}.",
            id="chatmem.E004",
        )
    ]


DISPATCH_MODES = ("celery", "inline", "off")
SUMMARIZER_FALLBACKS = ("", "offline")
# Settings a value of zero or less breaks (a timeout that expires at once, a sweep that spins,
# a budget that fits nothing), and settings that only make sense from zero up.
POSITIVE_MEMORY_SETTINGS = (
    "MEMORY_LLM_TIMEOUT_SECONDS",
    "MEMORY_SWEEP_INTERVAL_SECONDS",
    "MEMORY_RECOVERY_INTERVAL_SECONDS",
    "MEMORY_LOCK_TTL_SECONDS",
    "MEMORY_SUMMARIZER_INPUT_BUDGET",
    "MEMORY_SWEEP_BATCH",
    "MEMORY_MAX_RERUNS_PER_TASK",
    "MEMORY_FAILURE_BACKOFF_SECONDS",
    "MEMORY_FAILURE_BACKOFF_MAX_SECONDS",
    "MEMORY_DEGRADED_AFTER_FAILURES",
)
NON_NEGATIVE_MEMORY_SETTINGS = (
    "MEMORY_ENQUEUE_DEDUP_SECONDS",
    "MEMORY_QUEUED_FOLD_WAIT_SECONDS",
    "MEMORY_SWEEP_MIN_COOLDOWN_SECONDS",
    "MEMORY_INVALID_OUTPUT_RETRY_SECONDS",
    "WORKER_METRICS_PORT",
)


@register()
def check_memory_settings(app_configs: Any = None, **kwargs: Any) -> list[Error]:
    """Values that would otherwise pass start-up and fail every fold, or quietly switch
    consolidation off (an unknown dispatch mode dispatches nothing)."""
    problems = []
    if settings.MEMORY_DISPATCH not in DISPATCH_MODES:
        problems.append(
            f'MEMORY_DISPATCH "{settings.MEMORY_DISPATCH}" is not one of: '
            f"{', '.join(DISPATCH_MODES)} (empty: celery with REDIS_URL, else inline)."
        )
    elif settings.MEMORY_DISPATCH == "celery" and not settings.REDIS_URL:
        problems.append(
            "MEMORY_DISPATCH is celery but REDIS_URL is not set: tasks would go to an "
            "in-memory broker that no worker reads."
        )
    backend = settings.MEMORY_SUMMARIZER_BACKEND
    if backend and backend not in SUMMARIZER_BACKENDS:
        problems.append(
            f'MEMORY_SUMMARIZER_BACKEND "{backend}" is not one of: '
            f"{', '.join(SUMMARIZER_BACKENDS)} (empty: chat with OPENAI_BASE_URL or "
            "OPENAI_API_KEY, else offline)."
        )
    if settings.MEMORY_SUMMARIZER_FALLBACK not in SUMMARIZER_FALLBACKS:
        problems.append(
            f'MEMORY_SUMMARIZER_FALLBACK "{settings.MEMORY_SUMMARIZER_FALLBACK}" is not one of: '
            "offline, or empty (off)."
        )
    problems += out_of_range(POSITIVE_MEMORY_SETTINGS, NON_NEGATIVE_MEMORY_SETTINGS)
    return [Error(problem, id="chatmem.E006") for problem in problems]


def out_of_range(positive: tuple[str, ...], non_negative: tuple[str, ...]) -> list[str]:
    problems = [
        f"{name} must be greater than 0, got {getattr(settings, name)}."
        for name in positive
        if not getattr(settings, name) > 0
    ]
    problems += [
        f"{name} must not be negative, got {getattr(settings, name)}."
        for name in non_negative
        if getattr(settings, name) < 0
    ]
    return problems
