"""Celery beat's scheduler with a liveness file: a healthcheck (docker-compose.yml) can tell a
beat whose loop turns from one that is hung, which a running process alone does not show."""

from pathlib import Path
from typing import Any

from celery.beat import PersistentScheduler

ALIVE_SUFFIX = ".alive"


def alive_file(schedule_filename: str) -> Path:
    """Beside the schedule file (``--schedule``), which beat can already write."""
    return Path(schedule_filename + ALIVE_SUFFIX)


class LivenessScheduler(PersistentScheduler):
    """Touches ``<schedule file>.alive`` on every tick. Beat ticks at least every
    ``beat_max_loop_interval`` seconds (settings), so an older file means a beat that stopped."""

    def __init__(self, *args: Any, schedule_filename: str, **kwargs: Any) -> None:
        # Celery's beat passes it (--schedule); the stubs do not declare the attribute.
        self.alive_file = alive_file(schedule_filename)
        super().__init__(*args, schedule_filename=schedule_filename, **kwargs)

    def tick(self, *args: Any, **kwargs: Any) -> float:
        interval: float = super().tick(*args, **kwargs)
        self.alive_file.touch()
        return interval
