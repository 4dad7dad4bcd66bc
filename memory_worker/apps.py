from django.apps import AppConfig
from django.conf import settings
from django.core.exceptions import ImproperlyConfigured

from conversations.chat_model import tokens
from memory_worker import knobs


def token_settings() -> tokens.TokenSettings:
    return (
        settings.MODEL_TOKENIZERS,
        settings.TOKEN_COUNT_MARGIN,
        settings.UNKNOWN_MODEL_NON_LATIN_MARGIN,
    )


class MemoryWorkerConfig(AppConfig):
    name = "memory_worker"
    default_auto_field = "django.db.models.BigAutoField"

    def ready(self) -> None:
        from memory_worker import checks, hooks  # noqa: F401  (registers checks and receivers)

        tokens.read_settings_with(token_settings)
        # A bad knob stops every process at start-up with its reason, not the first turn.
        try:
            knobs.operator_overrides()
        except ValueError as error:
            raise ImproperlyConfigured(str(error)) from None
