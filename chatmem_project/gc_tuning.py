"""Keep the cyclic garbage collector off the objects a server process builds once.

A gunicorn worker or a Celery pool process holds a large number of container objects from its
imports (Django, DRF, the URLconf, the openai SDK's pydantic models) for as long as it lives. A
full collection walks every one of them while holding the interpreter lock, so every request
thread stops meanwhile, and the turns' tail latency carries those pauses (docs/benchmarks.md,
``python -m bench.throughput``). ``gc.freeze()`` moves the objects that exist at that point to a
generation the collector never scans, as CPython's documentation suggests for servers that fork
workers. Objects created later, per request or per fold, are collected as usual."""

import gc
import importlib

from django.urls import get_resolver

# What a process may import after start, beyond the URLconf (the Celery tasks, which the app's
# autodiscovery loads when it is finalized): loaded before the freeze so that their module-level
# objects are frozen with the rest.
LAZY_MODULES = ("memory_worker.tasks",)


def freeze_startup_objects() -> int:
    """Import what serving loads lazily, collect what start-up left as garbage (so no garbage
    is frozen for good), then freeze everything alive. Returns how many objects are frozen."""
    get_resolver().url_patterns  # noqa: B018 (the property imports every view and serializer)
    for name in LAZY_MODULES:
        importlib.import_module(name)
    gc.collect()
    gc.freeze()
    return gc.get_freeze_count()
