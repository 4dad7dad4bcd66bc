"""What the docs audit found: the documentation and the published schema say what the code does
(start-up warnings, knob bounds, check ids, commands, defaults)."""

from __future__ import annotations

import ast
import logging
import math
import re
from pathlib import Path
from typing import Any

import pytest
from django.core.exceptions import ImproperlyConfigured
from rest_framework.test import APIClient

ROOT = Path(__file__).resolve().parent.parent
README = (ROOT / "README.md").read_text()
OPERATIONS = (ROOT / "docs" / "operations.md").read_text()
POLICIES = (ROOT / "docs" / "policies.md").read_text()


# --- 1. chatmem.W001 reaches the servers' logs ---------------------------------------------------


def test_start_up_logs_check_warnings_and_still_refuses_errors(
    settings: Any, caplog: pytest.LogCaptureFixture, monkeypatch: pytest.MonkeyPatch
) -> None:
    from chatmem_project import boot

    monkeypatch.setattr(boot, "check_secret_key", list)  # not what this test is about
    settings.CHAT_MODEL_CONTEXT_TOKENS = 600  # the defaults leave a new chat no room
    with caplog.at_level(logging.WARNING, logger="chatmem.boot"):
        boot.refuse_misconfigured_start()  # a warning: the process starts
    warnings = [r for r in caplog.records if r.levelno == logging.WARNING]
    assert any("chatmem.W001" in record.getMessage() for record in warnings), caplog.text

    settings.MEMORY_POLICY = "no-such-preset"
    with pytest.raises(ImproperlyConfigured, match=r"chatmem\.E003"):
        boot.refuse_misconfigured_start()


# --- 2. The published knob bounds are the validator's ------------------------------------------


@pytest.fixture(scope="module")
def knob_schemas(django_db_blocker: Any) -> dict[str, dict[str, Any]]:
    with django_db_blocker.unblock():
        response = APIClient().get("/api/v1/schema/?format=json")
    assert response.status_code == 200
    schema = response.json()
    overrides = schema["components"]["schemas"]["ChatRequest"]["properties"]["policy_overrides"]
    return dict(overrides["properties"])


def test_knob_schema_bounds_are_the_validators(knob_schemas: dict[str, dict[str, Any]]) -> None:
    from memory_worker.presets import MAX_KNOB, PolicyError, _coerce, knob_names

    assert set(knob_schemas) == set(knob_names())
    assert knob_schemas["summary_token_cap"]["minimum"] == 64
    assert knob_schemas["summary_token_cap"]["maximum"] == 8000
    for name, schema in knob_schemas.items():
        if name == "token_budget_fraction":  # (0, 1], checked by resolve_policy
            assert schema["minimum"] == 0 and schema["exclusiveMinimum"] is True
            assert schema["maximum"] == 1
            continue
        low, high = schema["minimum"], schema["maximum"]
        assert high <= MAX_KNOB, name
        step = 1 if schema["type"] == "integer" else 0.5
        assert _coerce(name, low) == low and _coerce(name, high) == high, name
        for outside in (low - step, high + step):
            with pytest.raises(PolicyError):
                _coerce(name, outside)


@pytest.mark.django_db
def test_the_api_refuses_a_knob_just_outside_the_published_bounds(
    api: APIClient, knob_schemas: dict[str, dict[str, Any]]
) -> None:
    for name, schema in knob_schemas.items():
        if name == "token_budget_fraction":
            continue
        step = 1 if schema["type"] == "integer" else 0.5
        for outside in (schema["minimum"] - step, schema["maximum"] + step):
            body = {"policy": "sliding-window", "policy_overrides": {name: outside}}
            response = api.post("/api/v1/chats/", body, format="json")
            assert response.status_code == 400, (name, outside, response.content)


def test_the_schema_documents_a_turns_413(django_db_blocker: Any) -> None:
    with django_db_blocker.unblock():
        schema = APIClient().get("/api/v1/schema/?format=json").json()
    assert "413" in schema["paths"]["/api/v1/chats/{id}/turns/"]["post"]["responses"]


# --- Commands and install lines ----------------------------------------------------------------


def test_readme_names_every_option_of_the_chat_command() -> None:
    from conversations.management.commands.chat import Command

    parser = Command().create_parser("manage.py", "chat")
    options = {o for action in parser._actions for o in action.option_strings}
    own = {"--chat", "--policy", "--user"} & options
    assert own == {"--chat", "--policy", "--user"}
    usage = re.search(r"`python manage\.py chat ([^`]*)`", README)
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


# --- Responses ---------------------------------------------------------------------------------


def test_readme_says_the_page_size_maximum_and_every_plain_json_stream_refusal() -> None:
    from conversations.api.pagination import StandardPagination

    row = next(line for line in README.splitlines() if "/messages/` |" in line)
    assert f"at most {StandardPagination.max_page_size}" in row
    refusals = README[README.index("Refusals (") : README.index("before the stream starts")]
    for status in ("400", "404", "409", "413", "429"):
        assert status in refusals, status


# --- docs/operations.md ------------------------------------------------------------------------


def test_operations_lists_every_check_id_the_code_defines() -> None:
    defined = set()
    for path in [*ROOT.glob("*/checks.py"), ROOT / "chatmem_project" / "boot.py"]:
        defined |= set(re.findall(r'id="(chatmem\.[EWI]\d{3})"', path.read_text()))
    assert {"chatmem.E001", "chatmem.E003", "chatmem.E004", "chatmem.W001"} <= defined
    for check_id in defined:
        assert f"| `{check_id}` |" in OPERATIONS, check_id


def test_operations_files_non_positive_web_limits_under_e007() -> None:
    from conversations.checks import NON_NEGATIVE_WEB_SETTINGS, POSITIVE_WEB_SETTINGS

    row = next(line for line in OPERATIONS.splitlines() if line.startswith("| `chatmem.E007`"))
    for name in (*POSITIVE_WEB_SETTINGS, *NON_NEGATIVE_WEB_SETTINGS):
        assert f"`{name}`" in row, name


def test_the_documented_secret_key_command_passes_the_deploy_check() -> None:
    from chatmem_project.boot import MIN_SECRET_KEY_LENGTH

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


def test_compose_waits_for_the_real_postgres_server_not_the_first_boot_one() -> None:
    compose = (ROOT / "docker-compose.yml").read_text()
    probe = re.search(r"pg_isready[^\"\]]*", compose)
    assert probe is not None and "-h 127.0.0.1" in probe.group(0)


UNDOCUMENTED = (
    "CHAT_MODEL_CONTEXT_TOKENS",
    "CSRF_TRUSTED_ORIGINS",
    "DB_CONNECT_TIMEOUT",
    "LOG_LEVEL",
    "SECURE_HSTS_INCLUDE_SUBDOMAINS",
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
