"""URLs of the throughput benchmark's server: chatmem's own, plus ``/bench/proxy``, a minimal
stateless view on the same stack (Django, DRF, token auth) that only forwards the message to the
model and returns its reply. Never mounted in production: the benchmark serves this URLconf
through ``bench.settings_proxy``."""

from typing import Any

from django.urls import include, path
from rest_framework.request import Request
from rest_framework.response import Response
from rest_framework.views import APIView

from conversations.services.backends import get_chat_model
from conversations.services.turns import release_pooled_connection
from conversations.services.variants import resolve_variant


class StatelessProxy(APIView):
    def post(self, request: Request) -> Response:
        data = request.data if isinstance(request.data, dict) else {}
        content = str(data.get("content", ""))
        variant = resolve_variant(None)
        # As a turn does: without it the pool, not the stack, would cap the proxy.
        release_pooled_connection()
        completion = get_chat_model().complete(
            [{"role": "user", "content": content}], variant.model
        )
        return Response({"content": completion.content}, status=201)


urlpatterns: list[Any] = [
    path("bench/proxy", StatelessProxy.as_view()),
    path("", include("chatmem_project.urls")),
]
