"""The OpenAPI schema (drf-spectacular): it generates and validates without a single warning,
documents every API route with its request, responses and errors, and is served with a Swagger
UI that needs no CDN."""

import os
import re
import subprocess
import sys
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest
import yaml
from django.core.management import call_command
from django.urls import URLPattern, URLResolver, get_resolver
from rest_framework.test import APIClient

from memory_worker.engine.presets import MAX_KNOB, PolicyError, _coerce, knob_names
from tests.test_bad_input import bearer

API_PREFIX = "/api/v1/"
NOT_DOCUMENTED = {"/api/v1/", "/api/v1/schema/", "/api/v1/docs/"}  # API root, the schema itself
HTTP_METHODS = {"get", "post", "put", "patch", "delete"}


@pytest.fixture(scope="module")
def schema(tmp_path_factory: pytest.TempPathFactory) -> dict:
    # --fail-on-warn: an endpoint spectacular cannot describe (a guessed type, an unresolvable
    # serializer) is a failure here, not a silent "string" in the published schema.
    path = tmp_path_factory.mktemp("openapi") / "schema.yaml"
    call_command("spectacular", "--validate", "--fail-on-warn", "--file", str(path))
    return yaml.safe_load(Path(path).read_text())


def api_routes() -> Iterator[tuple[str, set[str]]]:
    """(OpenAPI path, HTTP methods) of every API URL pattern, read from the URLconf itself."""

    def walk(patterns: list, prefix: str) -> Iterator[tuple[str, object]]:
        for pattern in patterns:
            route = prefix + str(pattern.pattern).lstrip("^").rstrip("$").replace("\\Z", "")
            if isinstance(pattern, URLResolver):
                yield from walk(pattern.url_patterns, route)
            elif isinstance(pattern, URLPattern):
                yield route, pattern.callback

    for route, callback in walk(get_resolver().url_patterns, "/"):
        path = re.sub(r"\(\?P<pk>[^)]*\)", "{id}", route)
        path = re.sub(r"\(\?P<(\w+)>[^)]*\)", r"{\1}", path)  # a sub-resource's id
        if not path.startswith(API_PREFIX) or "format" in path or path in NOT_DOCUMENTED:
            continue
        actions = getattr(callback, "actions", None)  # a viewset route: method -> action
        if actions:
            methods = set(actions) - {"head", "options"}  # DRF adds head once served
        else:
            view_class = callback.view_class  # type: ignore[attr-defined]
            methods = {m for m in HTTP_METHODS if hasattr(view_class, m)}
        yield path, methods


def test_every_api_route_is_in_the_schema(schema: dict) -> None:
    routes = dict(api_routes())
    assert "/api/v1/chats/{id}/turns/" in routes  # the walk itself finds the API
    assert len(routes) >= 9
    for path, methods in routes.items():
        assert path in schema["paths"], path
        assert set(schema["paths"][path]) >= methods, path


def test_every_operation_has_a_success_body_and_its_errors(schema: dict) -> None:
    for path, operations in schema["paths"].items():
        for method, operation in operations.items():
            if method not in HTTP_METHODS:
                continue
            where = f"{method.upper()} {path}"
            responses = operation["responses"]
            success = [code for code in responses if code.startswith("2")]
            assert success, where
            if method != "delete":
                assert any("content" in responses[code] for code in success), where
            assert "401" in responses, where
            if "{id}" in path:
                assert "404" in responses, where
            assert operation.get("summary") or operation.get("description"), where
            assert operation["security"], where


def test_turns_documents_json_and_event_stream(schema: dict) -> None:
    operation = schema["paths"]["/api/v1/chats/{id}/turns/"]["post"]
    body = operation["requestBody"]["content"]["application/json"]["schema"]["$ref"]
    request = schema["components"]["schemas"][body.rsplit("/", 1)[1]]
    assert set(request["properties"]) >= {"content", "model_variant", "stream"}
    assert request["required"] == ["content"]
    responses = operation["responses"]
    assert responses["201"]["content"]["application/json"]["schema"]["$ref"].endswith(
        "/TurnResponse"
    )
    stream = responses["200"]["content"]["text/event-stream"]
    assert "event: accepted" in next(iter(stream["examples"].values()))["value"]
    for event in ("accepted", "delta", "done", "error"):
        assert f"`event: {event}`" in responses["200"]["description"]
    for code in ("400", "401", "404", "409", "429", "502", "503", "504"):
        assert code in responses, code  # 429: the turn limit is on by default
    turn = schema["components"]["schemas"]["TurnResponse"]["properties"]
    assert set(turn) == {"user_message", "assistant_message"}
    message = schema["components"]["schemas"]["Message"]["properties"]
    assert {"seq", "role", "content", "token_count", "created_at"} <= set(message)


def test_list_endpoints_are_paginated(schema: dict) -> None:
    for path in ("/api/v1/chats/", "/api/v1/chats/{id}/messages/"):
        operation = schema["paths"][path]["get"]
        ref = operation["responses"]["200"]["content"]["application/json"]["schema"]["$ref"]
        page = schema["components"]["schemas"][ref.rsplit("/", 1)[1]]
        assert {"count", "next", "previous", "results"} <= set(page["properties"]), path
        assert "page" in {p["name"] for p in operation["parameters"]}, path
    messages = schema["paths"]["/api/v1/chats/{id}/messages/"]["get"]
    assert "after_seq" in {p["name"] for p in messages["parameters"]}


@pytest.mark.django_db
def test_schema_and_docs_are_served_without_a_cdn() -> None:
    client = APIClient()
    default = client.get("/api/v1/schema/")
    assert default.status_code == 200
    assert yaml.safe_load(default.content)["info"]["title"] == "chatmem API"
    response = client.get("/api/v1/schema/?format=json")
    assert response.status_code == 200
    assert response.json()["openapi"].startswith("3.")
    assert "/api/v1/chats/{id}/turns/" in response.json()["paths"]
    docs = client.get("/api/v1/docs/")
    assert docs.status_code == 200
    html = docs.content.decode()
    assert "swagger-ui" in html
    assert "drf_spectacular_sidecar/swagger-ui-dist" in html
    assert "cdn.jsdelivr.net" not in html and "unpkg.com" not in html


def test_the_context_schema_has_the_tool_fields_the_endpoint_returns(schema: dict) -> None:
    """conversations.services.context.model_message adds them to tool traffic."""
    message = schema["components"]["schemas"]["ContextMessage"]
    assert {"tool_calls", "tool_call_id", "name"} <= set(message["properties"])
    assert set(message["required"]) == {"role", "content"}


# --- the published knob bounds are the validator's ------------------------------------------------


@pytest.fixture(scope="module")
def knob_schemas(django_db_blocker: Any) -> dict[str, dict[str, Any]]:
    with django_db_blocker.unblock():
        response = APIClient().get("/api/v1/schema/?format=json")
    assert response.status_code == 200
    schema = response.json()
    overrides = schema["components"]["schemas"]["ChatRequest"]["properties"]["policy_overrides"]
    return dict(overrides["properties"])


def test_knob_schema_bounds_are_the_validators(knob_schemas: dict[str, dict[str, Any]]) -> None:
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


def test_the_schema_documents_gunicorns_414_on_every_operation(django_db_blocker: Any) -> None:
    """gunicorn answers a request line over its limit (a long query string, on any operation)
    with a JSON 414 (gunicorn.conf.write_json_error) before the application sees it."""
    with django_db_blocker.unblock():
        schema = APIClient().get("/api/v1/schema/?format=json").json()
    operations = [
        (path, method, operation)
        for path, item in schema["paths"].items()
        for method, operation in item.items()
        if method in ("get", "post", "patch", "put", "delete")
    ]
    assert operations
    for path, method, operation in operations:
        response = operation["responses"].get("414")
        assert response is not None, (path, method)
        body = response["content"]["application/json"]["schema"]
        assert body == {"$ref": "#/components/schemas/Error"}, (path, method)


# --- "Try it out": every request example works as it stands ---------------------------------------


def header_examples(operation: dict) -> dict[str, str]:
    """The headers Swagger UI fills in from the operation's examples, as test client extras."""
    headers = {}
    for parameter in operation.get("parameters", []):
        examples = [example["value"] for example in parameter.get("examples", {}).values()]
        if parameter["in"] == "header" and examples:
            headers["HTTP_" + parameter["name"].upper().replace("-", "_")] = examples[0]
    return headers


def request_examples(schema: dict) -> list[tuple[str, str, str, Any]]:
    """(method, path, example name, body) of every request body example in the schema."""
    found = []
    for path, operations in schema["paths"].items():
        for method, operation in operations.items():
            body = operation.get("requestBody", {}).get("content", {}).get("application/json")
            for name, example in (body or {}).get("examples", {}).items():
                found.append((method, path, name, example["value"]))
    return found


def test_every_operation_with_a_body_has_an_example(schema: dict) -> None:
    with_examples = {(method, path) for method, path, _, _ in request_examples(schema)}
    with_bodies = {
        (method, path)
        for path, operations in schema["paths"].items()
        for method, operation in operations.items()
        if "requestBody" in operation
    }
    assert len(with_bodies) >= 3
    assert with_bodies <= with_examples, with_bodies - with_examples


@pytest.mark.django_db(transaction=True)  # a streamed turn stores from its own thread
def test_every_request_example_succeeds_as_it_stands(
    schema: dict, api: APIClient, user: Any
) -> None:
    """What Swagger UI's "Try it out" sends unchanged (the first example) and every other
    example: each answers 2xx on a chat of the user's own (/v1/ with the token as Bearer)."""
    examples = request_examples(schema)
    assert {path for _, path, _, _ in examples} >= {
        "/api/v1/chats/",
        "/api/v1/chats/{id}/",
        "/api/v1/chats/{id}/turns/",
        "/v1/chat/completions",
    }
    openai = bearer(user)
    for method, path, name, body in examples:
        chat_id = api.post("/api/v1/chats/", {}, format="json").json()["id"]
        client = openai if path.startswith("/v1/") else api
        headers = header_examples(schema["paths"][path][method])
        response = getattr(client, method)(path.format(id=chat_id), body, format="json", **headers)
        answer = b"".join(response.streaming_content) if response.streaming else response.content
        assert 200 <= response.status_code < 300, (method, path, name, answer)
        if response.streaming:
            assert b"event: done" in answer, answer


def test_the_chat_list_documents_search_filters_and_ordering(schema: dict) -> None:
    parameters = {p["name"]: p for p in schema["paths"]["/api/v1/chats/"]["get"]["parameters"]}
    assert {"search", "policy", "degraded", "ordering", "page", "page_size"} <= set(parameters)
    assert "contract" in parameters["policy"]["schema"]["enum"]
    assert parameters["degraded"]["schema"]["enum"] == ["true", "false"]
    pattern = re.compile(parameters["ordering"]["schema"]["pattern"])
    for good in ("", "title", "-updated_at", "title,-created_at,id"):
        assert pattern.match(good), good
    for bad in ("updated", "last_seq", "title,", "--title"):
        assert not pattern.match(bad), bad


def test_a_chat_is_changed_by_patch_and_put_is_not_offered(schema: dict) -> None:
    detail = schema["paths"]["/api/v1/chats/{id}/"]
    assert "put" not in detail
    patch = detail["patch"]
    assert {"200", "400", "401", "404"} <= set(patch["responses"])
    ref = patch["requestBody"]["content"]["application/json"]["schema"]["$ref"]
    body = schema["components"]["schemas"][ref.rsplit("/", 1)[1]]
    assert set(body["properties"]) == {
        "title",
        "system_prompt",
        "policy",
        "policy_overrides",
        "model_variant",
        "folds_paused",
    }
    assert body["additionalProperties"] is False
    assert body["properties"]["policy_overrides"]["additionalProperties"] is False
    assert "required" not in body


def test_the_openai_compatible_api_is_documented_in_its_own_shapes(schema: dict) -> None:
    completions = schema["paths"]["/v1/chat/completions"]["post"]
    models = schema["paths"]["/v1/models"]["get"]
    for operation in (completions, models):
        assert operation["security"] == [{"bearerAuth": []}]
        unauthenticated = operation["responses"]["401"]["content"]["application/json"]["schema"]
        assert unauthenticated["required"] == ["error"]  # OpenAI's error shape, not DRF's
    assert schema["components"]["securitySchemes"]["bearerAuth"]["scheme"] == "bearer"
    body = completions["requestBody"]["content"]["application/json"]
    assert body["schema"]["required"] == ["model", "messages"]
    assert set(completions["responses"]["200"]["content"]) == {
        "application/json",
        "text/event-stream",
    }
    assert "400" in completions["responses"]


def test_the_brief_edit_is_documented_with_its_headers_and_errors(schema: dict) -> None:
    brief = schema["paths"]["/api/v1/chats/{id}/brief/"]
    assert brief["get"]["responses"]["200"]["headers"]["ETag"]
    patch = brief["patch"]
    headers = {p["name"]: p for p in patch["parameters"] if p["in"] == "header"}
    assert headers["If-Match"]["required"] is True
    assert {"200", "400", "401", "404", "412", "428"} <= set(patch["responses"])
    ref = patch["requestBody"]["content"]["application/json"]["schema"]["$ref"]
    body = schema["components"]["schemas"][ref.rsplit("/", 1)[1]]
    assert set(body["properties"]) == {"summary"}


def test_the_v1_memory_controls_are_documented(schema: dict) -> None:
    completions = schema["paths"]["/v1/chat/completions"]["post"]
    request = completions["requestBody"]["content"]["application/json"]["schema"]
    controls = request["properties"]["chatmem"]
    assert set(controls["properties"]) == {"pin", "fold", "policy", "policy_overrides"}
    # null is listed, as OpenAPI 3.0 requires of a nullable enum: the view reads it as absent.
    assert controls["properties"]["fold"]["enum"] == ["now", "pause", "resume", None]
    assert controls["nullable"] and controls["properties"]["fold"]["nullable"]
    assert controls["additionalProperties"] is False
    answer = completions["responses"]["200"]["content"]["application/json"]["schema"]
    assert {"summary_version", "unfolded", "degraded"} <= set(
        answer["properties"]["chatmem"]["properties"]
    )


FIRST_SCHEMAS_AT_ONCE = """
import threading, django
django.setup()
from django.test import RequestFactory
from conversations.api.views import SchemaView
view, start, statuses = SchemaView.as_view(), threading.Barrier(8), []
def fetch():
    start.wait()
    statuses.append(view(RequestFactory().get("/api/v1/schema/?format=json")).status_code)
threads = [threading.Thread(target=fetch) for _ in range(8)]
for thread in threads: thread.start()
for thread in threads: thread.join()
print(sorted(statuses))
"""


def test_the_first_schema_requests_of_a_process_at_once_all_succeed() -> None:
    """A fresh process, as a gunicorn worker with threads is: drf-spectacular's first
    generation loads its extensions, which raced between threads (a 500 for one of them)."""
    result = subprocess.run(
        [sys.executable, "-c", FIRST_SCHEMAS_AT_ONCE],
        cwd=Path(__file__).resolve().parent.parent,
        env={**os.environ, "DJANGO_SETTINGS_MODULE": "chatmem_project.settings"},
        capture_output=True,
        text=True,
        timeout=120,
    )
    assert result.returncode == 0, result.stderr[-3000:]
    assert result.stdout.strip().splitlines()[-1] == str([200] * 8), result.stderr[-3000:]
