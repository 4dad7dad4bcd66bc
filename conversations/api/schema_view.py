"""The schema's endpoint, /api/v1/schema/ (what it describes is conversations.api.schema)."""

import threading

from drf_spectacular.views import SpectacularAPIView
from rest_framework.request import Request
from rest_framework.response import Response

_SCHEMA_GENERATION = threading.Lock()


class SchemaView(SpectacularAPIView):
    """drf-spectacular builds a schema with process-wide state (its extensions import their
    target classes on first use and reset them on failure): two first requests at once in one
    process (gunicorn's threads) raced there and one was a 500. One generation at a time."""

    def _get_schema_response(self, request: Request) -> Response:
        with _SCHEMA_GENERATION:
            return super()._get_schema_response(request)
