"""The settings' environment: a ``.env`` file beside the checkout, read once, and the helpers
every setting is read with (an empty variable means the default; a number as the presets' knobs
are read)."""

from pathlib import Path

import environ
from django.core.exceptions import ImproperlyConfigured

from memory_worker.env_knobs import read_number

BASE_DIR = Path(__file__).resolve().parent.parent

env = environ.Env()
environ.Env.read_env(BASE_DIR / ".env", overwrite=False)


def env_number(name: str, default: float, kind: type[int] | type[float]) -> float:
    """A number from the environment, or a start-up error naming the variable, read as the
    presets' knobs are (memory_worker.env_knobs.read_number: "1e3" is 1000 for an integer too).
    Empty means the default."""
    raw = env.str(name, default="").strip()
    if not raw:
        return default
    try:
        return read_number(name, raw, kind)
    except ValueError as error:
        raise ImproperlyConfigured(str(error)) from None


def env_int(name: str, default: int) -> int:
    return int(env_number(name, default, int))


def env_float(name: str, default: float) -> float:
    return float(env_number(name, default, float))


def env_bool(name: str, default: bool) -> bool:
    """Empty means the default (django-environ reads an empty variable as false, so
    ``CHAT_DIRECT_HTTP=`` turned a default-on setting off)."""
    if not env.str(name, default="").strip():
        return default
    return env.bool(name)


def env_text(name: str, default: str) -> str:
    """For settings that cannot be empty (a model name, a preset, a key): empty means the
    default. Not for those where empty means something (``TURN_RATE_LIMIT``: no limit)."""
    return env.str(name, default="").strip() or default
