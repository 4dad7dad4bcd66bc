from django.contrib import admin
from django.urls import include, path

from conversations.health import healthz, readyz

urlpatterns = [
    path("admin/", admin.site.urls),
    path("api/v1/", include("conversations.api.urls")),
    path("healthz", healthz, name="healthz"),
    path("readyz", readyz, name="readyz"),
]
