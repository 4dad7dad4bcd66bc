"""Usernames given to the management commands, checked as Django's own forms check them."""

from __future__ import annotations

from typing import Any

from django.contrib.auth import get_user_model
from django.core.exceptions import ValidationError
from django.core.management.base import CommandError
from django.db.models import Field

from conversations.api.parsers import unstorable


def checked_username(username: str) -> str:
    """``username`` if the user model could store it (its field's validators: the model's
    ``username_validator`` and ``max_length``, and not blank), else CommandError with the reason.
    Checked before any query: an over-long name failed on PostgreSQL with a DataError, a NUL or
    an unpaired surrogate in the query itself, and "" or "a b/c" made (or failed to make) a user
    that the admin and ``createsuperuser`` would have refused."""
    user_model = get_user_model()
    field = user_model._meta.get_field(user_model.USERNAME_FIELD)
    assert isinstance(field, Field)
    try:
        field.clean(username, None)
    except ValidationError as error:
        reason = " ".join(error.messages)
        raise CommandError(f"invalid username {username!r}: {reason}") from error
    return username


def find_user(username: str) -> Any:
    """The user named ``username`` exactly, or None. Only what the database cannot compare is
    refused here (a NUL, an unpaired surrogate, a name longer than the column): a user made
    without these checks (by the admin or an importer) must stay reachable (``--revoke``). A new
    user's name gets the full check_username."""
    user_model = get_user_model()
    max_length = getattr(user_model._meta.get_field(user_model.USERNAME_FIELD), "max_length", None)
    too_long = max_length is not None and len(username) > max_length
    problem = unstorable(username) or (f"more than {max_length} characters" if too_long else None)
    if problem is not None:
        raise CommandError(f"invalid username {username!r}: {problem}")
    return user_model._default_manager.filter(**{user_model.USERNAME_FIELD: username}).first()
