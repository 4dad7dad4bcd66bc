"""Chats, auth, isolation and bad input through the REST API."""

import json

import pytest
from rest_framework.authtoken.models import Token

from conversations.models import Brief, Chat, Consolidation, Message

pytestmark = pytest.mark.django_db


def create_chat(api, **body):  # type: ignore[no-untyped-def]
    response = api.post("/api/v1/chats/", body, format="json")
    assert response.status_code == 201, response.content
    return response.json()


def test_create_chat_defaults_and_echoes_policy(api, settings) -> None:  # type: ignore[no-untyped-def]
    chat = create_chat(api, title="trip")
    assert chat["title"] == "trip"
    assert chat["policy"] == settings.MEMORY_POLICY == "sliding-window"
    assert chat["policy_overrides"] == {}
    assert chat["effective_policy"]["name"] == "sliding-window"
    assert chat["system_prompt"] == settings.CHATMEM_DEFAULT_SYSTEM_PROMPT
    assert Brief.objects.filter(chat_id=chat["id"], last_consolidated=0, version=0).exists()


def test_list_detail_delete(api) -> None:  # type: ignore[no-untyped-def]
    first = create_chat(api, title="a")
    second = create_chat(api, title="b")
    listing = api.get("/api/v1/chats/").json()
    assert listing["count"] == 2
    assert [c["id"] for c in listing["results"]] == [second["id"], first["id"]]
    assert api.get(f"/api/v1/chats/{first['id']}/").json()["title"] == "a"
    assert api.delete(f"/api/v1/chats/{first['id']}/").status_code == 204
    assert api.get(f"/api/v1/chats/{first['id']}/").status_code == 404
    assert not Brief.objects.filter(chat_id=first["id"]).exists()


def test_unauthenticated_is_401_with_www_authenticate(client) -> None:  # type: ignore[no-untyped-def]
    response = client.get("/api/v1/chats/")
    assert response.status_code == 401
    assert response["WWW-Authenticate"] == "Token"
    assert response.json()["code"] == "not_authenticated"


def test_wrong_token_is_401(db, client) -> None:  # type: ignore[no-untyped-def]
    response = client.get("/api/v1/chats/", HTTP_AUTHORIZATION="Token nope")
    assert response.status_code == 401
    assert "Invalid token" in response.json()["detail"]


def test_the_rest_api_takes_its_token_as_bearer_too_as_v1_does(db, client, user) -> None:  # type: ignore[no-untyped-def]
    """An OpenAI-SDK user's header works on the REST API: one token, one header, both APIs."""
    key = Token.objects.create(user=user).key
    for scheme in ("Token", "Bearer", "bearer"):
        response = client.get("/api/v1/chats/", HTTP_AUTHORIZATION=f"{scheme} {key}")
        assert response.status_code == 200, (scheme, response.content)
    wrong = client.get("/api/v1/chats/", HTTP_AUTHORIZATION="Bearer nope")
    assert wrong.status_code == 401 and "Invalid token" in wrong.json()["detail"]
    assert client.get("/v1/models", HTTP_AUTHORIZATION=f"Bearer {key}").status_code == 200


def test_inactive_users_token_is_401(api, user) -> None:  # type: ignore[no-untyped-def]
    assert api.get("/api/v1/chats/").status_code == 200
    user.is_active = False
    user.save(update_fields=["is_active"])
    response = api.get("/api/v1/chats/")
    assert response.status_code == 401
    assert response.json()["detail"] == "User inactive or deleted."


def test_token_lookup_matches_the_orms(user) -> None:  # type: ignore[no-untyped-def]
    """The plain-SQL lookup (conversations.authentication) yields what DRF's ORM lookup does:
    the same user with every field, and the token with its user attached."""
    from django.forms.models import model_to_dict
    from rest_framework.authtoken.models import Token

    from conversations.authentication import TokenAuthentication

    stored = Token.objects.create(user=user)
    found_user, found_token = TokenAuthentication().authenticate_credentials(stored.key)
    expected = Token.objects.select_related("user").get(key=stored.key)
    assert model_to_dict(found_user) == model_to_dict(expected.user)
    assert found_user.date_joined == expected.user.date_joined  # an aware datetime either way
    assert (found_token.key, found_token.created) == (expected.key, expected.created)
    assert found_token.user is found_user


@pytest.mark.parametrize(
    ("body", "field"),
    [
        ({"policy": "no-such-policy"}, "policy"),
        ({"title": 5}, "title"),
        ({"title": "x" * 201}, "title"),
        ({"system_prompt": ["a"]}, "system_prompt"),
        ({"policy_overrides": "big"}, "policy_overrides"),
        ({"policy_overrides": {"no_such_knob": 1}}, "policy_overrides"),
        ({"model_variant": "nope"}, "model_variant"),
    ],
)
def test_bad_chat_input_is_400_and_stores_nothing(api, body, field) -> None:  # type: ignore[no-untyped-def]
    response = api.post("/api/v1/chats/", body, format="json")
    assert response.status_code == 400, response.content
    assert field in response.json()
    assert Chat.objects.count() == 0


def test_malformed_json_is_400(api) -> None:  # type: ignore[no-untyped-def]
    response = api.post("/api/v1/chats/", "{not json", content_type="application/json")
    assert response.status_code == 400
    assert response.json()["code"] == "parse_error"
    assert Chat.objects.count() == 0


def test_policies_endpoint_lists_every_preset_with_what_it_is_for(api) -> None:  # type: ignore[no-untyped-def]
    listed = api.get("/api/v1/policies/").json()["results"]
    names = [p["name"] for p in listed]
    assert names == sorted(["contract", "sliding-window", "token-budget", "chunked", "turn-digest"])
    assert all(p["description"].endswith(".") and len(p["description"]) > 40 for p in listed)


def test_policies_endpoint_shows_the_operators_environment_knobs(api, settings) -> None:  # type: ignore[no-untyped-def]
    """It listed the presets as shipped while chats got them with MEMORY_CONTEXT_SIZE & co."""
    settings.MEMORY_PRESET_ENV_OVERRIDES = {"sliding-window": {"context_size": 100, "window": 8}}
    listed = {p["name"]: p["parameters"] for p in api.get("/api/v1/policies/").json()["results"]}
    window = listed["sliding-window"]
    assert (window["context_size"], window["window"]) == (100, 8)
    chat = api.post("/api/v1/chats/", {"policy": "sliding-window"}, format="json").json()
    assert api.get(f"/api/v1/chats/{chat['id']}/").json()["effective_policy"] == window


@pytest.mark.parametrize(
    "content",
    ["", "   \n\t ", 42, None, ["hi"], {"text": "hi"}, True, "x" * 32001],
)
def test_bad_turn_content_is_400_and_stores_nothing(api, content) -> None:  # type: ignore[no-untyped-def]
    chat = create_chat(api)
    response = api.post(f"/api/v1/chats/{chat['id']}/turns/", {"content": content}, format="json")
    assert response.status_code == 400, response.content
    assert "content" in response.json()
    assert Message.objects.count() == 0
    assert Chat.objects.get(pk=chat["id"]).last_seq == 0


def test_missing_content_and_malformed_turn_json(api) -> None:  # type: ignore[no-untyped-def]
    chat = create_chat(api)
    url = f"/api/v1/chats/{chat['id']}/turns/"
    missing = api.post(url, {}, format="json")
    assert missing.status_code == 400
    assert missing.json()["content"] == ["This field is required."]
    broken = api.post(url, '{"content": ', content_type="application/json")
    assert broken.status_code == 400
    unknown_variant = api.post(url, {"content": "hi", "model_variant": "x"}, format="json")
    assert unknown_variant.status_code == 400
    assert "model_variant" in unknown_variant.json()
    assert Message.objects.count() == 0


@pytest.mark.parametrize("stream", [0, 1, "true", "yes", None])
def test_stream_must_be_true_or_false(api, stream) -> None:  # type: ignore[no-untyped-def]
    """As the schema says: DRF's BooleanField took 0 and "yes" for false and true."""
    chat = create_chat(api)
    body = {"content": "hi", "stream": stream}
    response = api.post(f"/api/v1/chats/{chat['id']}/turns/", body, format="json")
    assert response.status_code == 400, response.content
    assert "stream" in response.json()
    assert Message.objects.count() == 0


def test_message_size_limit_is_configurable(api, settings) -> None:  # type: ignore[no-untyped-def]
    settings.CHATMEM_MAX_MESSAGE_CHARS = 10
    chat = create_chat(api)
    url = f"/api/v1/chats/{chat['id']}/turns/"
    response = api.post(url, {"content": "x" * 11}, format="json")
    assert response.status_code == 400
    assert "limit is 10" in response.json()["content"][0]
    assert api.post(url, {"content": "x" * 10}, format="json").status_code == 201


def id_bearing_routes() -> list[tuple[str, str]]:
    """Every (method, path template) of the API that names a chat, read from the router, so an
    endpoint added later is covered without editing this test."""
    from conversations.api.urls import router

    routes: list[tuple[str, str]] = []
    for pattern in router.urls:
        template = str(pattern.pattern)
        actions = getattr(pattern.callback, "actions", {})
        if "<pk>" not in template and "(?P<pk>" not in template:
            continue
        if "format" in template:
            continue
        path = template.strip("^$").replace("(?P<pk>[^/.]+)", "{id}")
        # DRF adds "head" beside "get" once a route has served a GET; replay the real methods.
        routes.extend((method, "/api/v1/" + path) for method in actions if method != "head")
    return routes


def test_another_users_chat_is_404_everywhere(api, other_api) -> None:  # type: ignore[no-untyped-def]
    chat = create_chat(api, title="private")
    assert (
        api.post(f"/api/v1/chats/{chat['id']}/turns/", {"content": "hi"}, format="json").status_code
        == 201
    )
    routes = id_bearing_routes()
    assert {"get", "delete", "post"} <= {method for method, _ in routes}
    assert len(routes) >= 9  # detail, delete, turns, messages, brief, context, notes, ...
    # The second user replays every id-bearing request of the first, with a valid body.
    for method, template in routes:
        url = template.format(id=chat["id"])
        response = getattr(other_api, method)(url, {"content": "hello"}, format="json")
        assert response.status_code == 404, (method, url, response.status_code)
        assert response.json()["code"] == "not_found"
    assert other_api.get("/api/v1/chats/").json()["count"] == 0
    assert Chat.objects.filter(pk=chat["id"]).exists()
    assert Message.objects.filter(chat_id=chat["id"]).count() == 2


def spellings_int_also_reads(pk: int) -> list[str]:
    digits = str(pk)
    return [
        "".join(chr(0xFF10 + int(d)) for d in digits),  # fullwidth
        "".join(chr(0x0660 + int(d)) for d in digits),  # Arabic-Indic
        f"+{digits}",
        f"%20{digits}",
        f"{digits}%20",
        f"{digits[:1]}_{digits[1:]}" if len(digits) > 1 else f"0_{digits}",
    ]


@pytest.mark.parametrize("suffix", ["", "brief/", "messages/", "consolidations/"])
def test_only_plain_ascii_digits_name_a_chat_in_the_path(api, suffix) -> None:  # type: ignore[no-untyped-def]
    pk = create_chat(api)["id"]
    assert api.get(f"/api/v1/chats/{pk}/{suffix}").status_code == 200
    for spelling in spellings_int_also_reads(pk):
        response = api.get(f"/api/v1/chats/{spelling}/{suffix}")
        assert response.status_code == 404, (spelling, response.status_code)
        assert response.json()["code"] == "not_found"  # DRF's shape, as any other 404
    turn = api.post(f"/api/v1/chats/+{pk}/turns/", {"content": "hi"}, format="json")
    assert turn.status_code == 404
    assert not Message.objects.filter(chat_id=pk).exists()


def test_health_endpoints_need_no_auth(client, db) -> None:  # type: ignore[no-untyped-def]
    assert client.get("/healthz").json() == {"status": "ok"}
    ready = client.get("/readyz")
    assert ready.status_code == 200
    assert json.loads(ready.content)["database"] == "ok"


def test_a_chat_whose_overrides_clash_with_knobs_changed_since_keeps_working(api, settings) -> None:  # type: ignore[no-untyped-def]
    """Valid when saved; the operator then lowered the context below the chat's own tail. The
    user's whole chat list, the chat, its brief and its turns were 500s: the chat's own
    overrides now win over the knobs they clash with."""
    chat = api.post(
        "/api/v1/chats/",
        {"policy": "sliding-window", "policy_overrides": {"tail_messages": 50}},
        format="json",
    ).json()
    settings.MEMORY_PRESET_ENV_OVERRIDES = {
        "sliding-window": {"context_size": 45, "tail_messages": 20, "hard_limit": 20}
    }
    assert api.get("/api/v1/chats/").status_code == 200
    detail = api.get(f"/api/v1/chats/{chat['id']}/")
    assert detail.status_code == 200
    effective = detail.json()["effective_policy"]
    assert (effective["tail_messages"], effective["context_size"]) == (50, 75)
    assert api.get(f"/api/v1/chats/{chat['id']}/brief/").status_code == 200
    turn = api.post(f"/api/v1/chats/{chat['id']}/turns/", {"content": "hi"}, format="json")
    assert turn.status_code == 201, turn.content
    # A chat without overrides gets the operator's knobs, as before.
    plain = api.post("/api/v1/chats/", {"policy": "sliding-window"}, format="json").json()
    assert plain["effective_policy"]["context_size"] == 45


def test_a_chat_whose_variant_was_removed_falls_back_to_the_default(api, settings) -> None:  # type: ignore[no-untyped-def]
    """Its turns were 400s about a model_variant the client never sent, and its brief a 500."""
    from conversations.variants import _parse_variants

    settings.MODEL_VARIANTS = "deep=gpt-deep:128000"
    _parse_variants.cache_clear()
    chat = api.post("/api/v1/chats/", {"model_variant": "deep"}, format="json").json()
    settings.MODEL_VARIANTS = ""
    _parse_variants.cache_clear()
    try:
        turn = api.post(f"/api/v1/chats/{chat['id']}/turns/", {"content": "hi"}, format="json")
        assert turn.status_code == 201, turn.content
        assert turn.json()["assistant_message"]["model_variant"] == "default"
        assert api.get(f"/api/v1/chats/{chat['id']}/brief/").status_code == 200
        asked = api.post(
            f"/api/v1/chats/{chat['id']}/turns/",
            {"content": "hi", "model_variant": "deep"},
            format="json",
        )
        assert asked.status_code == 400 and "model_variant" in asked.json()
    finally:
        _parse_variants.cache_clear()


@pytest.mark.parametrize(
    ("policy", "overrides", "words"),
    [
        ("chunked", {"chunk_threshold": 20000}, "chunk_threshold (20000) must be at most"),
        ("token-budget", {"fold_target_tokens": 3800}, "the fold target (3800 tokens)"),
        ("sliding-window", {"tail_messages": 70}, "tail_messages + window (70 + 12)"),
        ("contract", {"tail_messages": 8}, "less 2 message(s) of headroom (8)"),
    ],
)
def test_overrides_that_leave_every_fold_to_the_turn_are_refused(  # type: ignore[no-untyped-def]
    api, policy, overrides, words
) -> None:
    """Their background trigger could not fire with headroom below the hard bound: folds would
    run in turns, and a failed one would be that turn's 503."""
    response = api.post(
        "/api/v1/chats/", {"policy": policy, "policy_overrides": overrides}, format="json"
    )
    assert response.status_code == 400, response.content
    assert words in response.json()["policy_overrides"][0]
    assert Chat.objects.count() == 0


def test_raising_the_bound_with_the_trigger_is_accepted(api) -> None:  # type: ignore[no-untyped-def]
    overrides = {"chunk_threshold": 20000, "max_memory_tokens": 23000}
    response = api.post(
        "/api/v1/chats/", {"policy": "chunked", "policy_overrides": overrides}, format="json"
    )
    assert response.status_code == 201, response.content


def test_the_operators_own_knobs_are_not_refused_at_chat_creation(api, settings) -> None:  # type: ignore[no-untyped-def]
    """Set that way on purpose (a synchronous fold on every bound); chats are still created."""
    settings.MEMORY_PRESET_ENV_OVERRIDES = {"sliding-window": {"context_size": 50}}
    response = api.post("/api/v1/chats/", {"policy": "sliding-window"}, format="json")
    assert response.status_code == 201, response.content


@pytest.mark.parametrize(
    ("window", "body"),
    [
        (8192, {"policy_overrides": {"summary_token_cap": 7000}}),
        (4096, {"system_prompt": "Answer in the voice of a patient tutor. " * 400}),
    ],
    ids=["summary-cap", "system-prompt"],
)
def test_a_chat_with_no_room_left_in_its_models_window_is_refused(  # type: ignore[no-untyped-def]
    api, settings, window, body
) -> None:
    """Refused at creation: accepted, every turn of it that had to fold would be a 503 for
    good."""
    from conversations.variants import _parse_variants

    settings.CHAT_MODEL_CONTEXT_TOKENS = window
    _parse_variants.cache_clear()
    try:
        response = api.post("/api/v1/chats/", body, format="json")
        assert response.status_code == 400, response.content
        assert "left for the conversation" in response.json()["non_field_errors"][0]
        assert Chat.objects.count() == 0
        fine = api.post("/api/v1/chats/", {"system_prompt": "Be brief."}, format="json")
        assert fine.status_code == 201, fine.content
    finally:
        _parse_variants.cache_clear()


def test_no_room_in_the_window_is_a_400_on_v1_too(user, settings) -> None:  # type: ignore[no-untyped-def]
    """A new /v1 conversation's system messages leaving no room: a 400, not a 500."""
    from conversations.variants import _parse_variants
    from tests.test_bad_input import bearer

    settings.CHAT_MODEL_CONTEXT_TOKENS = 4096
    _parse_variants.cache_clear()
    try:
        system = {"role": "system", "content": "Answer in the voice of a patient tutor. " * 400}
        body = {
            "model": "default",
            "user": "tutor",
            "messages": [system, {"role": "user", "content": "hi"}],
        }
        response = bearer(user).post("/v1/chat/completions", body, format="json")
        assert response.status_code == 400, response.content
        error = response.json()["error"]
        assert error["param"] == "messages" and "left for the conversation" in error["message"]
        assert Chat.objects.count() == 0
    finally:
        _parse_variants.cache_clear()


def test_defaults_with_no_room_are_the_operators_warning_not_every_chats_400(api, settings) -> None:  # type: ignore[no-untyped-def]
    from django.core.checks import run_checks

    from conversations.variants import _parse_variants

    settings.CHAT_MODEL_CONTEXT_TOKENS = 4096
    settings.MEMORY_PRESET_ENV_OVERRIDES = {
        name: {"summary_token_cap": 3000} for name in ("sliding-window",)
    }
    _parse_variants.cache_clear()
    try:
        assert api.post("/api/v1/chats/", {}, format="json").status_code == 201
        assert "chatmem.W001" in [message.id for message in run_checks()]
    finally:
        _parse_variants.cache_clear()


def test_effective_policy_shows_the_thresholds_derived_below_each_bound(api) -> None:  # type: ignore[no-untyped-def]
    """token-budget's two knobs alone: the bound is max_tokens, the fold is due a turn's worth (the
    floor, 1/16 of the bound, for a chat with no turns yet) below it, and folds go down to the
    summary's reserve and an eighth of the rest."""
    chat = api.post(
        "/api/v1/chats/",
        {
            "policy": "token-budget",
            "policy_overrides": {"max_tokens": 4800, "max_summary_tokens": 480},
        },
        format="json",
    ).json()
    thresholds = api.get(f"/api/v1/chats/{chat['id']}/").json()["effective_policy"]["thresholds"]
    assert thresholds["token_bound"] == 4800
    assert thresholds["token_reserve"] == 4800 // 16
    assert thresholds["token_trigger"] == 4800 - 4800 // 16
    assert thresholds["fold_target"] == 500 + (4800 - 500) // 8
    listed = {p["name"]: p["parameters"] for p in api.get("/api/v1/policies/").json()["results"]}
    assert listed["contract"]["thresholds"]["message_trigger"] == 8  # K + B less one turn


def test_the_ledger_shows_what_each_fold_let_go(api) -> None:  # type: ignore[no-untyped-def]
    chat_id = api.post("/api/v1/chats/", {}, format="json").json()["id"]
    for details in (["QX-7719", "https://example.com/inv/88213"], []):
        Consolidation.objects.create(
            chat_id=chat_id,
            trigger="window",
            status="succeeded",
            from_seq=1,
            to_seq=2,
            base_version=0,
            dropped_details=details,
        )
    rows = api.get(f"/api/v1/chats/{chat_id}/consolidations/").json()["results"]
    assert [row["dropped_details"] for row in rows] == [
        [],
        ["QX-7719", "https://example.com/inv/88213"],
    ]


def test_a_manual_fold_with_nothing_to_fold_says_so_and_leaves_a_ledger_row(api) -> None:  # type: ignore[no-untyped-def]
    chat_id = api.post("/api/v1/chats/", {}, format="json").json()["id"]
    response = api.post(f"/api/v1/chats/{chat_id}/consolidate/")
    assert response.status_code == 200
    assert response.json()["status"] == "nothing_to_fold" and response.json()["queued"] is False
    assert response.json()["detail"] == (
        "Nothing to fold yet: the 0 unfolded messages are all in the verbatim tail this chat's "
        "policy (sliding-window) keeps (the newest 40 messages and 1 turn). A fold can take a "
        "message once newer messages push it out of that tail."
    )
    [row] = api.get(f"/api/v1/chats/{chat_id}/consolidations/").json()["results"]
    assert (row["status"], row["trigger"]) == ("nothing_to_fold", "manual")


def test_one_manual_fold_is_queued_per_chat_at_a_time(
    api, settings, clean_redis, monkeypatch
) -> None:  # type: ignore[no-untyped-def]
    """A request while one is queued and not started queues nothing; once the task starts (it
    clears the marker before reading), the next request queues one that sees what came since."""
    from memory_worker.coordination.dispatch import clear_manual_queued
    from tests.conftest import contract_chat_after_turns

    settings.REDIS_URL = clean_redis
    requested: list[int] = []

    def queue(chat_id: int, trigger: str) -> bool:
        requested.append(chat_id)
        return True

    monkeypatch.setattr("memory_worker.scheduling.manual.request_fold", queue)
    chat_id = contract_chat_after_turns(api, 4)  # a manual fold would fold 2
    answers = [api.post(f"/api/v1/chats/{chat_id}/consolidate/") for _ in range(3)]
    assert [a.status_code for a in answers] == [202, 202, 202]
    assert [a.json()["status"] for a in answers] == ["queued", "already_queued", "already_queued"]
    assert requested == [chat_id]
    clear_manual_queued(chat_id)  # the task started
    assert api.post(f"/api/v1/chats/{chat_id}/consolidate/").json()["status"] == "queued"
    assert requested == [chat_id, chat_id]


def test_manual_folds_are_throttled_per_user(api, settings, monkeypatch) -> None:  # type: ignore[no-untyped-def]
    settings.MEMORY_MANUAL_FOLD_RATE_LIMIT = "3/min"
    chat_id = api.post("/api/v1/chats/", {}, format="json").json()["id"]
    answers = [api.post(f"/api/v1/chats/{chat_id}/consolidate/") for _ in range(4)]
    assert [a.status_code for a in answers] == [200, 200, 200, 429]
    assert int(answers[-1]["Retry-After"]) > 0
    assert answers[-1].json()["code"] == "throttled"
    # Turns are counted apart.
    turn = api.post(f"/api/v1/chats/{chat_id}/turns/", {"content": "hi"}, format="json")
    assert turn.status_code == 201
