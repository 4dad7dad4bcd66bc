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


def logging_config(level: str) -> dict[str, Any]:
    """Django's LOGGING: JSON lines on the console at ``level``; chatmem's INFO events also go
    to the metrics handler, which turns them into Prometheus metrics."""
    return {
        "version": 1,
        "disable_existing_loggers": False,
        "formatters": {"json": {"()": "chatmem_project.logs.JsonFormatter"}},
        "handlers": {
            "console": {"class": "logging.StreamHandler", "formatter": "json", "level": level},
            # Fold, sync-fold, lock and enqueue events become Prometheus metrics.
            "metrics": {"class": "conversations.metrics.MetricsLogHandler"},
        },
        "root": {"handlers": ["console"], "level": level},
        "loggers": {
            # INFO always reaches the metrics handler; the console handler applies ``level``.
            "chatmem": {"level": "INFO", "handlers": ["metrics"]},
            "django.db.backends": {"level": "WARNING"},
            "httpx": {"level": "WARNING"},
            "httpx2": {"level": "WARNING"},
            "httpcore": {"level": "WARNING"},
            "openai": {"level": "WARNING"},
        },
    }
