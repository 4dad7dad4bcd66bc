"""The summarizer failing on 30 % of calls (429, 500, timeouts, truncated, empty, refused):
no bad summary is ever written, attempts stay bounded, and every chat converges once the faults
stop. The fold service is driven directly, as a worker would."""

import pytest

from conversations.models import Brief, Consolidation
from memory_worker.coordination.dispatch import RequestReason
from memory_worker.folding.execute import fold_once
from memory_worker.summaries.validation import validate_summary
from tests.support.invariants import chat_violations

pytestmark = pytest.mark.django_db

FAULTS = ["429", "500", "timeout", "truncated", "empty", "refusal"]


def test_thirty_percent_summarizer_faults(api, use_fake_openai, settings) -> None:  # type: ignore[no-untyped-def]
    settings.MEMORY_LLM_TIMEOUT_SECONDS = 0.5
    settings.MEMORY_FAILURE_BACKOFF_SECONDS = 0  # let every trigger retry at once here
    settings.MEMORY_INVALID_OUTPUT_RETRY_SECONDS = 0
    use_fake_openai.timeout_sleep = 1.0
    use_fake_openai.set_faults("summarize", 0.3, FAULTS, seed=11)
    chat_ids = [
        api.post("/api/v1/chats/", {"policy": "contract"}, format="json").json()["id"]
        for _ in range(4)
    ]
    committed: list[str] = []
    for number in range(30):
        for chat_id in chat_ids:
            response = api.post(
                f"/api/v1/chats/{chat_id}/turns/",
                {"content": f"chat {chat_id} decided option {number}."},
                format="json",
            )
            # A synchronous fold may hit a fault: then the turn is refused (503), never stored.
            assert response.status_code in (201, 503), response.content
            outcome = fold_once(chat_id, RequestReason.TURN)
            if outcome.status == "succeeded":
                committed.append(Brief.objects.get(chat_id=chat_id).summary)
    counters = use_fake_openai.counters()
    assert counters["faults"], "the run injected no fault"
    failed = Consolidation.objects.filter(status="failed").count()
    assert failed > 0
    # Attempts are bounded: one summarizer call per fold attempt (plus at most one stricter
    # retry), and one attempt per trigger.
    assert len(use_fake_openai.summarize_requests()) <= 2 * Consolidation.objects.count()
    use_fake_openai.clear_faults()
    for chat_id in chat_ids:
        for _ in range(10):
            if fold_once(chat_id, RequestReason.TURN).status == "nothing":
                break
        brief = Brief.objects.get(chat_id=chat_id)
        assert not brief.degraded and brief.consecutive_failures == 0
        assert chat_violations(chat_id) == []
        committed.append(brief.summary)
    for summary in committed:  # every summary ever written passes the summarizer contract
        assert validate_summary(summary, "stop", settings.MEMORY_SUMMARY_TOKEN_CAP, None) == summary
