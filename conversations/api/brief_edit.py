"""The brief's ETag and the PATCH's If-Match (RFC 9110 §13.1.1): the ETag is the brief's
version, the fencing token a fold also advances, so an edit made on a summary a fold has since
rewritten is refused (412) instead of overwriting it."""

import contextlib
import re
from collections.abc import Iterator

from rest_framework import exceptions, status
from rest_framework.request import Request

from conversations.models import Chat
from memory_worker.memory import OverCap, VersionMoved

ETAG = re.compile(r'^(?P<weak>W/)?"(?P<version>\d{1,18})"$')


def etag(version: int) -> str:
    return f'"{version}"'


class IfMatchRequired(exceptions.APIException):
    status_code = status.HTTP_428_PRECONDITION_REQUIRED
    default_detail = (
        "Send the brief's ETag in If-Match (GET the brief: its ETag header, or its version in "
        'quotes, e.g. If-Match: "3"), so an edit cannot overwrite a fold it has not seen.'
    )
    default_code = "if_match_required"


class VersionConflict(exceptions.APIException):
    status_code = status.HTTP_412_PRECONDITION_FAILED
    default_code = "version_moved"


def expected_version(request: Request) -> int:
    """The version If-Match names: 428 without one, 400 for one that is not the brief's ETag
    (one quoted version; "*" would match any version and defeat the check), 412 for a weak one
    (RFC 9110 §13.1.1: If-Match compares strongly, and a weak tag never matches)."""
    header = request.headers.get("If-Match", "").strip()
    if not header:
        raise IfMatchRequired()
    found = ETAG.match(header)
    if found is None:
        raise exceptions.ParseError(
            f'If-Match must be the brief\'s ETag, one quoted version such as "3"; got {header!r}.'
        )
    if found.group("weak"):
        raise VersionConflict(
            f"If-Match {header} is a weak ETag, which never matches (RFC 9110 §13.1.1); "
            "send the brief's ETag as it is, without W/."
        )
    return int(found.group("version"))


@contextlib.contextmanager
def edit_refusals() -> Iterator[None]:
    try:
        yield
    except VersionMoved as error:
        raise VersionConflict(str(error)) from error
    except OverCap as error:
        raise exceptions.ValidationError({"summary": [str(error)]}) from error
    except Chat.DoesNotExist as error:  # deleted meanwhile: nothing to re-read
        raise exceptions.NotFound() from error
