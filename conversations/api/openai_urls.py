"""The OpenAI-compatible API, mounted at /v1/ so an OpenAI SDK's base_url is http://host/v1."""

from django.urls import path

from conversations.api.openai_compat import ChatCompletionsView, ModelListView

urlpatterns = [
    path("chat/completions", ChatCompletionsView.as_view(), name="openai-chat-completions"),
    path("models", ModelListView.as_view(), name="openai-models"),
]
