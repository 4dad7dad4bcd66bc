from django.apps import AppConfig


class MemoryWorkerConfig(AppConfig):
    name = "memory_worker"
    default_auto_field = "django.db.models.BigAutoField"

    def ready(self) -> None:
        from memory_worker import checks, hooks  # noqa: F401  (registers checks and receivers)
