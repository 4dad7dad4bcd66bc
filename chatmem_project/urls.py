from django.contrib import admin
from django.urls import include, path

from conversations.health import healthz, readyz
from conversations.metrics import metrics_view

urlpatterns = [
    path("admin/", admin.site.urls),
    path("api/v1/", include("conversations.api.urls")),
    path("v1/", include("conversations.api.openai_urls")),
    path("healthz", healthz, name="healthz"),
    path("readyz", readyz, name="readyz"),
    path("metrics", metrics_view, name="metrics"),
]
