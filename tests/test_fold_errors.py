"""What a chat's owner is shown of a failed fold: the brief's last_error and the ledger's error
are the owner's to read (GET …/brief/, …/consolidations/), so they carry the provider's own
words only when it refused the request itself, never its account details (a rate limit naming
the operator's organisation, an authentication error echoing a key), and of a crash only the
error's kind. The operator's log keeps the rest, keys redacted."""

import logging
from typing import Any

import pytest

from conversations.chat_model.transport import SECRET_PATTERN
from conversations.models import Brief, Consolidation
from memory_worker.coordination.dispatch import RequestReason
from memory_worker.folding import execute as folds
from memory_worker.summaries.contract import SummarizerError
from tests.support.fake_openai import FakeOpenAI
from tests.test_summarizers import (
    TWO_TURNS,
    ScriptedServer,
    responses_reply,
    responses_summarizer,
    server_fixture,  # noqa: F401  (the "server" fixture)
)

pytestmark = pytest.mark.django_db

FOLD_DUE_TURNS = 26  # the default sliding-window preset has a fold due after these


def chat_with_a_fold_due(api: Any) -> int:
    chat_id = int(api.post("/api/v1/chats/", {}, format="json").json()["id"])
    for number in range(FOLD_DUE_TURNS):
        response = api.post(
            f"/api/v1/chats/{chat_id}/turns/", {"content": f"turn {number}"}, format="json"
        )
        assert response.status_code == 201
    return chat_id


def shown_to_owner(api: Any, chat_id: int) -> tuple[str, str]:
    brief = api.get(f"/api/v1/chats/{chat_id}/brief/").json()["last_error"]
    [row] = api.get(f"/api/v1/chats/{chat_id}/consolidations/").json()["results"]
    return brief, row["error"]


@pytest.mark.parametrize("fault", ["429", "insufficient_quota", "401"])
def test_the_providers_account_messages_stay_in_the_log(
    api: Any, use_fake_openai: FakeOpenAI, fault: str, caplog: pytest.LogCaptureFixture
) -> None:
    chat_id = chat_with_a_fold_due(api)
    use_fake_openai.queue_faults("summarize", [fault])
    with caplog.at_level(logging.WARNING, logger="memory_worker.summaries.contract"):
        assert folds.fold_once(chat_id, RequestReason.TURN).status == "failed"
    for shown in shown_to_owner(api, chat_id):
        assert "HTTP " in shown  # the status, so the owner knows the model failed
        assert "(fake)" not in shown  # every fake provider message ends so
    logged = [
        r.getMessage() for r in caplog.records if r.name == "memory_worker.summaries.contract"
    ]
    assert any("(fake)" in message for message in logged)
    assert not any("sk-test" in message for message in logged)  # the key, even masked


def test_a_request_the_provider_refused_says_why(api: Any, use_fake_openai: FakeOpenAI) -> None:
    chat_id = chat_with_a_fold_due(api)
    use_fake_openai.queue_faults("summarize", ["400"])
    assert folds.fold_once(chat_id, RequestReason.TURN).status == "failed"
    for shown in shown_to_owner(api, chat_id):
        assert "Invalid request (fake)." in shown


def test_a_crash_shows_the_owner_its_kind_only(api: Any, monkeypatch: Any) -> None:
    chat_id = chat_with_a_fold_due(api)

    class Crashing:
        def summarize(self, *args: Any, **kwargs: Any) -> Any:
            raise RuntimeError('connection to "db-internal.corp:5432" refused, user=svc_admin')

    monkeypatch.setattr(folds, "get_summarizer", lambda *args: Crashing())
    with pytest.raises(RuntimeError):
        folds.fold_once(chat_id, RequestReason.TURN)
    brief = Brief.objects.get(chat_id=chat_id)
    ledger = Consolidation.objects.get(chat_id=chat_id)
    for shown in (brief.last_error, ledger.error):
        assert shown.startswith("RuntimeError")
        assert "db-internal" not in shown


@pytest.mark.parametrize(
    "key",
    [
        "sk-proj-abcdef123456",
        "gsk_LIVEKEY0123456789abcdef",
        "xai-0123456789abcdef",
        "AIzaSyA-0123456789abcdefghijklmnop",
    ],
)
def test_key_shaped_strings_are_redacted(key: str) -> None:
    assert SECRET_PATTERN.sub("[redacted]", f"Incorrect API key provided: {key}.") == (
        "Incorrect API key provided: [redacted]."
    )


def test_a_failed_response_shows_its_code_only(
    server: ScriptedServer, caplog: pytest.LogCaptureFixture
) -> None:
    """A Responses backend's failed status carries the provider's words (a rate limit names the
    operator's organisation): the error the chat's owner reads keeps its code only, the log the
    words."""
    failed = responses_reply(None, status="failed")
    assert failed.body is not None
    failed.body["error"] = {
        "code": "rate_limit_exceeded",
        "message": "Rate limit reached for gpt-5-nano in organization org-SECRET123.",
    }
    server.script(failed)
    with (
        caplog.at_level(logging.WARNING, logger="memory_worker.summaries.contract"),
        pytest.raises(SummarizerError) as caught,
    ):
        responses_summarizer(server).summarize("", TWO_TURNS)
    assert str(caught.value) == "summarizer response failed: rate_limit_exceeded"
    assert caught.value.kind == "rate_limit"
    assert any("org-SECRET123" in record.getMessage() for record in caplog.records)
