from django.contrib import admin
from django.urls import include, path

from conversations.metrics_endpoint import metrics_view

urlpatterns = [
    path("admin/", admin.site.urls),
    path("api/v1/", include("conversations.api.urls")),
    # The browsable API's log in / log out links (session authentication).
    path("api-auth/", include("rest_framework.urls")),
    path("v1/", include("conversations.api.openai_urls")),
    path("metrics", metrics_view, name="metrics"),
]


# A path no route matches (an id that is not a number, a typo), and a bug's 500, answer like the
# API they are under: JSON for /api/ and the OpenAI shape for /v1/, Django's page elsewhere.
handler404 = "conversations.api.errors.page_not_found"
handler500 = "conversations.api.errors.server_error"
