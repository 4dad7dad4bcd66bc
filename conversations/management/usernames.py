"""Usernames given to the management commands, checked as Django's own forms check them."""

from __future__ import annotations

from typing import Any

from django.contrib.auth import get_user_model
from django.core.exceptions import ValidationError
from django.core.management.base import CommandError
from django.db.models import Field


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
    """The user named ``username`` (checked first, see checked_username), or None."""
    user_model = get_user_model()
    lookup = {user_model.USERNAME_FIELD: checked_username(username)}
    return user_model._default_manager.filter(**lookup).first()
