"""REST API v1. Views only translate HTTP to service calls; every queryset is scoped to the
requesting user, so another user's chat is a 404 on every endpoint."""

import threading
from typing import Any

from django.db.models import QuerySet
from django.http import HttpRequest, StreamingHttpResponse
from drf_spectacular.views import SpectacularAPIView
from rest_framework import mixins, status, viewsets
from rest_framework.decorators import action
from rest_framework.exceptions import MethodNotAllowed, NotFound, ValidationError
from rest_framework.request import Request
from rest_framework.response import Response
from rest_framework.views import APIView

from conversations.api import brief_edit, errors, streaming
from conversations.api.agent_serializers import AgentStateSerializer
from conversations.api.pagination import is_decimal
from conversations.api.pin_serializers import PinRequestSerializer, PinSerializer
from conversations.api.schema import chat_schema, policy_schema
from conversations.api.serializers import (
    BriefEditSerializer,
    BriefSerializer,
    ChatSerializer,
    ConsolidationSerializer,
    DailyNoteSerializer,
    MessageSerializer,
    TurnRequestSerializer,
    turn_response_body,
)
from conversations.models import Brief, Chat, Pin
from conversations.services import agent_state as agent_service
from conversations.services import chats as chat_service
from conversations.services import pins as pin_service
from conversations.services import turns as turn_service
from conversations.services.chat_list import BadListQuery, owned_chats
from conversations.services.fold_outlook import nothing_to_fold_detail
from conversations.services.prompt_cache import prompt_cache_totals
from conversations.services.turn_model import release_db_connection
from conversations.services.turn_slot import Claimed, claim_owned_chat
from conversations.throttling import ManualFoldRateThrottle, TurnRateThrottle
from conversations.variants import chat_variant
from memory_worker.engine.presets import DESCRIPTIONS, PRESETS, policy_parameters
from memory_worker.memory import ManualRequest, edit_summary, effective_policy, request_manual_fold

PUT_NOT_ALLOWED = (
    'Method "PUT" not allowed: change a chat with PATCH, sending only the fields to change '
    "(title, system_prompt, policy, policy_overrides, model_variant, folds_paused)."
)
NOT_QUEUED = (
    "The fold could not be queued (the task broker is unavailable, or MEMORY_DISPATCH is off); "
    "nothing changed. Retry later: the cooldown sweep also folds whatever falls due."
)


@chat_schema
class ChatViewSet(
    mixins.CreateModelMixin,
    mixins.ListModelMixin,
    mixins.RetrieveModelMixin,
    mixins.DestroyModelMixin,
    viewsets.GenericViewSet,
):
    serializer_class = ChatSerializer
    # Plain ASCII digits only: int() (and the pk lookup) also reads fullwidth digits, "+6" and
    # " 6", each reaching chat 6. ([0-9], not \d: \d matches any Unicode digit.)
    lookup_value_regex = "[0-9]+"

    def get_queryset(self) -> QuerySet[Chat]:
        owner_id = self.request.user.pk
        # The schema generator calls this with no user (swagger_fake_view).
        if self.action != "list" or owner_id is None:
            return Chat.objects.filter(owner_id=owner_id)
        try:
            return owned_chats(owner_id, self.request.query_params)
        except BadListQuery as error:
            raise ValidationError({error.parameter: [str(error)]}) from error

    def perform_create(self, serializer: ChatSerializer) -> None:  # type: ignore[override]
        data = serializer.validated_data
        with errors.chat_settings_refusals():
            serializer.instance = chat_service.create_chat(
                self.request.user,  # type: ignore[arg-type]
                title=data.get("title", ""),
                system_prompt=data.get("system_prompt"),
                policy=data.get("policy"),
                policy_overrides=data.get("policy_overrides"),
                model_variant=data.get("model_variant", ""),
            )

    def partial_update(self, request: Request, pk: str | None = None) -> Response:
        chat = self.get_object()  # another user's chat: 404 before the body is read
        payload = ChatSerializer(chat, data=request.data, partial=True)
        payload.is_valid(raise_exception=True)
        with errors.chat_settings_refusals():
            chat = chat_service.update_chat(chat.owner_id, chat.pk, dict(payload.validated_data))
        return Response(ChatSerializer(chat).data)

    def http_method_not_allowed(self, request: HttpRequest, *args: Any, **kwargs: Any) -> Any:
        # As DRF's, with a pointer to PATCH for PUT: a full replacement would reset what the
        # client left out.
        detail = PUT_NOT_ALLOWED if request.method == "PUT" else None
        raise MethodNotAllowed(request.method or "", detail=detail)

    @action(
        detail=True,
        methods=["post"],
        serializer_class=TurnRequestSerializer,
        content_negotiation_class=streaming.TurnContentNegotiation,
        throttle_classes=[TurnRateThrottle],
    )
    def turns(self, request: Request, pk: str | None = None) -> Response | StreamingHttpResponse:
        payload = TurnRequestSerializer(data=request.data)
        payload.is_valid(raise_exception=True)
        data = payload.validated_data
        content, variant = data["content"], data.get("model_variant") or None
        metadata = agent_service.turn_metadata(data.get("agent"))
        if streaming.wants_stream(request, data):
            return self.streamed_turn(
                request, pk, content=content, variant=variant, metadata=metadata
            )
        with errors.turn_refusals():
            claimed = self.claim_chat(pk)
            result = turn_service.run_turn(
                claimed.chat, content, variant_name=variant, metadata=metadata, claimed=claimed
            )
        body = turn_response_body(result.user_message, result.assistant_message)
        return Response(body, status=status.HTTP_201_CREATED)

    def claim_chat(self, pk: str | None) -> Claimed:
        """The requester's chat with its turn slot claimed, in one statement (instead of
        get_object() and then the claim); 404 for any chat that is not theirs."""
        owner_id = self.request.user.pk
        assert owner_id is not None  # IsAuthenticated ran first
        try:
            return claim_owned_chat(owner_id, int(pk or ""))
        except (ValueError, Chat.DoesNotExist) as error:
            raise NotFound() from error

    def streamed_turn(
        self,
        request: Request,
        pk: str | None,
        *,
        content: str,
        variant: str | None,
        metadata: dict[str, Any] | None,
    ) -> StreamingHttpResponse:
        # Everything that can refuse the turn is checked here, before the stream starts, so it
        # is a plain JSON 4xx; after this point failures are `error` events.
        with errors.turn_refusals():
            claimed = self.claim_chat(pk)
            turn = turn_service.start_streamed_turn(
                claimed.chat, content, variant_name=variant, metadata=metadata, claimed=claimed
            )
        # The request's own connection is not needed while the stream is open (under ASGI it
        # would otherwise be held until the last event).
        release_db_connection()
        return streaming.streaming_response(request, turn)

    @action(detail=True, methods=["get"], serializer_class=MessageSerializer)
    def messages(self, request: Request, pk: str | None = None) -> Response:
        chat = self.get_object()
        queryset = chat.messages.order_by("seq")
        after_seq = request.query_params.get("after_seq")
        if after_seq is not None:
            if not is_decimal(after_seq):
                raise ValidationError({"after_seq": ["Must be a non-negative integer."]})
            queryset = queryset.filter(seq__gt=int(after_seq))
        page = self.paginate_queryset(queryset)
        return self.get_paginated_response(MessageSerializer(page, many=True).data)

    @action(detail=True, methods=["get", "patch"], serializer_class=BriefSerializer)
    def brief(self, request: Request, pk: str | None = None) -> Response:
        chat = self.get_object()  # another user's chat: 404 before the headers or body count
        if request.method == "PATCH":
            expected = brief_edit.expected_version(request)
            payload = BriefEditSerializer(data=request.data)
            payload.is_valid(raise_exception=True)
            with brief_edit.edit_refusals():
                edit_summary(
                    chat,
                    payload.validated_data["summary"],
                    expected,
                    editor=request.user.get_username(),
                )
        try:
            brief, view = chat_service.brief_and_view(chat)
        except Brief.DoesNotExist as error:  # the chat deleted meanwhile (its brief goes with it)
            raise NotFound() from error
        brief.unfolded = view.unfolded  # type: ignore[attr-defined]
        brief.pending = view.pending  # type: ignore[attr-defined]
        brief.prompt_cache = prompt_cache_totals(chat)  # type: ignore[attr-defined]
        data = BriefSerializer(brief).data
        data["running_summary"] = running_summary(view)
        return Response(data, headers={"ETag": brief_edit.etag(brief.version)})

    @action(detail=True, methods=["get"])
    def context(self, request: Request, pk: str | None = None) -> Response:
        chat = self.get_object()
        return Response({"messages": chat_service.next_context(chat)})

    @action(detail=True, methods=["get"], serializer_class=AgentStateSerializer)
    def state(self, request: Request, pk: str | None = None) -> Response:
        """The chat's agent state (docs/agent-state.md)."""
        chat = self.get_object()
        return Response(AgentStateSerializer(agent_service.chat_state(chat)).data)

    @action(detail=True, methods=["post"], throttle_classes=[ManualFoldRateThrottle])
    def consolidate(self, request: Request, pk: str | None = None) -> Response:
        chat = self.get_object()
        try:
            answer = request_manual_fold(chat.pk)
            # Read after the request: a deletion racing it is a 404 here too.
            detail = nothing_to_fold_detail(chat) if answer == ManualRequest.NOTHING_TO_FOLD else ""
        except Chat.DoesNotExist as error:
            raise NotFound() from error
        body: dict[str, Any] = {"chat_id": chat.pk, "status": str(answer)}
        if answer == ManualRequest.NOTHING_TO_FOLD:
            return Response({**body, "queued": False, "detail": detail})
        if answer == ManualRequest.NOT_QUEUED:
            # The error shape every other error has (docs/design.md, the error shape), with the
            # 202's fields beside it.
            body.update(detail=NOT_QUEUED, code="not_queued", queued=False)
            return Response(body, status=status.HTTP_503_SERVICE_UNAVAILABLE)
        if answer == ManualRequest.ALREADY_QUEUED:
            body["detail"] = "A manual fold of this chat is already queued; no other was queued."
        return Response({**body, "queued": True}, status=status.HTTP_202_ACCEPTED)

    @action(
        detail=True, methods=["get", "post"], serializer_class=PinSerializer, pagination_class=None
    )
    def pins(self, request: Request, pk: str | None = None) -> Response:
        chat = self.get_object()  # another user's chat: 404 before the body is read
        if request.method == "GET":
            return Response(PinSerializer(pin_service.list_pins(chat), many=True).data)
        payload = PinRequestSerializer(data=request.data)
        payload.is_valid(raise_exception=True)
        with errors.pin_refusals():
            pin = pin_service.add_pin(chat, **payload.validated_data, user=request.user)
        return Response(PinSerializer(pin).data, status=status.HTTP_201_CREATED)

    @action(detail=True, methods=["delete"], url_path=r"pins/(?P<pin_id>[0-9]+)")
    def unpin(self, request: Request, pk: str | None = None, pin_id: str = "") -> Response:
        chat = self.get_object()
        try:
            pin_service.remove_pin(chat, int(pin_id))
        except (ValueError, Pin.DoesNotExist) as error:
            raise NotFound("No such pin in this chat.") from error
        return Response(status=status.HTTP_204_NO_CONTENT)

    @action(detail=True, methods=["get"], serializer_class=DailyNoteSerializer)
    def notes(self, request: Request, pk: str | None = None) -> Response:
        """The daily tier: durable facts from folded messages, one note per day."""
        chat = self.get_object()
        page = self.paginate_queryset(chat.daily_notes.order_by("-day"))
        return self.get_paginated_response(DailyNoteSerializer(page, many=True).data)

    @action(detail=True, methods=["get"], serializer_class=ConsolidationSerializer)
    def consolidations(self, request: Request, pk: str | None = None) -> Response:
        chat = self.get_object()
        page = self.paginate_queryset(chat.consolidations.order_by("-id"))
        owner = {"owner_username": request.user.get_username()}  # get_object: it is theirs
        rows = ConsolidationSerializer(page, many=True, context=owner)
        return self.get_paginated_response(rows.data)


def running_summary(view: chat_service.MemoryView) -> dict[str, object]:
    """The RunningSummary view (docs/policies.md): the summary and which messages it covers
    (seq 1..W)."""
    watermark = view.snapshot.last_consolidated
    return {
        "summary": view.snapshot.summary,
        "summarized_message_ids": {"from_seq": 1, "to_seq": watermark} if watermark else None,
        "last_summarized_message_id": view.last_summarized_message_id,
        "last_summarized_seq": watermark or None,
    }


@policy_schema
class PolicyListView(APIView):
    def get(self, request: Request) -> Response:
        window = chat_variant("").context_tokens
        return Response(
            {
                "results": [
                    # As chats get them: with the operator's environment knobs and the
                    # default model variant's window.
                    {
                        "name": name,
                        "description": DESCRIPTIONS[name],
                        "parameters": policy_parameters(effective_policy(name), window),
                    }
                    for name in sorted(PRESETS)
                ]
            }
        )


# The schema's endpoint, /api/v1/schema/ (what it describes is conversations.api.schema).
_SCHEMA_GENERATION = threading.Lock()


class SchemaView(SpectacularAPIView):
    """drf-spectacular builds a schema with process-wide state (its extensions import their
    target classes on first use and reset them on failure): two first requests at once in one
    process (gunicorn's threads) raced there and one was a 500. One generation at a time."""

    def _get_schema_response(self, request: Request) -> Response:
        with _SCHEMA_GENERATION:
            return super()._get_schema_response(request)
