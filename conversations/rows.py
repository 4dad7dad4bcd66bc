"""Model instances from plain SQL, for the few statements on a turn's hot path.

Building a queryset and running Django's compiler costs more per turn than the statements cost
to run (a 40-message tail: about 2.7 ms through the ORM, 1 ms through this; benchmarks.md).
These helpers keep what the ORM guarantees that matters here: the columns come from the model
(a new field cannot be left out), values go through the same converters the ORM applies (JSON,
SQLite's datetimes and UUIDs), and the result is an ordinary model instance (``Model.from_db``),
with any field not selected deferred as with ``only()``."""

from collections.abc import Callable, Iterable, Sequence
from typing import Any, TypeVar

from django.db import DEFAULT_DB_ALIAS, connection, connections
from django.db.models import Field, Model

ModelT = TypeVar("ModelT", bound=Model)
Converter = Callable[[Any, Any, Any], Any]


def selected_fields(model: type[Model], names: Iterable[str] | None = None) -> list[Field]:
    """The model's concrete fields (all, or those named), in the model's field order: the order
    ``from_db`` expects its values in."""
    wanted = None if names is None else set(names)
    return [
        field
        for field in model._meta.concrete_fields
        if wanted is None or field.name in wanted or field.attname in wanted
    ]


def column_list(fields: Sequence[Field], table_alias: str = "") -> str:
    prefix = f"{table_alias}." if table_alias else ""
    quote = connection.ops.quote_name
    return ", ".join(prefix + quote(str(field.column)) for field in fields)


def fetch_instances(
    model: type[ModelT], fields: Sequence[Field], sql: str, params: Sequence[Any]
) -> list[tuple[ModelT, tuple[Any, ...]]]:
    """Run ``sql``, whose first columns are ``fields`` (see column_list) and any further ones
    extra values, and return each row as (instance, extra values)."""
    db = connections[DEFAULT_DB_ALIAS]  # the thread's connection, looked up once, not per value
    converters = field_converters(fields)
    attnames = [field.attname for field in fields]
    width = len(fields)
    with db.cursor() as cursor:
        cursor.execute(sql, params)
        found = cursor.fetchall()
    instances = []
    for row in found:
        values = list(row[:width])
        for index, expression, convert in converters:
            values[index] = convert(values[index], expression, db)
        instances.append((model.from_db(db.alias, attnames, values), tuple(row[width:])))
    return instances


def build_instance(model: type[ModelT], fields: Sequence[Field], values: Sequence[Any]) -> ModelT:
    """The instance of one row's ``values`` for ``fields``, converted as the ORM would."""
    converted = list(values)
    for index, expression, convert in field_converters(fields):
        converted[index] = convert(converted[index], expression, connection)
    return model.from_db(connection.alias, [field.attname for field in fields], converted)


def field_converters(fields: Sequence[Field]) -> list[tuple[int, Any, Converter]]:
    """What the ORM's compiler applies to each column read: the backend's converters, then the
    field's own (``from_db_value``)."""
    converters = []
    for index, field in enumerate(fields):
        column = field.cached_col
        for convert in connection.ops.get_db_converters(column) + field.get_db_converters(
            connection
        ):
            converters.append((index, column, convert))
    return converters
