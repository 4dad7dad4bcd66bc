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


def service_block(name: str) -> str:
    """The lines of one service in docker-compose.yml (up to the next service or section)."""
    block = re.search(rf"^  {name}:\n((?:    .*\n|\s*\n)+)", COMPOSE, re.M)
    assert block is not None, name
    return block.group(1)


def gunicorn_graceful_timeout(**environment: str) -> int:
    """gunicorn.conf.py's graceful_timeout as gunicorn reads it, in a fresh interpreter."""
    import os
    import subprocess
    import sys

    script = "import runpy; print(runpy.run_path('gunicorn.conf.py')['graceful_timeout'])"
    result = subprocess.run(
        [sys.executable, "-c", script],
        cwd=ROOT,
        env={**os.environ, **environment},
        capture_output=True,
        text=True,
        timeout=60,
        check=True,
    )
    return int(result.stdout.strip().splitlines()[-1])


def test_gunicorn_lets_the_turns_in_flight_finish_when_stopped() -> None:
    """Gunicorn's default 30 s cut turns short on every deploy: the model alone may take 60 s,
    after a wait for a fold in flight and a synchronous fold of up to 60 s each."""
    from django.conf import settings

    graceful = gunicorn_graceful_timeout()
    margin = settings.TURN_SLOT_STALE_SECONDS - settings.LLM_TIMEOUT_SECONDS
    assert margin > 0
    turn = 2 * settings.MEMORY_LLM_TIMEOUT_SECONDS + settings.LLM_TIMEOUT_SECONDS + margin
    assert graceful >= turn == 210
    # It follows the deadlines it is made of.
    assert gunicorn_graceful_timeout(LLM_TIMEOUT_SECONDS="200") == 2 * 60 + 200 + 30
    assert gunicorn_graceful_timeout(MEMORY_LLM_TIMEOUT_SECONDS="90") == 2 * 90 + 60 + 30


def test_gunicorns_master_does_not_load_the_settings() -> None:
    """Loaded in the master, the settings (and .env) were inherited by every forked worker,
    which then ignored gunicorn's -e values (LLM_TIMEOUT_SECONDS=7 served as 60)."""
    import os
    import subprocess
    import sys

    script = (
        "import runpy, sys; runpy.run_path('gunicorn.conf.py'); "
        "print('chatmem_project.settings' in sys.modules, 'django.conf' in sys.modules)"
    )
    result = subprocess.run(
        [sys.executable, "-c", script],
        cwd=ROOT,
        env=dict(os.environ),
        capture_output=True,
        text=True,
        timeout=60,
        check=True,
    )
    assert result.stdout.split()[-2:] == ["False", "False"], result.stdout


def test_compose_gives_the_web_server_longer_than_gunicorns_graceful_timeout() -> None:
    """Docker's default 10 s before SIGKILL killed every turn in flight on a deploy."""
    grace = re.search(r"^    stop_grace_period: (\d+)s$", service_block("web"), re.M)
    assert grace is not None
    assert int(grace.group(1)) > gunicorn_graceful_timeout()


def test_each_server_keeps_its_metrics_in_a_directory_of_its_own() -> None:
    """gunicorn clears its directory at start and Celery its own: a shared one lost the
    worker's samples on every web restart, or summed them into both scrape targets."""
    directories = {}
    for service in ("web", "worker"):
        found = re.search(r"^\s+PROMETHEUS_MULTIPROC_DIR: (\S+)$", service_block(service), re.M)
        assert found is not None, service
        directories[service] = found.group(1)
    assert directories["web"] != directories["worker"]
    assert "PROMETHEUS_MULTIPROC_DIR" not in COMPOSE.split("\nservices:")[0]  # not in x-app
    advice = (ROOT / ".env.example").read_text() + (ROOT / "docs" / "operations.md").read_text()
    assert "a directory they share" not in advice
    assert re.search(r"NOT shared between gunicorn and Celery", advice)


def test_compose_waits_for_the_real_postgres_server_not_the_first_boot_one() -> None:
    compose = (ROOT / "docker-compose.yml").read_text()
    probe = re.search(r"pg_isready[^\"\]]*", compose)
    assert probe is not None and "-h 127.0.0.1" in probe.group(0)
