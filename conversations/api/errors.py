"""API errors keep DRF's shape ({"detail": ..., "code": ...} or field -> messages) so clients and
scripts can rely on them."""

import contextlib
import logging
from collections.abc import Iterator
from typing import Any

from django.core.exceptions import PermissionDenied
from django.http import Http404, HttpRequest, HttpResponse, JsonResponse
from django.views import defaults
from rest_framework import exceptions, status
from rest_framework.response import Response
from rest_framework.views import exception_handler as drf_exception_handler

from conversations.chat_model.contract import UPSTREAM_TIMEOUT, ModelError
from conversations.models import Chat
from conversations.rows import database_unreachable, lost_a_conflict
from conversations.services.bounded_context import ContextOverBound
from conversations.services.chats import NoRoomInWindow
from conversations.services.pins import PinRefused
from conversations.services.turn_slot import TurnInProgress
from conversations.variants import UnknownVariant
from memory_worker.engine.presets import PolicyError

log = logging.getLogger("chatmem.api")


class DatabaseUnavailable(exceptions.APIException):
    """The database failed or could not be reached: an outage to retry, not a bug (a 500)."""

    status_code = status.HTTP_503_SERVICE_UNAVAILABLE
    default_detail = (
        "The database is unavailable right now; retry shortly. (A turn refused so was normally "
        "not stored: GET the chat's messages to see.)"
    )
    default_code = "database_unavailable"
    wait: int | None = 5  # DRF sends it as Retry-After
    should_retry = True


class DatabaseLostAfterStore(DatabaseUnavailable):
    """The connection broke after the turn's store may have committed (it freed its slot, or
    the slot could not be read): sent again unchanged, the turn could be stored twice."""

    default_detail = (
        "The database connection broke while the turn was being stored; it may have been "
        "stored. GET the chat's messages before sending it again."
    )
    wait = None
    should_retry = False


class DatabaseConflict(DatabaseUnavailable):
    """The database rolled the request's transaction back to break a deadlock or a
    serialization conflict with another writer of the same rows: nothing it did stands."""

    default_detail = (
        "The request collided with other work on the same chat and was rolled back; nothing "
        "was changed. Retry it."
    )
    default_code = "database_conflict"
    wait = 1


def database_error(error: BaseException) -> DatabaseUnavailable:
    if getattr(error, "turn_may_be_stored", False):
        return DatabaseLostAfterStore()
    return DatabaseUnavailable()


class TurnConflict(exceptions.APIException):
    status_code = status.HTTP_409_CONFLICT
    default_detail = "Another turn of this chat is in progress."
    default_code = "turn_in_progress"


class ModelUpstreamError(exceptions.APIException):
    status_code = status.HTTP_502_BAD_GATEWAY
    default_detail = "The model failed to answer; nothing was stored. Retry the turn."
    default_code = "model_error"
    should_retry = True  # False: the provider refused the request itself (x-should-retry)


class ModelTimeout(exceptions.APIException):
    status_code = status.HTTP_504_GATEWAY_TIMEOUT
    default_detail = "The model did not answer in time; nothing was stored. Retry the turn."
    default_code = "model_timeout"
    should_retry = True


class MemoryUnavailable(exceptions.APIException):
    status_code = status.HTTP_503_SERVICE_UNAVAILABLE
    default_detail = "The context cannot be brought within its bound right now."
    default_code = "context_over_bound"
    should_retry = True


class TurnServerError(exceptions.APIException):
    """Only in a streamed turn's ``error`` event: the JSON turn answers an unexpected failure
    with Django's plain 500."""

    status_code = status.HTTP_500_INTERNAL_SERVER_ERROR
    default_detail = "The turn failed unexpectedly; nothing was stored. Retry the turn."
    default_code = "server_error"


class ChatDeletedDuringTurn(exceptions.NotFound):
    default_detail = "The chat was deleted while its turn ran; nothing was stored."
    default_code = "chat_deleted"


def turn_error(error: Exception) -> exceptions.APIException:
    """The API error for a turn that failed after its slot was claimed (JSON and streamed)."""
    if isinstance(error, Chat.DoesNotExist):  # the append found no chat to store into
        return ChatDeletedDuringTurn()
    if isinstance(error, TurnInProgress):  # busy, or taken over during a long fold
        return TurnConflict(str(error))
    if isinstance(error, ContextOverBound):
        over = MemoryUnavailable(str(error))
        over.should_retry = error.retryable  # the SDKs resend a 503 unless told not to
        return over
    if database_unreachable(error):
        return database_error(error)
    if isinstance(error, ModelError):
        exc_class = ModelTimeout if error.status == UPSTREAM_TIMEOUT else ModelUpstreamError
        if not error.retryable:
            refused = exc_class(f"{error} Nothing was stored.")
            refused.should_retry = False
            return refused
        return exc_class(f"{error} Nothing was stored; retry the turn.")
    return TurnServerError()


@contextlib.contextmanager
def turn_refusals() -> Iterator[None]:
    """A turn service's exceptions as the API's errors (the JSON and streamed REST turns and the
    OpenAI-compatible endpoint): 400 unknown variant, 404 chat deleted during the turn, 409
    busy chat, 502/503/504."""
    try:
        yield
    except UnknownVariant as error:
        raise exceptions.ValidationError({"model_variant": [str(error)]}) from error
    except (TurnInProgress, ContextOverBound, ModelError, Chat.DoesNotExist) as error:
        raise turn_error(error) from error


@contextlib.contextmanager
def chat_settings_refusals() -> Iterator[None]:
    """A chat's settings refused by the service (creating or editing it) as a 400 naming the
    field; a chat deleted meanwhile as a 404."""
    try:
        yield
    except UnknownVariant as error:
        raise exceptions.ValidationError({"model_variant": [str(error)]}) from error
    except NoRoomInWindow as error:  # the system prompt and the summary cap together
        raise exceptions.ValidationError({"non_field_errors": [str(error)]}) from error
    except PolicyError as error:
        raise exceptions.ValidationError({"policy_overrides": [str(error)]}) from error
    except Chat.DoesNotExist as error:
        raise exceptions.NotFound() from error


@contextlib.contextmanager
def pin_refusals() -> Iterator[None]:
    """A pin that cannot be added: 400, with the room left when it did not fit."""
    try:
        yield
    except PinRefused as error:
        if error.room_left is None:
            raise exceptions.ValidationError({error.field: [str(error)]}) from error
        raise NoRoomForPin(str(error), error.room_left) from error
    except Chat.DoesNotExist as error:
        raise exceptions.NotFound() from error


class NoRoomForPin(exceptions.APIException):
    status_code = status.HTTP_400_BAD_REQUEST
    default_code = "no_room_for_pin"

    def __init__(self, detail: str, room_left: int) -> None:
        super().__init__(detail)
        self.room_left = room_left


def exception_handler(exc: Exception, context: dict[str, Any]) -> Response | None:
    # DRF turns Django's Http404/PermissionDenied into its own exceptions; do it first so the
    # code below sees the exception whose codes the response carries.
    unreachable = database_unreachable(exc)
    if unreachable:
        log.warning("database unavailable: %s", exc, extra={"path": context["request"].path})
        exc = database_error(exc)
    elif lost_a_conflict(exc):
        log.warning("database conflict: %s", exc, extra={"path": context["request"].path})
        exc = DatabaseConflict()
    elif isinstance(exc, Http404):
        exc = exceptions.NotFound()
    elif isinstance(exc, PermissionDenied):
        exc = exceptions.PermissionDenied()
    response = drf_exception_handler(exc, context)
    if response is not None and isinstance(exc, exceptions.APIException):
        data = response.data
        # Add the stable machine-readable code beside "detail" (DRF keeps it on the exception).
        if isinstance(data, dict) and set(data) == {"detail"}:
            codes = exc.get_codes()
            if isinstance(codes, str):
                data["code"] = codes
            if isinstance(exc, NoRoomForPin):
                data["room_left"] = exc.room_left
    if response is not None and getattr(exc, "should_retry", True) is False:
        # The OpenAI SDKs (and other clients honouring it) retry a 5xx unless told not to.
        response["x-should-retry"] = "false"
    if response is not None and unreachable:
        # Logged above, once, as the warning an outage is: not django.request's ERROR as well.
        response._has_been_logged = True  # type: ignore[attr-defined]
    return response


def page_not_found(request: HttpRequest, exception: Exception | None = None) -> HttpResponse:
    if request.path.startswith("/api/"):
        return JsonResponse({"detail": "Not found.", "code": "not_found"}, status=404)
    if request.path.startswith("/v1/"):
        error = {"message": "Not found.", "type": "invalid_request_error", "param": None}
        return JsonResponse({"error": {**error, "code": "not_found"}}, status=404)
    return defaults.page_not_found(request, exception or Http404())


def server_error(request: HttpRequest) -> HttpResponse:
    """A bug's 500 in the shape of the API it is under, so a client's error handling (which
    parses JSON) does not fail on Django's HTML page; the traceback is in the log, not here."""
    detail = "Internal server error; it has been logged."
    if request.path.startswith("/api/"):
        return JsonResponse({"detail": detail, "code": "server_error"}, status=500)
    if request.path.startswith("/v1/"):
        error = {"message": detail, "type": "server_error", "param": None, "code": "server_error"}
        return JsonResponse({"error": error}, status=500)
    return defaults.server_error(request)
