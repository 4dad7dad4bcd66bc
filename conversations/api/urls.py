from django.urls import include, path
from rest_framework.routers import DefaultRouter

from conversations.api.views import ChatViewSet, PolicyListView

router = DefaultRouter()
router.register("chats", ChatViewSet, basename="chat")

urlpatterns = [
    path("policies/", PolicyListView.as_view(), name="policy-list"),
    path("", include(router.urls)),
]
