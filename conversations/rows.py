"""Model instances from plain SQL, for the few statements on a turn's hot path.

Building a queryset and running Django's compiler costs more per turn than the statements cost
to run (docs/benchmarks.md). These helpers keep what the ORM guarantees that matters here: the
columns come from the model (a new field cannot be left out), values go through the same
converters the ORM applies (JSON, SQLite's datetimes and UUIDs), and the result is an ordinary
model instance (``Model.from_db``), with any field not selected deferred as with ``only()``."""

import functools
import sqlite3
from collections.abc import Callable, Iterable, Sequence
from datetime import datetime
from typing import Any, TypeVar

import psycopg
from django.db import DEFAULT_DB_ALIAS, InterfaceError, OperationalError, connection, connections
from django.db.models import Field, Model, signals
from django.db.models.base import ModelState
from django.db.models.fields.related_descriptors import ForeignKeyDeferredAttribute
from django.db.models.query_utils import DeferredAttribute
from django.utils import timezone

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


def quoted_table(model: type[Model]) -> str:
    return connection.ops.quote_name(model._meta.db_table)


def model_field(model: type[Model], name: str) -> Field:
    field = model._meta.get_field(name)
    assert isinstance(field, Field)
    return field


def column(model: type[Model], name: str) -> str:
    """The quoted column of ``model``'s field ``name``."""
    return connection.ops.quote_name(str(model_field(model, name).column))


def assignments(model: type[Model], values: dict[str, Any]) -> tuple[str, list[Any]]:
    """``"col" = %s, ...`` and its parameters, each value prepared as the ORM saves it."""
    columns, params = [], []
    for name, value in values.items():
        columns.append(f"{column(model, name)} = %s")
        params.append(model_field(model, name).get_db_prep_save(value, connection))
    return ", ".join(columns), params


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
    build = builder(model, db.alias, attnames)  # decided once, not per row
    return [(build(converted(row[:width], converters, db)), tuple(row[width:])) for row in found]


def instances_from_json(
    model: type[ModelT], fields: Sequence[Field], rows: Iterable[Sequence[Any]]
) -> list[ModelT]:
    """Instances from rows that PostgreSQL wrote as JSON (``json_build_array`` of the
    ``fields``' columns, inside a ``json_agg``), already decoded with the JSON document. Only
    for fields whose JSON value is what the ORM would return (``json_exact``): numbers and text
    come back as they are, and a JSONField's value is the decoded JSON that its
    ``from_db_value`` would have decoded from the column's text."""
    names = tuple(field.attname for field in fields)
    if not json_exact(model, names):
        raise ValueError(f"{model.__name__} fields {names} cannot all be read from JSON exactly")
    build = builder(model, connections[DEFAULT_DB_ALIAS].alias, names)
    return [build(values) for values in rows]


# Fields whose value in PostgreSQL's JSON is the value the ORM gives: integers, text, booleans
# and (with the default decoder) JSON itself. Not dates, decimals, UUIDs, floats: JSON writes
# them as strings or numbers that the ORM's converters would turn into something else.
JSON_EXACT_TYPES = frozenset(
    {
        "AutoField",
        "BigAutoField",
        "SmallAutoField",
        "IntegerField",
        "BigIntegerField",
        "SmallIntegerField",
        "PositiveIntegerField",
        "PositiveBigIntegerField",
        "PositiveSmallIntegerField",
        "ForeignKey",
        "CharField",
        "TextField",
        "BooleanField",
        "JSONField",
    }
)


@functools.lru_cache(maxsize=64)
def json_exact(model: type[Model], attnames: tuple[str, ...]) -> bool:
    by_attname = {field.attname: field for field in model._meta.concrete_fields}
    return all(_json_exact(by_attname[name]) for name in attnames)


def _json_exact(field: Field) -> bool:
    kind = field.get_internal_type()
    if kind == "JSONField":
        return getattr(field, "decoder", None) is None  # its converter is json.loads, done
    converters = connection.ops.get_db_converters(field.cached_col)
    return kind in JSON_EXACT_TYPES and not converters + field.get_db_converters(connection)


def insert_fields(model: type[Model]) -> list[Field]:
    """The columns an INSERT of ``model`` writes: every concrete field but the primary key."""
    return [field for field in model._meta.concrete_fields if not field.primary_key]


def insert_values(instance: Model, fields: Sequence[Field]) -> list[Any]:
    """The values the ORM's insert would send for ``fields`` (``pre_save`` fills auto_now_add
    and the like on the instance first)."""
    return [field.get_db_prep_save(field.pre_save(instance, True), connection) for field in fields]


# A one-row subquery whose evaluation turns ``synchronous_commit`` off for the statement's own
# transaction (``set_config(..., is_local => true)``): joined into a write's FROM, its commit
# does not wait for the WAL to reach the disk. PostgreSQL only.
NO_FLUSH_WAIT = "(SELECT set_config('synchronous_commit', 'off', true)) AS no_flush_wait"


def insert_without_flush_wait(instance: Model) -> None:
    """PostgreSQL: INSERT ``instance`` (every concrete field but the auto primary key, values
    as the ORM's insert prepares them) in one statement whose commit does not wait for the WAL
    to reach the disk: ``synchronous_commit`` is off for that statement's transaction only.

    Only for a row whose loss in a database crash loses nothing, such as a fold's "running"
    ledger row: the fold's own commit is synchronous and comes later, and a synchronous commit
    flushes the WAL up to its own record, so every earlier commit (this one included) is on
    disk once it returns. What this saves is a fold's second wait for a disk flush, during which
    the worker's core would sit idle."""
    model = type(instance)
    fields = insert_fields(model)
    # Automatic timestamps (a ledger row's started_at) are the database's: other hosts compare
    # them with their own now().
    stamped = [field for field in fields if getattr(field, "auto_now_add", False)]
    values = [
        value
        for field, value in zip(fields, insert_values(instance, fields), strict=True)
        if field not in stamped
    ]
    # Each value cast to its column's type: in INSERT ... SELECT a NULL or a bare string would
    # otherwise be text, which a timestamp or integer column does not take.
    selected = ", ".join(
        "statement_timestamp()" if field in stamped else f"%s::{field.db_type(connection)}"
        for field in fields
    )
    primary_key = model._meta.pk
    assert primary_key is not None
    sql = (
        f"INSERT INTO {quoted_table(model)} ({column_list(fields)}) SELECT {selected} "
        f"FROM {NO_FLUSH_WAIT} "
        f"RETURNING {column_list([primary_key, *stamped])}"
    )
    with connection.cursor() as cursor:
        cursor.execute(sql, values)
        returned = cursor.fetchone()
    instance.pk = returned[0]
    for field, value in zip(stamped, returned[1:], strict=True):
        setattr(instance, field.attname, value)
    instance._state.adding = False
    instance._state.db = connection.alias


def build_instance(model: type[ModelT], fields: Sequence[Field], values: Sequence[Any]) -> ModelT:
    """The instance of one row's ``values`` for ``fields``, converted as the ORM would."""
    values = converted(values, field_converters(fields), connection)
    return instantiate(model, connection.alias, [field.attname for field in fields], values)


def converted(
    values: Sequence[Any], converters: Sequence[tuple[int, Any, Converter]], db: Any
) -> list[Any]:
    result = list(values)
    for index, expression, convert in converters:
        result[index] = convert(result[index], expression, db)
    return result


def instantiate(
    model: type[ModelT], alias: str, attnames: Sequence[str], values: Sequence[Any]
) -> ModelT:
    """What ``Model.from_db`` returns (see builder)."""
    return builder(model, alias, attnames)(values)


def builder(
    model: type[ModelT], alias: str, attnames: Sequence[str]
) -> Callable[[Sequence[Any]], ModelT]:
    """A function from one row's values to what ``Model.from_db`` returns, built without
    ``Model.__init__`` when that changes nothing: no pre_init/post_init receiver for the model and
    only plain field descriptors (which store the value in the instance's ``__dict__``). __init__
    walks every field and sends both signals, the larger part of reading a turn's unfolded tail
    (docs/benchmarks.md). Fields not selected are left out of
    ``__dict__``, so they are deferred and load on access, exactly as after ``only()``."""
    names = list(attnames)
    if not plain_descriptors(model, tuple(names)) or has_init_receivers(model):
        return lambda values: model.from_db(alias, names, list(values))

    def build(values: Sequence[Any]) -> ModelT:
        instance = model.__new__(model)
        state = ModelState()
        state.adding = False
        state.db = alias
        instance.__dict__["_state"] = state
        instance.__dict__.update(zip(names, values, strict=True))
        return instance

    return build


def has_init_receivers(model: type[Model]) -> bool:
    # Checked on every read, not cached: a receiver connected after start-up gets its signal.
    return signals.pre_init.has_listeners(model) or signals.post_init.has_listeners(model)


@functools.lru_cache(maxsize=64)
def plain_descriptors(model: type[Model], attnames: tuple[str, ...]) -> bool:
    """Whether every one of ``attnames`` is a plain column attribute: setting it through
    __init__'s setattr only stores the value (a file or a custom descriptor might do more)."""
    plain = (DeferredAttribute, ForeignKeyDeferredAttribute)
    return all(type(getattr(model, attname, None)) in plain for attname in attnames)


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


# Errors of the database itself, not of what was asked of it: a lost or refused connection, a
# restart, a cancelled statement, a deadlock. Retrying later may work (a fold's task retries
# them); of these, only database_unreachable's are an outage a client is told to retry.
DATABASE_ERRORS = (OperationalError, InterfaceError)

# SQLSTATEs of a database that is not there to answer: class 08 (connection exceptions), and
# 57P01-57P03 (shutting down, crashed, not yet accepting connections).
UNREACHABLE_SQLSTATES = ("57P01", "57P02", "57P03")


# SQLSTATEs of a transaction the database rolled back to break a lock cycle or a serialization
# conflict: nothing it wrote stands, and the same request sent again normally succeeds.
CONFLICT_SQLSTATES = ("40P01", "40001")


def lost_a_conflict(error: BaseException) -> bool:
    """Whether ``error`` is a deadlock or serialization failure the database broke by rolling
    this transaction back: a 503 to retry, not a bug's 500."""
    if not isinstance(error, OperationalError):
        return False
    return getattr(error.__cause__, "sqlstate", None) in CONFLICT_SQLSTATES


def database_unreachable(error: BaseException) -> bool:
    """Whether a database error means the database could not be reached or the connection was
    lost (a restart, a failover, a network cut, the pool out of connections): an outage to
    retry, a 503. Not an error the database answered (a statement timeout, a missing table, a
    constraint): those are bugs or load to look into, a 500 with its traceback; a deadlock or
    serialization failure is lost_a_conflict's."""
    if isinstance(error, InterfaceError):  # "connection already closed"
        return True
    if not isinstance(error, OperationalError):
        return False
    cause = error.__cause__
    if isinstance(cause, sqlite3.OperationalError):
        # The embedded mode's one writer busy past the lock timeout.
        return "database is locked" in str(cause)
    sqlstate = getattr(cause, "sqlstate", None)
    if sqlstate is None:
        # No server answered: psycopg's connection failures, a broken connection, the pool's
        # timeout carry no SQLSTATE.
        return cause is None or isinstance(cause, psycopg.OperationalError)
    return str(sqlstate).startswith("08") or sqlstate in UNREACHABLE_SQLSTATES


def database_now() -> datetime:
    """The database's clock, for times another host compares (claims, backoff, cooldowns,
    abandonment): hosts' clocks differ, the database's is one. PostgreSQL's statement time (as
    Django's Now()), one round trip; on SQLite every process runs on the one host, so its own."""
    if connection.vendor != "postgresql":
        return timezone.now()
    with connection.cursor() as cursor:
        cursor.execute("SELECT statement_timestamp()")
        row = cursor.fetchone()
    return row[0]  # type: ignore[no-any-return]
