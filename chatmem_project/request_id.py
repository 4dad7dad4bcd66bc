"""A request id on every log line of a request, and of the tasks the request enqueued.

The id comes from the client's ``X-Request-ID`` header when it is a sane token, else a fresh one;
it is echoed in the response. Celery carries it in a message header (``before_task_publish``) and
the worker restores it around the task (``task_prerun`` / ``task_postrun``); the in-process
runner copies the context into its thread."""

from __future__ import annotations

import re
import uuid
from collections.abc import Callable
from contextvars import ContextVar
from typing import Any

from celery.signals import before_task_publish, task_postrun, task_prerun
from django.http import HttpRequest, HttpResponse

HEADER = "X-Request-ID"
TASK_HEADER = "chatmem_request_id"
VALID_ID = re.compile(r"^[A-Za-z0-9._-]{1,64}$")

current_request_id: ContextVar[str | None] = ContextVar("chatmem_request_id", default=None)


class RequestIdMiddleware:
    def __init__(self, get_response: Callable[[HttpRequest], HttpResponse]) -> None:
        self.get_response = get_response

    def __call__(self, request: HttpRequest) -> HttpResponse:
        offered = request.headers.get(HEADER, "")
        request_id = offered if VALID_ID.match(offered) else uuid.uuid4().hex
        token = current_request_id.set(request_id)
        try:
            response = self.get_response(request)
        finally:
            current_request_id.reset(token)
        response[HEADER] = request_id
        return response


@before_task_publish.connect(dispatch_uid="chatmem.request_id.publish")
def carry_request_id(headers: dict[str, Any] | None = None, **_: Any) -> None:
    request_id = current_request_id.get()
    if request_id and headers is not None:
        headers[TASK_HEADER] = request_id


@task_prerun.connect(dispatch_uid="chatmem.request_id.prerun")
def restore_request_id(task: Any = None, **_: Any) -> None:
    request_id = getattr(getattr(task, "request", None), TASK_HEADER, None)
    current_request_id.set(request_id if isinstance(request_id, str) else None)


@task_postrun.connect(dispatch_uid="chatmem.request_id.postrun")
def clear_request_id(**_: Any) -> None:
    current_request_id.set(None)
