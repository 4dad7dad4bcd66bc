"""The documentation says what the code does: README's commands, install lines and responses;
docs/operations.md's check ids, settings and their defaults; .env.example's explanations."""

from __future__ import annotations

import ast
import math
import re
from pathlib import Path

import pytest

from chatmem_project.boot import MIN_SECRET_KEY_LENGTH
from conversations.api.pagination import StandardPagination
from conversations.checks import NON_NEGATIVE_WEB_SETTINGS, POSITIVE_WEB_SETTINGS
from conversations.management.commands.chat import Command

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
    source = (ROOT / "chatmem_project" / "settings.py").read_text()
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
