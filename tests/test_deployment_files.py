"""docker-compose.yml cannot be run here (no Docker engine), so this test keeps it honest: every
module, command and file it names must exist, and the settings it relies on must be read."""

import fnmatch
import importlib
import re
import shlex
from pathlib import Path
from typing import Any

import pytest
import yaml

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
    knobs_source = (ROOT / "memory_worker" / "knobs.py").read_text()
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


def compose_services() -> dict[str, dict[str, Any]]:
    """docker-compose.yml as compose reads it (YAML merge keys applied), service by service."""
    services: dict[str, dict[str, Any]] = yaml.safe_load(COMPOSE)["services"]
    return services


ONE_SHOT = {"migrate"}  # runs to completion at each `up`; every other service runs until stopped


def test_every_long_running_service_restarts_after_a_crash_and_a_reboot() -> None:
    """No service had a restart policy: a crash or a reboot left the stack down."""
    services = compose_services()
    for name, service in services.items():
        expected = {"no"} if name in ONE_SHOT else {"unless-stopped", "always"}
        assert service.get("restart") in expected, name


def test_every_long_running_service_has_a_healthcheck() -> None:
    """Worker and beat had none: a hung one looked as healthy as a running one."""
    for name, service in compose_services().items():
        if name in ONE_SHOT:
            continue
        check = service.get("healthcheck")
        assert check and not check.get("disable") and check["test"][0] in ("CMD", "CMD-SHELL"), name


def test_the_app_image_is_built_once_and_run_by_every_app_service() -> None:
    services = compose_services()
    built = {name for name, service in services.items() if "build" in service}
    assert built == {"migrate"}  # the service every other app service waits for
    image = services["migrate"]["image"]
    for name in ("web", "worker", "beat"):
        assert services[name]["image"] == image, name
        assert services[name]["depends_on"]["migrate"] == {
            "condition": "service_completed_successfully"
        }


@pytest.mark.parametrize("variable", ["DATABASE_URL", "REDIS_URL"])
def test_env_values_for_the_database_and_redis_are_honoured(variable: str) -> None:
    """The compose environment block overrode .env's DATABASE_URL and REDIS_URL silently: each
    is now ${NAME:-default}, which compose fills from .env or the shell, empty meaning unset."""
    for name in ("migrate", "web", "worker", "beat"):
        service = compose_services()[name]
        assert service["env_file"] == ".env", name
        value = service["environment"][variable]
        assert re.fullmatch(rf"\$\{{{variable}:-[a-z]+://\S+\}}", value), (name, value)


def dockerignored(path: str) -> bool:
    """Whether .dockerignore keeps ``path`` (relative to the context) out of the build context:
    a pattern matches the path or one of its parent directories, as Docker's matching does for
    these patterns (no negations in the file)."""
    patterns = [
        line.strip()
        for line in (ROOT / ".dockerignore").read_text().splitlines()
        if line.strip() and not line.startswith("#")
    ]
    assert not any(pattern.startswith("!") for pattern in patterns)
    parts = Path(path).parts
    prefixes = ["/".join(parts[: index + 1]) for index in range(len(parts))]
    return any(
        fnmatch.fnmatchcase(prefix, pattern.removeprefix("**/"))
        or fnmatch.fnmatchcase(prefix, pattern)
        or (pattern.startswith("**/") and fnmatch.fnmatchcase(Path(prefix).name, pattern[3:]))
        for prefix in prefixes
        for pattern in patterns
    )


def test_dockerignore_keeps_the_venv_databases_and_secrets_out_of_the_build_context() -> None:
    """A 199 MB .venv and db.sqlite3 went into every build's context."""
    for path in (
        ".venv",
        ".venv/lib/python3.11/site-packages/django/__init__.py",
        "db.sqlite3",
        "db.sqlite3-journal",
        "test_db.sqlite3",
        ".env",
        ".git/HEAD",
        "conversations/__pycache__/models.cpython-311.pyc",
    ):
        assert dockerignored(path), path
    # What the Dockerfile copies is still sent.
    dockerfile = (ROOT / "Dockerfile").read_text()
    copied = [n for line in re.findall(r"^COPY (.+) \S+$", dockerfile, re.M) for n in line.split()]
    for name in copied:
        assert not dockerignored(name), name
        assert not dockerignored(f"{name}/__init__.py"), name


def test_beats_healthcheck_passes_while_its_loop_ticks_and_fails_once_it_stops(
    tmp_path: Path,
) -> None:
    import os
    import subprocess
    import time

    from celery.beat import PersistentScheduler

    from chatmem_project.beat import LivenessScheduler

    app = importlib.import_module("chatmem_project").celery_app
    assert app.conf.beat_scheduler == "chatmem_project.beat:LivenessScheduler"
    test = compose_services()["beat"]["healthcheck"]["test"]
    command = re.search(r"--schedule (\S+)", compose_services()["beat"]["command"])
    assert command is not None and f"'{command.group(1)}.alive'" in test[-1]
    schedule = tmp_path / "celerybeat-schedule"
    argv = [part.replace(command.group(1), str(schedule)) for part in test[1:]]

    def healthy() -> bool:
        return subprocess.run(argv, timeout=60).returncode == 0

    assert not healthy()  # no tick yet
    scheduler = LivenessScheduler(app=app, schedule_filename=str(schedule), lazy=True)
    # The tick itself is Celery's; what is proven here is the file it leaves.
    with pytest.MonkeyPatch.context() as patch:
        patch.setattr(PersistentScheduler, "tick", lambda self, *a, **k: 7.0)
        assert scheduler.tick() == 7.0
    assert healthy()
    threshold = int(re.search(r"> (\d+)\)", test[-1]).group(1))  # type: ignore[union-attr]
    assert threshold >= 2 * app.conf.beat_max_loop_interval
    stale = time.time() - threshold - 5
    os.utime(f"{schedule}.alive", (stale, stale))
    assert not healthy()


@pytest.mark.redis
@pytest.mark.worker
def test_workers_healthcheck_answers_for_a_running_worker_only(db: None, redis_url: str) -> None:
    """The check compose runs in a worker container, run here against a real worker named as
    Celery names one by default (celery@<hostname>; a container's hostname is $HOSTNAME)."""
    import os
    import socket
    import subprocess
    import sys

    from tests.support.workers import Worker, worker_env

    test = compose_services()["worker"]["healthcheck"]["test"]
    assert test[0] == "CMD-SHELL" and "-n " not in compose_services()["worker"]["command"]
    script = test[1].replace("$$", "$")  # compose's escape of a literal $
    path = f"{Path(sys.executable).parent}{os.pathsep}{os.environ['PATH']}"

    def healthcheck(hostname: str) -> int:
        env = {**worker_env(redis_url), "HOSTNAME": hostname, "PATH": path}
        return subprocess.run(["sh", "-c", script], cwd=ROOT, env=env, timeout=60).returncode

    worker = Worker(redis_url, "celery")
    try:
        worker.wait_ready()
        assert healthcheck(socket.gethostname()) == 0, worker.log()
        assert healthcheck("no-such-container") != 0
    finally:
        worker.stop()
