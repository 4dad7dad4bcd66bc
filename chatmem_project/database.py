"""The database settings from DATABASE_URL: persistent connections, connect timeouts, the
PostgreSQL pool, and SQLite's locking for the embedded default (chatmem_project.settings)."""

from pathlib import Path
from typing import Any

import environ

from chatmem_project.env import env_bool, env_float, env_int


def databases(database_url: str, base_dir: Path) -> tuple[dict[str, Any], int, int]:
    """DATABASES, DB_POOL_MIN_SIZE and DB_POOL_MAX_SIZE."""
    config: dict[str, Any] = {"default": environ.Env.db_url_config(database_url)}
    # Persistent connections: a turn should not pay for a new PostgreSQL connection.
    config["default"]["CONN_MAX_AGE"] = env_int("DB_CONN_MAX_AGE", 60)
    # Off by default (Django's default): a health check is a `SELECT 1` round trip at the start of
    # every request, about a tenth of a turn's time under load. Without it a connection PostgreSQL
    # dropped fails the one request that finds it, and Django replaces it for the next.
    config["default"]["CONN_HEALTH_CHECKS"] = env_bool("DB_CONN_HEALTH_CHECKS", False)
    if config["default"]["ENGINE"] == "django.db.backends.postgresql":
        # libpq waits for a connection without limit by default: an unreachable database (a
        # blackholed host) then hangs a request, or the readiness probe, for minutes.
        config["default"].setdefault("OPTIONS", {}).setdefault(
            "connect_timeout", env_int("DB_CONNECT_TIMEOUT", 10)
        )
    # A bounded connection pool per process (PostgreSQL; psycopg_pool), for servers that hold many
    # requests open at once (ASGI, many slow streams): a burst waits for a free connection instead
    # of failing with "too many clients". Pooled connections replace persistent ones.
    pool_max = env_int("DB_POOL_MAX_SIZE", 0)
    # Connections the pool opens at start and keeps: a burst then finds them ready instead of
    # waiting while PostgreSQL forks a backend for each new one.
    pool_min = min(env_int("DB_POOL_MIN_SIZE", 1), pool_max)

    if pool_max and config["default"]["ENGINE"] == "django.db.backends.postgresql":
        config["default"]["CONN_MAX_AGE"] = 0
        # The pool checks a connection (an empty query) before handing it out, and replaces one
        # that fails: after PostgreSQL restarts, every idle pooled connection is dead, and
        # without the check each would fail the request it is handed to. Django 5.2 makes the
        # pool with its own check argument, ConnectionPool.check_connection with
        # CONN_HEALTH_CHECKS and None without (a "check" among the options below is a TypeError,
        # given twice), so pooling turns the health checks on; with a pool they do nothing else
        # (Django's own check defers to it).
        config["default"]["CONN_HEALTH_CHECKS"] = True
        config["default"]["OPTIONS"]["pool"] = {
            "min_size": pool_min,
            "max_size": pool_max,
            # DB_POOL_TIMEOUT: the same wait when the pool is merely busy (every connection in use)
            # is a 503 after it too; raise it to let a burst wait longer.
            "timeout": env_float(
                "DB_POOL_TIMEOUT", pool_timeout(config["default"]["OPTIONS"]["connect_timeout"])
            ),
        }
    if config["default"]["ENGINE"] == "django.db.backends.sqlite3":
        # The embedded default has two writers (requests and the in-process fold runner). BEGIN
        # IMMEDIATE takes the write lock up front, so a writer waits (timeout) instead of failing
        # with "database is locked" on a read-to-write upgrade; WAL lets readers run meanwhile.
        config["default"].setdefault("OPTIONS", {}).update(
            {
                "timeout": 20,
                "transaction_mode": "IMMEDIATE",
                "init_command": "PRAGMA journal_mode=WAL;",
            }
        )
        # Tests on SQLite use a file like the embedded default does: an in-memory shared-cache
        # database fails at once with "table is locked" when the in-process runner writes.
        config["default"]["TEST"] = {"NAME": str(base_dir / "test_db.sqlite3")}
    return {"default": config["default"]}, pool_min, pool_max


def pool_timeout(connect_timeout: object) -> float:
    """How long a request waits for a pooled connection (a free one, or a new one while
    PostgreSQL is unreachable) before it fails: the connect timeout, so that it bounds requests
    and /readyz with the pool as without it (the pool's own default, 30 s, held each of them for
    30 s during an outage). A connect timeout of 0 or less is libpq's "no limit"; the pool
    cannot wait without one (0 fails at once when no connection is idle), so it keeps its 30 s."""
    try:
        seconds = float(str(connect_timeout))
    except ValueError:
        seconds = 0.0
    return seconds if seconds > 0 else 30.0
