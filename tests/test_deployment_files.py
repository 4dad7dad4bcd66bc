"""docker-compose.yml cannot be run here (no Docker engine), so this test keeps it honest: every
module, command and file it names must exist, and the settings it relies on must be read."""

import importlib
import re
import shlex
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parent.parent
COMPOSE = (ROOT / "docker-compose.yml").read_text()


def compose_commands() -> list[list[str]]:
    return [shlex.split(line) for line in re.findall(r"^\s+command: (.+)$", COMPOSE, re.M)]


def test_compose_names_the_expected_services() -> None:
    for service in ("postgres:", "redis:", "migrate:", "web:", "worker:", "beat:"):
        assert f"\n  {service}" in COMPOSE, service


@pytest.mark.parametrize("argv", compose_commands(), ids=lambda argv: " ".join(argv[:3]))
def test_compose_commands_exist(argv: list[str]) -> None:
    program = argv[0]
    if program == "gunicorn":
        module, _, attribute = argv[1].partition(":")
        assert hasattr(importlib.import_module(module), attribute)
    elif program == "celery":
        assert argv[1:3] == ["-A", "chatmem_project"]
        app = importlib.import_module("chatmem_project").celery_app
        if argv[3] == "worker":
            assert argv[argv.index("-Q") + 1] == app.conf.task_default_queue == "memory"
        else:
            assert argv[3] == "beat"
            assert "chatmem-sweep" in app.conf.beat_schedule
    elif program == "python":
        assert argv[1] == "manage.py"
        from django.core.management import get_commands

        assert argv[2] in get_commands()
    else:
        pytest.fail(f"unknown program in docker-compose.yml: {program}")


def test_compose_files_and_env_exist() -> None:
    assert "build: ." in COMPOSE
    dockerfile = (ROOT / "Dockerfile").read_text()
    copied = [
        name for line in re.findall(r"^COPY (.+) \S+$", dockerfile, re.M) for name in line.split()
    ]
    for name in copied:
        assert (ROOT / name).exists(), name
    assert (ROOT / ".env.example").exists()
    # gunicorn reads ./gunicorn.conf.py from where it starts (WORKDIR): its hooks (start-up
    # checks, the collector's freeze, Prometheus' directory) are in the image only if copied.
    assert "gunicorn.conf.py" in copied
    assert re.search(r"^WORKDIR /app$", dockerfile, re.M)


def test_env_example_lists_every_setting_read_from_the_environment() -> None:
    settings_source = (ROOT / "chatmem_project" / "settings.py").read_text()
    knobs_source = (ROOT / "memory_worker" / "env_knobs.py").read_text()
    read = set(re.findall(r'env(?:\.\w+)?\(\s*"([A-Z_0-9]+)"', settings_source))
    read |= set(re.findall(r'"([A-Z][A-Z_0-9]+)"', knobs_source))
    documented = set(
        re.findall(r"^#?\s*([A-Z][A-Z_0-9]+)=", (ROOT / ".env.example").read_text(), re.M)
    )
    assert read - documented == set()


def test_compose_lets_a_stopping_worker_finish_its_fold() -> None:
    """Docker's default 10 s before SIGKILL cut folds short on every deploy, and the messages
    the worker held came back only after the broker's visibility timeout."""
    from django.conf import settings

    worker = COMPOSE.split("\n  worker:")[1].split("\n  beat:")[0]
    grace = re.search(r"^\s+stop_grace_period: (\d+)s$", worker, re.M)
    assert grace is not None
    assert int(grace.group(1)) > settings.MEMORY_TASK_TIME_LIMIT


def test_a_publish_waits_a_bounded_time_for_a_broker_producer() -> None:
    app = importlib.import_module("chatmem_project").celery_app
    assert app.conf.broker_pool_acquire_timeout == 2.0  # Celery's default waits forever
