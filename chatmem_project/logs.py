"""One JSON object per log line, with any ``extra={...}`` fields kept as keys."""

import json
import logging
from datetime import UTC, datetime
from typing import Any

from chatmem_project.request_id import current_request_id

_STANDARD_ATTRS = set(logging.makeLogRecord({}).__dict__) | {"message", "asctime"}


class JsonFormatter(logging.Formatter):
    def format(self, record: logging.LogRecord) -> str:
        payload: dict[str, object] = {
            "ts": datetime.fromtimestamp(record.created, UTC).isoformat(),
            "level": record.levelname,
            "logger": record.name,
            "msg": record.getMessage(),
        }
        request_id = current_request_id.get()
        if request_id:
            payload["request_id"] = request_id
        for key, value in record.__dict__.items():
            if key not in _STANDARD_ATTRS and not key.startswith("_"):
                payload[key] = value
        if record.exc_info:
            payload["exc"] = self.formatException(record.exc_info)
        return json.dumps(payload, default=str)


class NoErrorStatus(logging.Filter):
    """Drops a server access line for a 4xx or 5xx: django.request logs that response already,
    so a refused request is one line, not two."""

    def filter(self, record: logging.LogRecord) -> bool:
        status = getattr(record, "status_code", None)
        return not isinstance(status, int) or status < 400


def logging_config(level: str) -> dict[str, Any]:
    """Django's LOGGING: JSON lines on the console at ``level``; chatmem's INFO events also go
    to the metrics handler, which turns them into Prometheus metrics."""
    return {
        "version": 1,
        "disable_existing_loggers": False,
        "formatters": {"json": {"()": "chatmem_project.logs.JsonFormatter"}},
        "filters": {"no_error_status": {"()": "chatmem_project.logs.NoErrorStatus"}},
        "handlers": {
            "console": {"class": "logging.StreamHandler", "formatter": "json", "level": level},
            # Fold, sync-fold, lock and enqueue events become Prometheus metrics.
            "metrics": {"class": "conversations.metrics.MetricsLogHandler"},
        },
        "root": {"handlers": ["console"], "level": level},
        "loggers": {
            # INFO always reaches the metrics handler; the console handler applies ``level``.
            "chatmem": {"level": "INFO", "handlers": ["metrics"]},
            # Django's own console handlers wrote each refused request again in plain text (and
            # runserver's access line a third time): everything goes through the JSON console.
            "django": {"level": "INFO", "handlers": [], "propagate": True},
            "django.server": {
                "level": "INFO",
                "handlers": [],
                "propagate": True,
                "filters": ["no_error_status"],
            },
            "django.db.backends": {"level": "WARNING"},
            "httpx": {"level": "WARNING"},
            "httpx2": {"level": "WARNING"},
            "httpcore": {"level": "WARNING"},
            "openai": {"level": "WARNING"},
        },
    }
