"""Page-number pagination that refuses what it cannot honour: a page or page size that is not a
positive integer is a 400 naming the parameter (DRF would silently use the default size)."""

from typing import Any

from rest_framework.exceptions import ValidationError
from rest_framework.pagination import PageNumberPagination
from rest_framework.request import Request


def is_decimal(raw: str) -> bool:
    """Only ASCII digits: ``str.isdigit`` also accepts "²", which ``int`` refuses."""
    return raw.isascii() and raw.isdigit()


def positive_int(request: Request, name: str, maximum: int | None = None) -> int | None:
    raw = request.query_params.get(name)
    if raw is None:
        return None
    if not is_decimal(raw) or int(raw) < 1 or (maximum is not None and int(raw) > maximum):
        bound = f" from 1 to {maximum}" if maximum is not None else " of at least 1"
        raise ValidationError({name: [f"Must be an integer{bound}."]})
    return int(raw)


class StandardPagination(PageNumberPagination):
    page_size = 50
    page_size_query_param = "page_size"
    max_page_size = 500

    def get_page_size(self, request: Request) -> int:
        size = positive_int(request, self.page_size_query_param, self.max_page_size)
        return size if size is not None else self.page_size

    def paginate_queryset(self, queryset: Any, request: Request, view: Any = None) -> Any:
        positive_int(request, self.page_query_param)
        return super().paginate_queryset(queryset, request, view)

    def get_schema_operation_parameters(self, view: Any) -> list[dict[str, Any]]:
        parameters = super().get_schema_operation_parameters(view)
        bounds = {
            self.page_query_param: {"type": "integer", "minimum": 1},
            self.page_size_query_param: {
                "type": "integer",
                "minimum": 1,
                "maximum": self.max_page_size,
            },
        }
        for parameter in parameters:
            parameter["schema"] = bounds.get(parameter["name"], parameter["schema"])
        return parameters
