"""The retry policy of failed folds (docs/design.md, the fold): transient model errors are retried
with exponential backoff and jitter, by the worker itself until the chat is degraded; an exhausted
quota, other rejected requests and unusable output are never retried fast. Every failure counts on
the brief, concurrent failures of the same version each. The summarizer's client never retries on
its own: our code owns retries and deadlines."""

import typing
from datetime import timedelta

import pytest
from django.utils import timezone

from conversations.models import Brief, Consolidation
from memory_worker import tasks
from memory_worker.coordination.dispatch import RequestReason
from memory_worker.folding import execute as folds
from memory_worker.folding import outcomes, retries
from memory_worker.scheduling import sweep
from memory_worker.scheduling.runs import request_fold
from memory_worker.summaries import contract as summarizers
from memory_worker.summaries.backends import _summarizer, get_summarizer
from memory_worker.summaries.contract import TRANSIENT_KINDS, ErrorKind
from tests import test_worker_faults as worker_faults
from tests.conftest import contract_chat_after_turns
from tests.support.workers import Worker, wait_until

# Faults of the fake model server (tests/support/fake_openai/), by the class they must land in.
TRANSIENT_FAULTS = ["429", "500", "timeout"]
REJECTED_FAULTS = ["insufficient_quota", "401"]
INVALID_FAULTS = ["empty", "truncated"]
# Refused for what the range holds: the next attempt bisects it (tests/test_poison_message.py).
REFUSAL_FAULTS = ["400", "content_filter", "refusal"]


@pytest.fixture
def ladder(settings):  # type: ignore[no-untyped-def]
    settings.MEMORY_FAILURE_BACKOFF_SECONDS = 30
    settings.MEMORY_FAILURE_BACKOFF_MAX_SECONDS = 3600
    settings.MEMORY_DEGRADED_AFTER_FAILURES = 3
    return settings


def seconds(plan: retries.RetryPlan) -> float:
    return plan.delay.total_seconds()


# --------------------------------------------------------------------------------------------
# The pure policy


def test_every_error_kind_is_classified_as_the_summarizer_says(ladder) -> None:  # type: ignore[no-untyped-def]
    for kind in typing.get_args(ErrorKind):
        transient = retries.failure_class(kind) == retries.TRANSIENT
        assert transient is (kind in TRANSIENT_KINDS), kind
    assert retries.failure_class(retries.CRASH_KIND) == retries.TRANSIENT


@pytest.mark.parametrize("kind", sorted(TRANSIENT_KINDS))
def test_transient_errors_back_off_exponentially_and_retry_fast_until_degraded(
    ladder, kind: str
) -> None:  # type: ignore[no-untyped-def]
    plans = [retries.retry_plan(kind, failures) for failures in (1, 2, 3, 4)]
    assert [plan.fast_retry for plan in plans] == [True, True, False, False]
    assert [plan.degraded for plan in plans] == [False, False, True, True]
    for plan, base in zip(plans, (30, 60, 120, 240), strict=True):
        assert 0.8 * base <= seconds(plan) <= 1.2 * base, (kind, plan)
    # The ladder is capped (jitter aside), however long the failures go on: 30 s * 2**1024
    # overflowed a float, after about six weeks of hourly failures.
    for failures in (30, 1025, 10**6):
        assert 0.8 * 3600 <= seconds(retries.retry_plan(kind, failures)) <= 1.2 * 3600


def test_jitter_spreads_retries(ladder) -> None:  # type: ignore[no-untyped-def]
    delays = {seconds(retries.retry_plan("rate_limit", 1)) for _ in range(20)}
    assert len(delays) > 1


@pytest.mark.parametrize("kind", ["quota", "client_error", "request_refused"])
def test_rejected_requests_wait_the_longest_and_are_never_retried_fast(ladder, kind: str) -> None:  # type: ignore[no-untyped-def]
    plan = retries.retry_plan(kind, 1)
    assert (plan.failure_class, plan.degraded, plan.fast_retry) == ("rejected", False, False)
    assert 0.8 * 3600 <= seconds(plan) <= 1.2 * 3600


@pytest.mark.parametrize(
    "kinds",
    [
        ["malformed", "malformed", "malformed", "malformed"],
        ["quota", "quota", "quota", "quota"],
        ["server_error", "malformed", "quota", "timeout"],
        ["malformed", "timeout", "request_refused", "empty"],
    ],
)
def test_degraded_is_the_same_streak_of_failures_whatever_their_kinds(
    ladder, kinds: list[str]
) -> None:  # type: ignore[no-untyped-def]
    """One rule: MEMORY_DEGRADED_AFTER_FAILURES failed folds in a row, never the latest kind."""
    degraded = [retries.retry_plan(kind, n).degraded for n, kind in enumerate(kinds, 1)]
    assert degraded == [False, False, True, True]
    ladder.MEMORY_DEGRADED_AFTER_FAILURES = 1
    assert all(retries.retry_plan(kind, 1).degraded for kind in kinds)


@pytest.mark.parametrize("kind", ["request_refused", "refused"])
def test_a_refusal_whose_next_attempt_bisects_comes_by_the_next_sweep(ladder, kind: str) -> None:  # type: ignore[no-untyped-def]
    for failures in (1, 5):
        plan = retries.retry_plan(kind, failures, isolate_next=True)
        assert (plan.degraded, plan.fast_retry) == (failures >= 3, True)
        assert seconds(plan) < ladder.MEMORY_SWEEP_INTERVAL_SECONDS


@pytest.mark.parametrize("kind", sorted(retries.INVALID_OUTPUT_KINDS))
def test_one_invalid_output_is_retried_soon_and_only_a_repeat_climbs_the_ladder(
    ladder, kind: str
) -> None:  # type: ignore[no-untyped-def]
    ladder.MEMORY_INVALID_OUTPUT_RETRY_SECONDS = 5
    first = retries.retry_plan(kind, 1)
    assert first.failure_class == "invalid_output"
    assert (first.degraded, first.fast_retry) == (False, True)
    assert 0.8 * 5 <= seconds(first) <= 1.2 * 5
    # A repeat starts where a transient failure stands once degraded: 4x the first transient
    # delay, and no fast retry: the same input keeps failing the same way. Degraded only with
    # the streak, as every kind.
    second = retries.retry_plan(kind, 2)
    assert (second.degraded, second.fast_retry) == (False, False)
    assert 0.8 * 120 <= seconds(second) <= 1.2 * 120
    third = retries.retry_plan(kind, 3)
    assert third.degraded
    assert 0.8 * 240 <= seconds(third) <= 1.2 * 240
    # Only a repeat of an invalid output climbs: after transient failures one is a fluke.
    assert not retries.retry_plan(kind, 3).fast_retry


def streak_of(*kinds: str) -> list[retries.Failure]:
    """Failures of background folds; a kind ending in "+turn" is a turn's fold's."""
    return [
        retries.Failure(kind.removesuffix("+turn"), synchronous=kind.endswith("+turn"))
        for kind in kinds
    ]


def plan_after(*kinds: str) -> retries.RetryPlan:
    streak = streak_of(*kinds)
    return retries.retry_plan(streak[-1].kind, len(streak), streak=streak)


@pytest.mark.parametrize("fluke", ["truncated", "empty"])
def test_one_invalid_output_between_transient_errors_is_a_fluke_not_a_streak(
    ladder, fluke: str
) -> None:  # type: ignore[no-untyped-def]
    """A truncated or empty answer amid rate limits says nothing about the chat: it is retried
    in seconds with the stricter prompt, and neither it nor the failures around it make the
    chat degraded, until the failures that count make a streak of their own."""
    ladder.MEMORY_INVALID_OUTPUT_RETRY_SECONDS = 5
    plan = plan_after("rate_limit", "server_error", fluke)
    assert (plan.failure_class, plan.degraded, plan.fast_retry) == ("invalid_output", False, True)
    assert seconds(plan) <= 1.2 * 5
    assert not plan_after("rate_limit", fluke, "rate_limit").degraded
    assert not plan_after(fluke, "rate_limit", "timeout").degraded
    assert plan_after("rate_limit", fluke, "rate_limit", "timeout").degraded
    # A repeat is no fluke: the same input keeps failing the same way.
    repeat = plan_after("rate_limit", fluke, fluke)
    assert not repeat.fast_retry and seconds(repeat) >= 0.8 * 240
    assert plan_after("rate_limit", fluke, "malformed").degraded
    assert plan_after("malformed", "malformed", "malformed").degraded


def test_a_turns_fold_failure_its_offline_fallback_covered_does_not_degrade(ladder) -> None:  # type: ignore[no-untyped-def]
    """The chaos run's chat: a background fold's 429, its turn's fold's 500 (the turn folded
    with the offline fallback at once), then a truncated answer: not degraded, and the
    truncated answer retried in seconds. The same non-transient failure again and again still
    degrades, and climbs the ladder."""
    plan = plan_after("rate_limit", "server_error+turn", "truncated")
    assert (plan.degraded, plan.fast_retry) == (False, True)
    assert not plan_after("rate_limit", "server_error+turn", "rate_limit").degraded
    assert plan_after("rate_limit", "server_error+turn", "rate_limit", "timeout").degraded
    assert plan_after("quota", "quota", "quota").degraded
    assert seconds(plan_after("quota", "quota", "quota")) >= 0.8 * 3600


def test_the_offline_fallback_is_planned_only_when_no_fast_retry_is(ladder) -> None:  # type: ignore[no-untyped-def]
    def falls_back(kind: str, failures: int) -> bool:
        return retries.retry_plan(kind, failures).fall_back

    assert not any(falls_back(k, n) for k in ("empty", "quota", "server_error") for n in (1, 2, 3))
    ladder.MEMORY_SUMMARIZER_FALLBACK = "offline"
    assert [falls_back("empty", n) for n in (1, 2)] == [False, True]
    assert [falls_back("quota", n) for n in (1, 2)] == [True, True]
    # Transient: the worker's fast retries first; once the chat is degraded, the fallback.
    assert [falls_back("server_error", n) for n in (1, 2, 3)] == [False, False, True]


def test_fast_retry_follows_the_newest_attempt() -> None:
    failed = outcomes.FoldOutcome(outcomes.FoldStatus.FAILED, retry_in=30.0)
    hopeless = outcomes.FoldOutcome(outcomes.FoldStatus.FAILED, retry_in=None)
    deferred = outcomes.FoldOutcome(outcomes.FoldStatus.DEFERRED)
    succeeded = outcomes.FoldOutcome(outcomes.FoldStatus.SUCCEEDED)
    assert retries.fast_retry_delay([failed, deferred]) == 30.0
    assert retries.fast_retry_delay([failed, succeeded]) is None
    assert retries.fast_retry_delay([succeeded, hopeless]) is None
    assert retries.fast_retry_delay([]) is None


# --------------------------------------------------------------------------------------------
# Through the fold service and the task, against the fake model server


def chat_with_fold_due(api) -> int:  # type: ignore[no-untyped-def]
    return contract_chat_after_turns(api, 6)  # 12 unfolded messages, K + B = 10: overflow due


def queued_retries(monkeypatch) -> list[dict[str, typing.Any]]:  # type: ignore[no-untyped-def]
    """Capture what the task would publish (the real publish is covered by the worker tests)."""
    published: list[dict[str, typing.Any]] = []
    monkeypatch.setattr(tasks.fold_chat, "apply_async", lambda **options: published.append(options))
    return published


def due_now(chat_id: int) -> None:
    Brief.objects.filter(chat_id=chat_id).update(next_attempt_at=None)


@pytest.mark.django_db
@pytest.mark.parametrize("fault", TRANSIENT_FAULTS)
def test_transient_failure_queues_a_delayed_retry(
    api, use_fake_openai, ladder, monkeypatch, fault: str
) -> None:  # type: ignore[no-untyped-def]
    ladder.MEMORY_LLM_TIMEOUT_SECONDS = 0.5
    use_fake_openai.timeout_sleep = 1.0
    published = queued_retries(monkeypatch)
    chat_id = chat_with_fold_due(api)
    use_fake_openai.queue_faults("summarize", [fault])
    before = timezone.now()
    assert tasks.fold_chat(chat_id, "turn") == ["failed"]
    brief = Brief.objects.get(chat_id=chat_id)
    assert (brief.consecutive_failures, brief.degraded) == (1, False)
    assert brief.next_attempt_at is not None
    wait = (brief.next_attempt_at - before).total_seconds()
    assert 0.8 * 30 <= wait <= 1.2 * 30 + 5
    assert len(published) == 1
    assert published[0]["args"] == (chat_id, "retry")
    # The retry cannot arrive before the backoff it was queued for has passed.
    assert brief.next_attempt_at - before <= timedelta(seconds=published[0]["countdown"] + 5)
    assert published[0]["countdown"] >= 0.8 * 30
    # The retry, once due, folds.
    due_now(chat_id)
    assert tasks.fold_chat(chat_id, "retry")[0] == "succeeded"
    assert len(published) == 1
    assert Brief.objects.get(chat_id=chat_id).last_consolidated > 0


@pytest.mark.django_db
@pytest.mark.parametrize("fault", REJECTED_FAULTS)
def test_a_rejected_request_is_not_retried_fast(
    api, use_fake_openai, ladder, monkeypatch, fault: str
) -> None:  # type: ignore[no-untyped-def]
    published = queued_retries(monkeypatch)
    chat_id = chat_with_fold_due(api)
    use_fake_openai.queue_faults("summarize", [fault])
    before = timezone.now()
    assert tasks.fold_chat(chat_id, "turn") == ["failed"]
    assert published == []
    brief = Brief.objects.get(chat_id=chat_id)
    assert (brief.consecutive_failures, brief.degraded) == (1, False)
    assert brief.next_attempt_at is not None
    assert (brief.next_attempt_at - before).total_seconds() >= 0.8 * 3600
    # Turn triggers (and their reruns) wait; only a manual consolidation tries at once.
    assert folds.fold_once(chat_id, RequestReason.TURN).status == "deferred"
    assert len(use_fake_openai.summarize_requests()) == 1
    assert folds.fold_once(chat_id, RequestReason.MANUAL).status == "succeeded"
    brief.refresh_from_db()
    assert (brief.degraded, brief.consecutive_failures, brief.next_attempt_at) == (False, 0, None)


def system_prompts(server) -> list[str]:  # type: ignore[no-untyped-def]
    return [r.body["messages"][0]["content"] for r in server.summarize_requests()]


@pytest.mark.django_db
@pytest.mark.parametrize("fault", INVALID_FAULTS)
def test_one_invalid_summary_is_retried_in_seconds_with_the_stricter_prompt(
    api, use_fake_openai, ladder, monkeypatch, fault: str
) -> None:  # type: ignore[no-untyped-def]
    ladder.MEMORY_INVALID_OUTPUT_RETRY_SECONDS = 5
    published = queued_retries(monkeypatch)
    chat_id = chat_with_fold_due(api)
    use_fake_openai.queue_faults("summarize", [fault])
    before = timezone.now()
    assert tasks.fold_chat(chat_id, "turn") == ["failed"]
    brief = Brief.objects.get(chat_id=chat_id)
    assert (brief.consecutive_failures, brief.degraded) == (1, False)
    assert brief.next_attempt_at is not None
    assert (brief.next_attempt_at - before).total_seconds() <= 1.2 * 5 + 2
    assert [(o["args"], round(o["countdown"])) for o in published] in (
        [((chat_id, "retry"), n)] for n in (4, 5, 6)
    )
    # The retry, when due, asks with the stricter prompt, and folds.
    due_now(chat_id)
    assert tasks.fold_chat(chat_id, "retry") == ["succeeded"]
    first, retry = system_prompts(use_fake_openai)
    assert "previous answer" not in first and "previous answer" in retry
    brief.refresh_from_db()
    assert (brief.degraded, brief.consecutive_failures, brief.failure_kind) == (False, 0, "")
    # The next fold asks as usual again.
    assert "previous answer" not in summarizers.summary_instructions(500)


@pytest.mark.postgres
@pytest.mark.redis
@pytest.mark.worker
def test_a_worker_folds_in_seconds_after_one_empty_summary(
    require_postgres, broker, settings, user, use_fake_openai
) -> None:  # type: ignore[no-untyped-def]
    """The fast retry is the worker's own delayed task: no sweep, no turn needed."""
    use_fake_openai.queue_faults("summarize", ["empty"])
    chat_id = worker_faults.chat_with_fold_due(user, settings)
    env = {**worker_faults.model_env(use_fake_openai), "MEMORY_INVALID_OUTPUT_RETRY_SECONDS": "1"}
    worker = Worker(broker, "fast-retry", env=env)
    try:
        worker.wait_ready()
        assert request_fold(chat_id, RequestReason.TURN)
        folded = wait_until(
            lambda: Brief.objects.get(chat_id=chat_id).last_consolidated > 0, timeout=30
        )
        assert folded, worker.log()
    finally:
        worker.stop()
    assert ledger_rows(chat_id) == [("failed", "overflow"), ("succeeded", "overflow")]
    assert "previous answer" in system_prompts(use_fake_openai)[1]
    brief = Brief.objects.get(chat_id=chat_id)
    assert (brief.consecutive_failures, brief.degraded, brief.failure_kind) == (0, False, "")


@pytest.mark.django_db
def test_a_second_invalid_summary_in_a_row_is_left_to_the_ladder_and_a_third_degrades(
    api, use_fake_openai, ladder, monkeypatch
) -> None:  # type: ignore[no-untyped-def]
    published = queued_retries(monkeypatch)
    chat_id = chat_with_fold_due(api)
    # Not a refusal second: a repeated refusal bisects the range first (test_poison_message).
    use_fake_openai.queue_faults("summarize", ["empty", "truncated"])
    assert tasks.fold_chat(chat_id, "turn") == ["failed"]
    due_now(chat_id)
    before = timezone.now()
    assert tasks.fold_chat(chat_id, "retry") == ["failed"]
    assert len(published) == 1  # the first failure's fast retry only
    brief = Brief.objects.get(chat_id=chat_id)
    assert (brief.consecutive_failures, brief.degraded) == (2, False)
    assert brief.next_attempt_at is not None
    assert (brief.next_attempt_at - before).total_seconds() >= 0.8 * 120
    assert api.get(f"/api/v1/chats/{chat_id}/brief/").json()["degraded_reason"] == ""
    # Turn triggers wait; only a manual consolidation tries at once.
    assert folds.fold_once(chat_id, RequestReason.TURN).status == "deferred"
    use_fake_openai.queue_faults("summarize", ["empty"])
    assert folds.fold_once(chat_id, RequestReason.MANUAL).status == "failed"
    brief.refresh_from_db()
    assert (brief.consecutive_failures, brief.degraded) == (3, True)
    reason = api.get(f"/api/v1/chats/{chat_id}/brief/").json()["degraded_reason"]
    assert reason.startswith("3 folds in a row failed; the last (empty): "), reason
    assert folds.fold_once(chat_id, RequestReason.MANUAL).status == "succeeded"
    brief.refresh_from_db()
    assert (brief.consecutive_failures, brief.degraded) == (0, False)


# --------------------------------------------------------------------------------------------
# MEMORY_SUMMARIZER_FALLBACK=offline: background folds


def ledger_rows(chat_id: int) -> list[tuple[str, str]]:
    return [
        (row.status, row.trigger)
        for row in Consolidation.objects.filter(chat_id=chat_id).order_by("id")
    ]


@pytest.mark.django_db
def test_a_background_fold_falls_back_once_no_fast_retry_is_left_and_the_brief_says_so(
    api, use_fake_openai, ladder, monkeypatch
) -> None:  # type: ignore[no-untyped-def]
    ladder.MEMORY_SUMMARIZER_FALLBACK = "offline"
    published = queued_retries(monkeypatch)
    chat_id = chat_with_fold_due(api)
    # Not a refusal second: a repeated refusal bisects the range first (test_poison_message).
    use_fake_openai.queue_faults("summarize", ["empty", "truncated"])
    assert tasks.fold_chat(chat_id, "turn") == ["failed"]  # the fast retry first
    assert len(published) == 1
    due_now(chat_id)
    assert tasks.fold_chat(chat_id, "retry") == ["succeeded"]
    assert len(published) == 1
    assert ledger_rows(chat_id) == [
        ("failed", "overflow"),
        ("failed", "overflow"),
        ("succeeded", "summarizer_fallback"),
    ]
    fallback = Consolidation.objects.filter(chat_id=chat_id).order_by("id").last()
    assert fallback is not None and fallback.error.startswith("fallback after: summarizer")
    brief = Brief.objects.get(chat_id=chat_id)
    assert brief.last_consolidated == fallback.to_seq and brief.summary
    assert brief.fallback_since is not None and brief.fallback_reason.startswith("summarizer")
    # The model summarizer still fails: the brief keeps saying so; the range is folded, so no
    # retry waits, and the next fold due asks the model first.
    assert (brief.degraded, brief.consecutive_failures, brief.next_attempt_at) == (False, 2, None)
    shown = api.get(f"/api/v1/chats/{chat_id}/brief/").json()
    assert shown["fallback_since"] is not None and shown["fallback_reason"]
    # The next model fold rewrites the fallback summary and ends both states.
    for number in range(3):
        api.post(f"/api/v1/chats/{chat_id}/turns/", {"content": f"m{number}"}, format="json")
    assert folds.fold_once(chat_id, RequestReason.MANUAL).status == "succeeded"
    brief.refresh_from_db()
    assert (brief.fallback_since, brief.fallback_reason, brief.degraded) == (None, "", False)
    assert ledger_rows(chat_id)[-1] == ("succeeded", "manual")


@pytest.mark.django_db
def test_a_transient_failure_keeps_its_fast_retries_before_any_fallback(
    api, use_fake_openai, ladder, monkeypatch
) -> None:  # type: ignore[no-untyped-def]
    ladder.MEMORY_SUMMARIZER_FALLBACK = "offline"
    published = queued_retries(monkeypatch)
    chat_id = chat_with_fold_due(api)
    use_fake_openai.queue_faults("summarize", ["500", "500", "500"])
    for _attempt in range(2):
        due_now(chat_id)
        assert tasks.fold_chat(chat_id, "retry") == ["failed"]
    assert len(published) == 2
    due_now(chat_id)  # the third in a row: degraded, so the fallback folds
    assert tasks.fold_chat(chat_id, "retry") == ["succeeded"]
    assert ledger_rows(chat_id)[-1] == ("succeeded", "summarizer_fallback")


@pytest.mark.django_db
def test_without_the_setting_a_background_fold_never_falls_back(
    api, use_fake_openai, ladder, monkeypatch
) -> None:  # type: ignore[no-untyped-def]
    queued_retries(monkeypatch)
    chat_id = chat_with_fold_due(api)
    use_fake_openai.queue_faults("summarize", ["400"])
    assert tasks.fold_chat(chat_id, "turn") == ["failed"]
    assert ledger_rows(chat_id) == [("failed", "overflow")]
    assert Brief.objects.get(chat_id=chat_id).fallback_since is None


@pytest.mark.django_db
@pytest.mark.parametrize("fault", REFUSAL_FAULTS)
def test_a_first_refusal_is_retried_soon_to_bisect_the_range(
    api, use_fake_openai, ladder, monkeypatch, fault: str
) -> None:  # type: ignore[no-untyped-def]
    published = queued_retries(monkeypatch)
    chat_id = chat_with_fold_due(api)
    use_fake_openai.queue_faults("summarize", [fault])
    before = timezone.now()
    assert tasks.fold_chat(chat_id, "turn") == ["failed"]
    assert len(published) == 1  # the worker's own retry
    brief = Brief.objects.get(chat_id=chat_id)
    assert (brief.consecutive_failures, brief.degraded) == (1, False)
    assert brief.next_attempt_at is not None
    waited = (brief.next_attempt_at - before).total_seconds()
    assert waited < ladder.MEMORY_SWEEP_INTERVAL_SECONDS


@pytest.mark.django_db
def test_a_retry_delayed_past_half_the_visibility_timeout_is_left_to_the_sweep(
    api, use_fake_openai, ladder, monkeypatch
) -> None:  # type: ignore[no-untyped-def]
    """Redis gives a delayed message a worker has held for the visibility timeout to another
    worker (its restore ignores the ETA): the retry would run twice."""
    ladder.BROKER_VISIBILITY_TIMEOUT = 40  # the first backoff (30 s ± 20 %) is past half of it
    published = queued_retries(monkeypatch)
    chat_id = chat_with_fold_due(api)
    use_fake_openai.queue_faults("summarize", ["500"])
    assert tasks.fold_chat(chat_id, "turn") == ["failed"]
    assert published == []
    assert Brief.objects.get(chat_id=chat_id).next_attempt_at is not None  # the sweep's cue


@pytest.mark.django_db
def test_fast_retries_stop_at_the_degraded_limit(api, use_fake_openai, ladder, monkeypatch) -> None:  # type: ignore[no-untyped-def]
    published = queued_retries(monkeypatch)
    chat_id = chat_with_fold_due(api)
    use_fake_openai.queue_faults("summarize", ["500", "429", "500", "500"])
    for _attempt in range(4):
        due_now(chat_id)  # as if each retry arrived when due
        assert tasks.fold_chat(chat_id, "retry") == ["failed"]
    countdowns = [options["countdown"] for options in published]
    assert len(countdowns) == 2, countdowns  # failures 1 and 2; from the 3rd only the sweep
    assert 0.8 * 30 <= countdowns[0] <= 1.2 * 30
    assert 0.8 * 60 <= countdowns[1] <= 1.2 * 60
    brief = Brief.objects.get(chat_id=chat_id)
    assert (brief.consecutive_failures, brief.degraded) == (4, True)
    assert Consolidation.objects.filter(chat_id=chat_id, status="failed").count() == 4


@pytest.mark.django_db
def test_manual_folds_meeting_a_held_lock_leave_one_manual_rerun(api, monkeypatch) -> None:  # type: ignore[no-untyped-def]
    """The holder's reruns judge by the policy's triggers, and here none is due: the requests'
    one pending mark says "manual", and the holder's exit asks for one manual run. The requests
    do not come back (each would make the holder run again)."""
    from memory_worker.coordination.runtime import chat_lock
    from memory_worker.scheduling import runs

    published = queued_retries(monkeypatch)
    chat_id = contract_chat_after_turns(api, 4)  # 8 messages: under K + B, a manual fold folds 2
    assert folds.fold_once(chat_id, RequestReason.TURN).status == "nothing"
    lock = chat_lock()
    assert lock.acquire_or_mark_pending(chat_id, "another-run")
    for _request in range(3):
        assert tasks.fold_chat(chat_id, "manual") == []
    assert published == []
    requested: list[tuple[int, RequestReason]] = []
    monkeypatch.setattr(runs, "request_fold", lambda c, t, d: requested.append((c, t)))
    assert lock.release(chat_id, "another-run")
    runs.hand_on_pending(chat_id, lock, RequestReason.RERUN, None)
    runs.hand_on_pending(chat_id, lock, RequestReason.RERUN, None)  # served already
    assert requested == [(chat_id, RequestReason.MANUAL)]
    assert not lock.is_pending(chat_id)
    assert tasks.fold_chat(chat_id, "manual") == ["succeeded"]
    assert Brief.objects.get(chat_id=chat_id).last_consolidated == 2


def new_chat(api, **body: typing.Any) -> int:  # type: ignore[no-untyped-def]
    response = api.post("/api/v1/chats/", body, format="json")
    assert response.status_code == 201, response.content
    return int(response.json()["id"])


@pytest.mark.django_db
def test_two_failures_of_the_same_version_count_two(require_postgres, api, monkeypatch) -> None:  # type: ignore[no-untyped-def]
    """Two failures of the same version (a crash and the sweep's abandonment, two workers)
    count two: fail_brief reads the count with the brief's row locked, so a second failure
    arriving between one's read and its write waits, then counts from the first's."""
    from tests.test_deletion_races import on_a_thread, waiting_on_a_lock

    chat_id = new_chat(api)
    now = timezone.now()
    ledger = Consolidation(chat_id=chat_id, trigger="turn", from_seq=1, to_seq=2)
    real = retries.retry_plan
    second: list[typing.Any] = []

    def retry_plan(
        kind: str,
        failures: int,
        isolate_next: bool = False,
        streak: typing.Sequence[retries.Failure] | None = None,
    ) -> retries.RetryPlan:
        if not second:  # the other failure arrives between this one's read and its write
            second.append(on_a_thread(lambda: retries.fail_brief(ledger, 0, "b", "timeout", now)))
            assert wait_until(lambda: outside(waiting_on_a_lock), 15)
        return real(kind, failures, isolate_next, streak)

    def outside(check: typing.Callable[[], bool]) -> bool:
        # On a connection of its own: this one's transaction sees one statistics snapshot.
        thread, result = on_a_thread(check)
        thread.join(15)
        return bool(result.get("value"))

    monkeypatch.setattr(retries, "retry_plan", retry_plan)
    retries.fail_brief(ledger, 0, "first", "timeout", now)
    thread, result = second[0]
    thread.join(15)
    assert "error" not in result, result.get("error")
    brief = Brief.objects.get(chat_id=chat_id)
    assert brief.consecutive_failures == 2
    # The backoff is the second failure's (30 s x 2, +-20 %).
    assert brief.next_attempt_at is not None
    assert 48 <= (brief.next_attempt_at - now).total_seconds() <= 72


@pytest.mark.django_db
def test_a_chat_failing_a_429_a_turns_500_and_a_truncated_answer_is_not_degraded(
    api, ladder
) -> None:  # type: ignore[no-untyped-def]
    """The chaos run's chat 15 through the failure service, which reads the streak from the
    ledger: the truncated answer after the 429 and the turn's 500 (its fallback committed) is
    retried in seconds, and the chat is not degraded; the failure stays on the brief. A second
    truncated answer in a row is no fluke: it climbs the ladder, and degrades the chat."""
    import time

    from memory_worker.folding import ledger as fold_ledger
    from memory_worker.folding.snapshot import load_snapshot

    ladder.MEMORY_INVALID_OUTPUT_RETRY_SECONDS = 5
    chat_id = new_chat(api)

    def fail(kind: str, synchronous: bool = False) -> retries.RetryPlan:
        snapshot = load_snapshot(chat_id)
        trigger = "hard_bound" if synchronous else "window"
        ledger = Consolidation(
            chat_id=chat_id, trigger=trigger, from_seq=1, to_seq=2,
            base_version=snapshot.version, synchronous=synchronous,
        )  # fmt: skip
        fold_ledger.record_running(ledger)
        return retries.record_failure(
            chat_id, snapshot, ledger, error=f"boom: {kind}", kind=kind,
            now=timezone.now(), started=time.monotonic(),
        )  # fmt: skip

    fail("rate_limit")
    fail("server_error", synchronous=True)
    plan = fail("truncated")
    assert (plan.degraded, plan.fast_retry) == (False, True)
    assert seconds(plan) <= 1.2 * 5
    brief = Brief.objects.get(chat_id=chat_id)
    assert (brief.degraded, brief.consecutive_failures) == (False, 3)
    assert (brief.failure_kind, brief.last_error) == ("truncated", "boom: truncated")
    plan = fail("truncated")
    assert (plan.degraded, plan.fast_retry) == (True, False)
    assert seconds(plan) >= 0.8 * 240
    assert Brief.objects.get(chat_id=chat_id).degraded


# --------------------------------------------------------------------------------------------
# The client: no retries of its own


@pytest.mark.parametrize("backend", ["chat", "responses"])
def test_summarizer_client_never_retries_on_its_own(settings, backend: str) -> None:  # type: ignore[no-untyped-def]
    settings.MEMORY_SUMMARIZER_BACKEND = backend
    settings.OPENAI_API_KEY = "test-key"
    settings.PROMPT_ID_SUMMARY_GLOBAL = "pmpt_test"
    _summarizer.cache_clear()
    try:
        summarizer = get_summarizer()
        assert summarizer.client.max_retries == 0  # type: ignore[attr-defined]
    finally:
        _summarizer.cache_clear()


@pytest.mark.django_db
def test_one_fold_attempt_is_one_model_call(api, use_fake_openai) -> None:  # type: ignore[no-untyped-def]
    """A 500 that the SDK retried by itself (its default is 2 retries) would show up here as a
    second request and a succeeded fold."""
    _summarizer.cache_clear()
    chat_id = chat_with_fold_due(api)
    use_fake_openai.queue_faults("summarize", ["500"])
    assert folds.fold_once(chat_id, RequestReason.TURN).status == "failed"
    assert len(use_fake_openai.summarize_requests()) == 1


@pytest.mark.django_db
def test_a_failed_manual_fold_does_not_leave_the_chat_degraded_for_ever(
    api, use_fake_openai, ladder
) -> None:  # type: ignore[no-untyped-def]
    """The retry of a manual fold asks the engine's own triggers, which want nothing here: the
    chat stayed degraded, and the sweep queued its due retry every minute."""
    from datetime import timedelta

    from django.utils import timezone

    from memory_worker.coordination.locks import LocalChatLock

    # sliding-window with a 4-message tail: 10 messages leave 6 to fold, under its window of 12
    body = {"policy": "sliding-window", "policy_overrides": {"tail_messages": 4}}
    chat_id = api.post("/api/v1/chats/", body, format="json").json()["id"]
    for number in range(5):
        api.post(f"/api/v1/chats/{chat_id}/turns/", {"content": f"n{number}"}, format="json")
    ladder.MEMORY_DEGRADED_AFTER_FAILURES = 1
    use_fake_openai.queue_faults("summarize", ["401"])
    assert folds.fold_once(chat_id, RequestReason.MANUAL).status == "failed"
    brief = Brief.objects.get(chat_id=chat_id)
    assert brief.degraded and brief.next_attempt_at is not None
    now = timezone.now()
    Brief.objects.filter(chat_id=chat_id).update(next_attempt_at=now - timedelta(seconds=1))
    lock = LocalChatLock(ttl_seconds=30)
    assert chat_id in sweep.sweep_candidates(now, lock, limit=10)
    assert folds.fold_once(chat_id, RequestReason.SWEEP).status == "nothing"
    brief = Brief.objects.get(chat_id=chat_id)
    assert (brief.degraded, brief.next_attempt_at, brief.consecutive_failures) == (False, None, 0)
    assert chat_id not in sweep.sweep_candidates(now, lock, limit=10)
    assert brief.last_consolidated == 0 and "401" in brief.last_error  # the failure is on record
