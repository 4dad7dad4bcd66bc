"""A user's chats, searched, filtered and ordered as the list's query parameters ask
(``GET /api/v1/chats/?search=&policy=&degraded=&ordering=``). A parameter it cannot honour is
refused with the reason (a 400), never silently ignored."""

from collections.abc import Mapping

from django.db.models import QuerySet

from conversations.models import Chat
from memory_worker.engine.presets import PRESETS

# The orderable fields, as the chat's representation names them. `id` breaks ties, so pages
# of equal keys (many chats titled the same) do not overlap.
ORDERING_FIELDS = ("title", "created_at", "updated_at", "id")
DEFAULT_ORDERING = ("-created_at", "-id")
BOOLEANS = {"true": True, "false": False}


class BadListQuery(ValueError):
    def __init__(self, parameter: str, message: str) -> None:
        super().__init__(message)
        self.parameter = parameter


def owned_chats(owner_id: int, params: Mapping[str, str]) -> QuerySet[Chat]:
    """The owner's chats; BadListQuery for an unknown policy, a degraded that is not true or
    false, or an ordering field outside ORDERING_FIELDS."""
    chats = Chat.objects.filter(owner_id=owner_id)
    # Like DRF's SearchFilter: every word must occur in the title, in any case.
    for term in params.get("search", "").replace(",", " ").split():
        chats = chats.filter(title__icontains=term)
    policy = params.get("policy")
    if policy is not None:
        if policy not in PRESETS:
            known = ", ".join(sorted(PRESETS))
            raise BadListQuery("policy", f'"{policy}" is not a policy; the policies: {known}.')
        chats = chats.filter(policy=policy)
    degraded = params.get("degraded")
    if degraded is not None:
        if degraded not in BOOLEANS:
            raise BadListQuery("degraded", f'"{degraded}" is not true or false.')
        chats = chats.filter(brief__degraded=BOOLEANS[degraded])
    return chats.order_by(*ordering(params.get("ordering")))


def ordering(raw: str | None) -> tuple[str, ...]:
    if raw is None or not raw.strip():
        return DEFAULT_ORDERING
    keys = tuple(key.strip() for key in raw.split(","))
    unknown = [key for key in keys if key.removeprefix("-") not in ORDERING_FIELDS]
    if unknown:
        raise BadListQuery(
            "ordering",
            f"Cannot order by {', '.join(repr(key) for key in unknown)}; order by "
            f"{', '.join(ORDERING_FIELDS)}, each optionally prefixed with - for descending, "
            "comma-separated.",
        )
    if any(key.removeprefix("-") == "id" for key in keys):
        return keys
    return (*keys, "-id")
