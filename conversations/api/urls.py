from django.urls import include, path
from drf_spectacular.views import SpectacularSwaggerView
from rest_framework.routers import DefaultRouter

from conversations.api.views import ChatViewSet, PolicyListView, SchemaView

router = DefaultRouter()
router.register("chats", ChatViewSet, basename="chat")

urlpatterns = [
    path("policies/", PolicyListView.as_view(), name="policy-list"),
    path("schema/", SchemaView.as_view(), name="schema"),
    path("docs/", SpectacularSwaggerView.as_view(url_name="schema"), name="swagger-ui"),
    path("", include(router.urls)),
]
