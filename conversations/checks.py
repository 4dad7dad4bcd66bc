"""Start-up checks of the web side (``manage.py check``, and every gunicorn worker at boot:
chatmem_project.boot)."""

import sys
from typing import Any

from django.conf import settings
from django.core.checks import Error, register


def greenlets_patched() -> bool:
    """Whether gevent has replaced threads by greenlets in this process (gunicorn -k gevent)."""
    monkey = sys.modules.get("gevent.monkey")
    return bool(monkey is not None and monkey.is_module_patched("threading"))


@register()
def check_greenlet_server_has_a_pool(app_configs: Any = None, **kwargs: Any) -> list[Error]:
    # Under gevent every request in flight is a greenlet, and Django keeps a connection per
    # greenlet: up to gunicorn's worker_connections (1,000 by default) per process, far past
    # PostgreSQL's max_connections. The pool bounds them and lets a turn hand its connection
    # back while the model answers.
    if not greenlets_patched() or settings.DB_POOL_MAX_SIZE:
        return []
    if settings.DATABASES["default"]["ENGINE"] != "django.db.backends.postgresql":
        return []
    return [
        Error(
            "A gevent server needs DB_POOL_MAX_SIZE on PostgreSQL: without a pool every "
            "request in flight holds its own connection (up to gunicorn's worker_connections "
            "per process). Set DB_POOL_MAX_SIZE (docs/operations.md, gevent workers).",
            id="chatmem.E005",
        )
    ]
