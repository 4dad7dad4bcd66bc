"""The documentation says what the code does: README's commands, install lines and responses;
docs/operations.md's check ids, settings and their defaults; .env.example's explanations."""

from __future__ import annotations

import ast
import contextlib
import math
import os
import re
import subprocess
import sys
import urllib.error
import urllib.request
from collections.abc import Iterator
from pathlib import Path

import pytest

from chatmem_project.boot import MIN_SECRET_KEY_LENGTH
from conversations.api.pagination import StandardPagination
from conversations.checks import NON_NEGATIVE_WEB_SETTINGS, POSITIVE_WEB_SETTINGS
from conversations.management.commands.chat import Command
from tests.support.private_redis import free_port
from tests.support.workers import wait_until

ROOT = Path(__file__).resolve().parent.parent
README = (ROOT / "README.md").read_text()
OPERATIONS = (ROOT / "docs" / "operations.md").read_text()
POLICIES = (ROOT / "docs" / "policies.md").read_text()


# --- README: commands and install lines -----------------------------------------------------------


def test_readme_names_every_option_of_the_chat_command() -> None:
    parser = Command().create_parser("manage.py", "chat")
    options = {o for action in parser._actions for o in action.option_strings}
    own = {"--chat", "--policy", "--user"} & options
    assert own == {"--chat", "--policy", "--user"}
    usage = re.search(r"`\.venv/bin/python manage\.py chat ([^`]*)`", README)
    assert usage is not None
    for option in own:
        assert option in usage.group(1), option
    assert "--user demo" in README  # a chat made through the API by the demo user


def test_readme_says_how_to_serve_elsewhere_and_that_serve_demo_is_sqlite_only() -> None:
    assert "serve.sh\n--addrport" in README or "serve.sh --addrport" in README
    quickstart = README[README.index("## Quickstart") : README.index("## A conversation")]
    assert "DATABASE_URL" in quickstart and ".env" in quickstart


def test_langgraph_extra_is_installed_from_the_checkout() -> None:
    for text in (README, POLICIES):
        assert "chatmem[langgraph]" not in text
        assert "pip install -e '.[langgraph]'" in text


# --- README: the walkthrough, pasted into a shell ---------------------------------------------


def bash_block_after(heading: str) -> str:
    start = README.index("```bash\n", README.index(heading)) + len("```bash\n")
    return README[start : README.index("```", start)]


@contextlib.contextmanager
def demo_server(tmp_path: Path) -> Iterator[tuple[str, str, Path]]:
    """``scripts/serve.sh``'s server (manage.py serve_demo) on its own SQLite file and port: its
    URL, the API token it prints, and its log."""
    port = free_port()
    log = tmp_path / "serve.log"
    env = {
        **os.environ,
        "DATABASE_URL": f"sqlite:///{tmp_path / 'demo.sqlite3'}",
        "DEBUG": "true",
        "REDIS_URL": "",
        "MEMORY_DISPATCH": "",
    }
    command = [sys.executable, "manage.py", "serve_demo", "--addrport", f"127.0.0.1:{port}"]
    with log.open("w") as out:
        server = subprocess.Popen(command, cwd=ROOT, env=env, stdout=out, stderr=subprocess.STDOUT)
    try:
        token = re.compile(r"API token for user 'demo': (\w+)")
        assert wait_until(lambda: bool(token.search(log.read_text())), timeout=60), log.read_text()
        base = f"http://127.0.0.1:{port}"
        assert wait_until(lambda: served(base), timeout=30), log.read_text()
        match = token.search(log.read_text())
        assert match is not None
        yield base, match.group(1), log
    finally:
        server.terminate()
        server.wait(timeout=10)


def served(base: str) -> bool:
    try:
        with urllib.request.urlopen(f"{base}/healthz", timeout=2) as response:
            return bool(response.status == 200)
    except OSError:
        return False


def test_the_readme_walkthrough_pasted_into_a_shell_shows_a_fold_and_its_summary(
    tmp_path: Path,
) -> None:
    """The curl walkthrough's set-up lines and "See a fold happen", as written, against the
    quickstart's server: a committed fold, the summary it wrote, the context with it, an edit."""
    setup = bash_block_after("## A conversation with curl").splitlines()[:3]
    with demo_server(tmp_path) as (base, token, log):
        script = "\n".join(
            [
                setup[0].replace("TOKEN=...", f"TOKEN={token}", 1).split("#")[0],
                setup[1].replace("http://127.0.0.1:8000", base),
                setup[2],
                bash_block_after("### See a fold happen"),
            ]
        )
        shell = subprocess.run(
            ["bash", "-euo", "pipefail", "-c", script],
            cwd=ROOT,
            capture_output=True,
            text=True,
            timeout=180,
        )
        before = log.read_text().count("\n")
        with contextlib.suppress(urllib.error.HTTPError):
            urllib.request.urlopen(f"{base}/api/v1/chats/999/brief/", timeout=5)
        assert wait_until(lambda: log.read_text().count("\n") > before, timeout=10)
        refused = [line for line in log.read_text().splitlines()[before:] if "999" in line]
    assert shell.returncode == 0, shell.stderr
    out = shell.stdout
    assert "overflow succeeded 1 4" in out
    assert "- My locker number is 4821." in out and "- Never share the door code 7730." in out
    assert "folded up to 4 version 1" in out
    assert "system Summary of the earlier conversation" in out
    assert "user I prefer short answers." in out  # the verbatim tail after the summary
    assert out.rstrip().endswith("version 2 True")  # the edit: GET, change, PATCH
    assert len(refused) == 1, refused  # one log line per refused request


# --- README: responses ----------------------------------------------------------------------------


def test_readme_says_the_page_size_maximum_and_every_plain_json_stream_refusal() -> None:
    row = next(line for line in README.splitlines() if "/messages/` |" in line)
    assert f"at most {StandardPagination.max_page_size}" in row
    refusals = README[README.index("Refusals (") : README.index("before the stream starts")]
    for status in ("400", "404", "409", "413", "429"):
        assert status in refusals, status


# --- docs/operations.md ---------------------------------------------------------------------------


def test_operations_lists_every_check_id_the_code_defines() -> None:
    defined = set()
    for path in [*ROOT.glob("*/checks.py"), ROOT / "chatmem_project" / "boot.py"]:
        defined |= set(re.findall(r'id="(chatmem\.[EWI]\d{3})"', path.read_text()))
    assert {"chatmem.E001", "chatmem.E003", "chatmem.E004", "chatmem.W001"} <= defined
    for check_id in defined:
        assert f"| `{check_id}` |" in OPERATIONS, check_id


def test_operations_files_non_positive_web_limits_under_e007() -> None:
    row = next(line for line in OPERATIONS.splitlines() if line.startswith("| `chatmem.E007`"))
    for name in (*POSITIVE_WEB_SETTINGS, *NON_NEGATIVE_WEB_SETTINGS):
        assert f"`{name}`" in row, name


def test_the_documented_secret_key_command_passes_the_deploy_check() -> None:
    found = re.search(r"openssl rand -base64 (\d+)", OPERATIONS)
    assert found is not None
    length = 4 * math.ceil(int(found.group(1)) / 3)
    assert length >= 50 >= MIN_SECRET_KEY_LENGTH  # security.W009 warns under 50
    assert "50 characters or more" in OPERATIONS and "security.W009" in OPERATIONS


def test_the_psycopg_floor_is_the_one_gevent_needs() -> None:
    documented = re.search(r"psycopg 3 \((3\.\d+\.\d+) and later\)", OPERATIONS)
    required = re.search(r'"psycopg\[[^\]]*\]>=([\d.]+)"', (ROOT / "pyproject.toml").read_text())
    assert documented is not None and required is not None
    as_tuple = lambda version: tuple(int(part) for part in version.split("."))  # noqa: E731
    assert as_tuple(required.group(1)) >= as_tuple(documented.group(1))


UNDOCUMENTED = (
    "CHAT_MODEL_CONTEXT_TOKENS",
    "CSRF_TRUSTED_ORIGINS",
    "DB_CONNECT_TIMEOUT",
    "LOG_LEVEL",
    "SECURE_HSTS_PRELOAD",
    "CHATMEM_DEFAULT_SYSTEM_PROMPT",
    "PROMPT_ID_SUMMARY_GLOBAL",
    "DB_POOL_MIN_SIZE",
)


def source_default(name: str) -> object:
    source = "\n".join(
        (ROOT / "chatmem_project" / name).read_text() for name in ("settings.py", "database.py")
    )
    found = re.search(rf'env(?:_\w+|\.\w+)?\(\s*"{name}",\s*(?:default=)?([^\n]+?)\s*\)', source)
    assert found is not None, name
    return ast.literal_eval(found.group(1))


@pytest.mark.parametrize("name", UNDOCUMENTED)
def test_operations_documents_each_setting_with_its_default(name: str) -> None:
    row = re.search(rf"^\| `{name}` \| ([^|]+) \|", OPERATIONS, re.M)
    assert row is not None, name
    default = source_default(name)
    if default in ([], ""):
        expected = "empty"
    elif isinstance(default, bool):
        expected = f"`{str(default).lower()}`"
    else:
        expected = f"`{default}`"
    assert row.group(1).startswith(expected), (name, row.group(1))


def test_env_example_explains_the_context_window() -> None:
    lines = (ROOT / ".env.example").read_text().splitlines()
    index = lines.index("CHAT_MODEL_CONTEXT_TOKENS=128000")
    assert lines[index - 1].startswith("#") and "window" in lines[index - 1] + lines[index - 2]


# --- docs/design.md: the map ----------------------------------------------------------------------


def test_the_design_map_names_every_module_of_the_apps() -> None:
    design = (ROOT / "docs" / "design.md").read_text()
    the_map = design.split("## Map", 1)[1].split("\n## ", 1)[0]
    modules = [
        path
        for app in ("conversations", "memory_worker")
        for path in (ROOT / app).rglob("*.py")
        if "migrations" not in path.parts and path.stem not in ("__init__", "apps")
    ]
    unnamed = [
        str(p.relative_to(ROOT)) for p in modules if not re.search(rf"\b{p.stem}\b", the_map)
    ]
    assert unnamed == []
