"""The OpenAI-compatible API, mounted at /v1/ so an OpenAI SDK's base_url is http://host/v1."""

from django.urls import path
from drf_spectacular.utils import extend_schema_view

from conversations.api.openai_compat import ChatCompletionsView, ModelListView
from conversations.api.openai_schema import completions_schema, models_schema

completions = extend_schema_view(post=completions_schema)(ChatCompletionsView)
models = extend_schema_view(get=models_schema)(ModelListView)

urlpatterns = [
    path("chat/completions", completions.as_view(), name="openai-chat-completions"),
    path("models", models.as_view(), name="openai-models"),
]
