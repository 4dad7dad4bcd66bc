"""STUB for branch brief-edit only: the pins branch brings the real module (the lead keeps
theirs at merge and drops this file). The interface /v1's ``chatmem.pin`` calls."""

from django.contrib.auth.models import AbstractBaseUser, AnonymousUser

from conversations.models import Chat


class PinRefused(ValueError):
    def __init__(self, message: str, *, field: str, room_left: int | None = None) -> None:
        super().__init__(message)
        self.field = field
        self.room_left = room_left


def add_pin(
    chat: Chat,
    *,
    text: str | None = None,
    seq: int | None = None,
    user: AbstractBaseUser | AnonymousUser | None = None,
) -> object:
    raise PinRefused("Pins are not available on this server yet.", field="text")
