"""Server processes freeze their start-up objects out of the garbage collector's reach
(chatmem_project.gc_tuning): gunicorn workers through gunicorn.conf.py's post_worker_init, Celery
pool processes through worker_process_init. Each case runs in a fresh interpreter, since a freeze
cannot be undone for the objects it took and the test process's own state is not a server's."""

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parent.parent

# Each prints what the freeze left: the frozen count, whether the lazily imported modules were
# loaded first, and whether a later full collection still walks the start-up objects.
REPORT = (
    "import gc, json, sys;"
    "print(json.dumps({'frozen': gc.get_freeze_count(),"
    " 'tracked': len(gc.get_objects()),"
    " 'loaded': [m for m in ('conversations.api.views', 'memory_worker.summaries.contract')"
    "            if m in sys.modules]}))"
)
CALLS = {
    "helper": (
        "import django; django.setup();"
        "from chatmem_project.gc_tuning import freeze_startup_objects; freeze_startup_objects();"
    ),
    "gunicorn": (
        "import django, runpy; django.setup();"
        "runpy.run_path('gunicorn.conf.py')['post_worker_init'](None);"
    ),
    "celery": (
        "from chatmem_project.celery import app; import django; django.setup();"
        "from celery.signals import worker_process_init; worker_process_init.send(sender=None);"
    ),
    "none": "import django; django.setup();",
}


def run(case: str, tmp_path: Path) -> dict:
    env = {
        **os.environ,
        "DJANGO_SETTINGS_MODULE": "chatmem_project.settings",
        "DATABASE_URL": f"sqlite:///{tmp_path}/gc.sqlite3",
    }
    out = subprocess.run(
        [sys.executable, "-c", CALLS[case] + REPORT],
        cwd=ROOT,
        env=env,
        capture_output=True,
        text=True,
        timeout=120,
        check=True,
    )
    return json.loads(out.stdout.strip().splitlines()[-1])


@pytest.mark.parametrize("case", ["helper", "gunicorn", "celery"])
def test_start_up_objects_are_frozen_after_the_lazy_imports(case: str, tmp_path: Path) -> None:
    report = run(case, tmp_path)
    assert report["loaded"] == ["conversations.api.views", "memory_worker.summaries.contract"]
    # Tens of thousands of objects from Django, DRF and the openai SDK: frozen, out of what a
    # collection walks.
    assert report["frozen"] > 50_000
    assert report["tracked"] < report["frozen"] / 5


def test_without_the_hooks_nothing_is_frozen(tmp_path: Path) -> None:
    # What the assertions above would see without the freeze: the test can fail.
    report = run("none", tmp_path)
    assert report["frozen"] == 0
    assert report["tracked"] > 50_000
