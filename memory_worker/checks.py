"""Start-up checks (``manage.py check``, and every worker and web process at boot): the deadlines
must nest, or a lock can expire under a live run, or the broker can redeliver a running task."""

from itertools import pairwise
from typing import Any

from django.conf import settings
from django.core.checks import Error, register


def deadline_chain() -> list[tuple[str, float]]:
    return [
        ("MEMORY_LLM_TIMEOUT_SECONDS", settings.MEMORY_LLM_TIMEOUT_SECONDS),
        ("MEMORY_TASK_SOFT_TIME_LIMIT", settings.MEMORY_TASK_SOFT_TIME_LIMIT),
        ("MEMORY_TASK_TIME_LIMIT", settings.MEMORY_TASK_TIME_LIMIT),
        ("MEMORY_LOCK_TTL_SECONDS", settings.MEMORY_LOCK_TTL_SECONDS),
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
                    "LLM deadline < soft time limit < hard time limit < lock TTL < broker "
                    "visibility timeout.",
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
def check_default_policy(app_configs: Any = None, **kwargs: Any) -> list[Error]:
    from memory_worker.presets import PRESETS

    if settings.MEMORY_POLICY in PRESETS:
        return []
    return [
        Error(
            f'MEMORY_POLICY "{settings.MEMORY_POLICY}" is not a preset; '
            f"choose one of: {', '.join(sorted(PRESETS))}.",
            id="chatmem.E003",
        )
    ]


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
