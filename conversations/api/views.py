"""REST API v1. Views only translate HTTP to service calls; every queryset is scoped to the
requesting user, so another user's chat is a 404 on every endpoint."""

from django.db.models import QuerySet
from rest_framework import mixins, status, viewsets
from rest_framework.decorators import action
from rest_framework.exceptions import ValidationError
from rest_framework.request import Request
from rest_framework.response import Response
from rest_framework.views import APIView

from conversations.api import errors
from conversations.api.serializers import (
    BriefSerializer,
    ChatSerializer,
    ConsolidationSerializer,
    MessageSerializer,
    TurnRequestSerializer,
    TurnResponseSerializer,
)
from conversations.llm import ModelError
from conversations.models import Chat
from conversations.services import chats as chat_service
from conversations.services import turns as turn_service
from conversations.services.variants import UnknownVariant
from memory_worker.dispatch import request_consolidation
from memory_worker.presets import PRESETS, policy_parameters


class ChatViewSet(
    mixins.CreateModelMixin,
    mixins.ListModelMixin,
    mixins.RetrieveModelMixin,
    mixins.DestroyModelMixin,
    viewsets.GenericViewSet,
):
    serializer_class = ChatSerializer

    def get_queryset(self) -> QuerySet[Chat]:
        return Chat.objects.filter(owner_id=self.request.user.pk)

    def perform_create(self, serializer: ChatSerializer) -> None:  # type: ignore[override]
        data = serializer.validated_data
        try:
            serializer.instance = chat_service.create_chat(
                self.request.user,  # type: ignore[arg-type]
                title=data.get("title", ""),
                system_prompt=data.get("system_prompt"),
                policy=data.get("policy"),
                policy_overrides=data.get("policy_overrides"),
                model_variant=data.get("model_variant", ""),
            )
        except UnknownVariant as error:
            raise ValidationError({"model_variant": [str(error)]}) from error

    @action(detail=True, methods=["post"], serializer_class=TurnRequestSerializer)
    def turns(self, request: Request, pk: str | None = None) -> Response:
        chat = self.get_object()
        payload = TurnRequestSerializer(data=request.data)
        payload.is_valid(raise_exception=True)
        try:
            result = turn_service.run_turn(
                chat,
                payload.validated_data["content"],
                payload.validated_data.get("model_variant") or None,
            )
        except UnknownVariant as error:
            raise ValidationError({"model_variant": [str(error)]}) from error
        except turn_service.TurnInProgress as error:
            raise errors.TurnConflict(str(error)) from error
        except turn_service.ContextOverBound as error:
            raise errors.MemoryUnavailable(str(error)) from error
        except ModelError as error:
            exc_class = errors.ModelTimeout if error.status == 504 else errors.ModelUpstreamError
            raise exc_class(f"{error} Nothing was stored; retry the turn.") from error
        body = TurnResponseSerializer(
            {"user_message": result.user_message, "assistant_message": result.assistant_message}
        ).data
        return Response(body, status=status.HTTP_201_CREATED)

    @action(detail=True, methods=["get"], serializer_class=MessageSerializer)
    def messages(self, request: Request, pk: str | None = None) -> Response:
        chat = self.get_object()
        queryset = chat.messages.order_by("seq")
        after_seq = request.query_params.get("after_seq")
        if after_seq is not None:
            if not after_seq.isdigit():
                raise ValidationError({"after_seq": ["Must be a non-negative integer."]})
            queryset = queryset.filter(seq__gt=int(after_seq))
        page = self.paginate_queryset(queryset)
        return self.get_paginated_response(MessageSerializer(page, many=True).data)

    @action(detail=True, methods=["get"], serializer_class=BriefSerializer)
    def brief(self, request: Request, pk: str | None = None) -> Response:
        chat = self.get_object()
        view = chat_service.memory_view(chat)
        brief = chat.brief
        brief.unfolded = view.unfolded  # type: ignore[attr-defined]
        brief.pending = view.pending  # type: ignore[attr-defined]
        return Response(BriefSerializer(brief).data)

    @action(detail=True, methods=["get"])
    def context(self, request: Request, pk: str | None = None) -> Response:
        chat = self.get_object()
        return Response({"messages": chat_service.next_context(chat)})

    @action(detail=True, methods=["post"])
    def consolidate(self, request: Request, pk: str | None = None) -> Response:
        chat = self.get_object()
        queued = request_consolidation(chat.pk, "manual")
        return Response(
            {"queued": queued, "chat_id": chat.pk},
            status=status.HTTP_202_ACCEPTED if queued else status.HTTP_503_SERVICE_UNAVAILABLE,
        )

    @action(detail=True, methods=["get"], serializer_class=ConsolidationSerializer)
    def consolidations(self, request: Request, pk: str | None = None) -> Response:
        chat = self.get_object()
        page = self.paginate_queryset(chat.consolidations.order_by("-id"))
        return self.get_paginated_response(ConsolidationSerializer(page, many=True).data)


class PolicyListView(APIView):
    def get(self, request: Request) -> Response:
        return Response(
            {
                "results": [
                    {"name": name, "parameters": policy_parameters(preset)}
                    for name, preset in sorted(PRESETS.items())
                ]
            }
        )
