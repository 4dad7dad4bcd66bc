"""The settings' environment: a ``.env`` file beside the checkout, read once, and the helpers
every setting is read with (an empty variable means the default; a number as the presets' knobs
are read)."""

import math
from pathlib import Path

import environ
from django.core.exceptions import ImproperlyConfigured

BASE_DIR = Path(__file__).resolve().parent.parent

env = environ.Env()
environ.Env.read_env(BASE_DIR / ".env", overwrite=False)


def read_number(variable: str, raw: str, kind: type[int] | type[float]) -> int | float:
    """``raw`` read as Python reads a float, so "1e3" is 1000 for an integer too, or a ValueError
    naming the variable. Not ``int(raw)``, which refused "1e3", nor django-environ's float(),
    which drops every character but digits, "," "." and "-" ("1e3" is 13.0). Every setting's
    number is read this way (env_number)."""
    what = "an integer" if kind is int else "a finite number"
    try:
        value = float(raw)
    except ValueError:
        raise ValueError(f"{variable} must be {what}, got {raw!r}") from None
    # float() reads "nan" and "inf"
    if not math.isfinite(value) or (kind is int and not value.is_integer()):
        raise ValueError(f"{variable} must be {what}, got {raw!r}")
    return int(value) if kind is int else value


def env_number(name: str, default: float, kind: type[int] | type[float]) -> float:
    """A number from the environment, or a start-up error naming the variable, read as the
    presets' knobs are (read_number: "1e3" is 1000 for an integer too).
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
