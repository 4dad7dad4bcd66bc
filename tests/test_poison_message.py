"""A message the summarizer refuses (a provider's content filter answers its fold with a 400)
no longer stops its chat's folds for good: after two refusals of the range, the fold bisects it,
folds every other message and withholds the refused one, recorded on the ledger row, the brief
and in the summary (docs/policies.md, poison messages)."""

import time
from collections.abc import Callable, Sequence
from datetime import timedelta
from typing import Any

import pytest
from django.conf import settings
from django.core.cache import cache
from django.utils import timezone

from conversations.models import Brief, Consolidation, Message
from memory_worker import tasks
from memory_worker.coordination.dispatch import RequestReason
from memory_worker.coordination.locks import LocalChatLock
from memory_worker.engine import isolation as isolation_policy
from memory_worker.engine import policy as engine
from memory_worker.folding.execute import fold_once
from memory_worker.folding.isolation import IsolationFailed, isolate, with_withheld_lines
from memory_worker.scheduling import sweep
from memory_worker.scheduling.runs import fold_with_lock
from memory_worker.summaries.contract import FoldMessage, SummarizerError, SummaryResult
from tests.support.fake_openai import FakeOpenAI, last_user_text, summary_text
from tests.support.invariants import chat_violations

MARKER = "FORBIDDEN-WORD"
POISON_TURN = 3  # of TURNS: the user message of this turn holds the marker
TURNS = 10


def chat_with_a_refused_message(api: Any, fake: FakeOpenAI) -> tuple[int, int]:
    """A chat with a fold due whose range holds one user message the fake provider refuses
    (replies never quote it). Returns the chat's id and the refused message's seq."""
    fake.refuse_summaries_containing(MARKER)
    fake.reply_fn = lambda body: "noted: " + last_user_text(body).replace(MARKER, "it")
    chat_id = int(
        api.post(
            "/api/v1/chats/",
            {"policy": "sliding-window", "policy_overrides": {"tail_messages": 2}},
            format="json",
        ).json()["id"]
    )
    for number in range(TURNS):
        content = f"turn {number} about the garden shed"
        if number == POISON_TURN:
            content = f"{MARKER} is what {content} says"
        response = api.post(f"/api/v1/chats/{chat_id}/turns/", {"content": content}, format="json")
        assert response.status_code == 201, response.content
    refused = Message.objects.get(chat_id=chat_id, content__contains=MARKER)
    return chat_id, refused.seq


@pytest.fixture
def run_sweep(monkeypatch: pytest.MonkeyPatch) -> Callable[[], list[int]]:
    """tasks.sweep, each chat it queues consolidated at once, as a worker would on receiving
    the task. Returns the chats it queued."""
    cache.delete(sweep.SWEEP_CURSOR_KEY)
    lock = LocalChatLock(ttl_seconds=60)
    queued: list[int] = []

    def consolidate(chat_id: int, trigger: RequestReason) -> None:
        queued.append(chat_id)
        fold_with_lock(chat_id, trigger, lock)

    monkeypatch.setattr(tasks, "chat_lock", lambda: lock)
    monkeypatch.setattr(tasks, "request_fold", consolidate)

    def run() -> list[int]:
        queued.clear()
        tasks.sweep()
        return list(queued)

    return run


def a_sweep_interval_later(chat_id: int) -> None:
    """The clock moved by one sweep interval: whatever was due by then is due now."""
    interval = timedelta(seconds=settings.MEMORY_SWEEP_INTERVAL_SECONDS)
    brief = Brief.objects.get(chat_id=chat_id)
    if brief.next_attempt_at is not None:
        Brief.objects.filter(chat_id=chat_id).update(
            next_attempt_at=brief.next_attempt_at - interval
        )


@pytest.mark.django_db
def test_a_refused_message_is_withheld_and_the_rest_folded_within_two_sweeps(
    api: Any, use_fake_openai: FakeOpenAI, run_sweep: Callable[[], list[int]]
) -> None:
    chat_id, refused_seq = chat_with_a_refused_message(api, use_fake_openai)
    started = timezone.now()
    first = fold_once(chat_id, RequestReason.TURN)  # the turn's fold, refused
    assert (first.status, first.kind) == ("failed", "request_refused")
    brief = Brief.objects.get(chat_id=chat_id)
    # Not the hour-long backoff of a rejected request: due by the next sweep, not degraded.
    assert brief.next_attempt_at is not None and not brief.degraded
    assert brief.next_attempt_at - started <= timedelta(
        seconds=settings.MEMORY_SWEEP_INTERVAL_SECONDS
    )

    for _ in range(2):
        a_sweep_interval_later(chat_id)
        assert chat_id in run_sweep()
        if Brief.objects.get(chat_id=chat_id).last_consolidated > refused_seq:
            break

    brief = Brief.objects.get(chat_id=chat_id)
    messages = list(Message.objects.filter(chat_id=chat_id).order_by("seq"))
    assert brief.last_consolidated == messages[-1].seq - 2  # all but the 2-message tail
    assert not brief.degraded and brief.consecutive_failures == 0 and brief.next_attempt_at is None
    [row] = Consolidation.objects.filter(chat_id=chat_id, status="succeeded")
    assert row.withheld_seqs == [refused_seq]
    assert (row.from_seq, row.to_seq) == (1, brief.last_consolidated)
    assert row.summarizer_calls <= isolation_policy.isolation_call_budget(row.to_seq) + 1
    shown = api.get(f"/api/v1/chats/{chat_id}/brief/").json()
    assert [item["seq"] for item in shown["withheld"]] == [refused_seq]
    assert "HTTP 400" in shown["withheld"][0]["reason"]
    assert f"message {refused_seq} withheld" in shown["summary"]
    assert MARKER not in shown["summary"]
    for message in messages[: brief.last_consolidated]:
        if message.seq != refused_seq:
            assert " ".join(message.content.split()[:12]) in shown["summary"], message.seq
    ledger = api.get(f"/api/v1/chats/{chat_id}/consolidations/").json()["results"]
    assert ledger[0]["withheld_seqs"] == [refused_seq]
    # The refused message stays in the history, and the ledger covers 1..W exactly once.
    history = api.get(f"/api/v1/chats/{chat_id}/messages/").json()["results"]
    assert any(MARKER in item["content"] for item in history)
    assert chat_violations(chat_id) == []


@pytest.mark.django_db
def test_a_single_refusal_does_not_bisect_yet(api: Any, use_fake_openai: FakeOpenAI) -> None:
    chat_id, _ = chat_with_a_refused_message(api, use_fake_openai)
    assert fold_once(chat_id, RequestReason.MANUAL).status == "failed"
    assert len(use_fake_openai.summarize_requests()) == 1
    assert fold_once(chat_id, RequestReason.MANUAL).status == "succeeded"


@pytest.mark.django_db
def test_a_range_refused_for_another_reason_is_not_bisected(
    api: Any, use_fake_openai: FakeOpenAI
) -> None:
    chat_id, _ = chat_with_a_refused_message(api, use_fake_openai)
    use_fake_openai.clear_faults()
    use_fake_openai.queue_faults("summarize", ["429", "429"])
    for _ in range(2):
        assert fold_once(chat_id, RequestReason.MANUAL).kind == "rate_limit"
    assert len(use_fake_openai.summarize_requests()) == 2


@pytest.mark.django_db
@pytest.mark.parametrize("fault", ["context_length_exceeded", "context_exceeded"])
def test_a_message_too_large_for_the_summarizer_is_folded_offline_never_withheld(
    api: Any, use_fake_openai: FakeOpenAI, fault: str
) -> None:
    """A context-length 400 (OpenAI's or llama.cpp's) is no refusal: the range is split into
    smaller chunks at turn boundaries, and the turn too large on its own is folded by the
    offline summarizer (a fallback row), its content in the memory."""
    chat_id, large_seq = chat_with_a_refused_message(api, use_fake_openai)
    use_fake_openai.clear_faults()
    use_fake_openai.too_large_summaries_containing(MARKER, fault=fault)

    outcome = fold_once(chat_id, RequestReason.MANUAL)

    assert outcome.status == "succeeded"
    brief = Brief.objects.get(chat_id=chat_id)
    messages = list(Message.objects.filter(chat_id=chat_id).order_by("seq"))
    assert brief.last_consolidated == messages[-1].seq - 2  # all but the 2-message tail
    assert brief.withheld == [] and not brief.degraded
    rows = Consolidation.objects.filter(chat_id=chat_id)
    assert {row.error_kind for row in rows.filter(status="failed")} == {"too_large"}
    assert not any(row.withheld_seqs for row in rows)
    [offline] = rows.filter(status="succeeded", trigger=engine.Trigger.SUMMARIZER_FALLBACK)
    assert offline.from_seq <= large_seq <= offline.to_seq
    assert offline.to_seq - offline.from_seq == 1  # the large message's turn alone
    assert MARKER in brief.summary
    assert chat_violations(chat_id) == []


# --- The bisection ------------------------------------------------------------------------


class Refusing:
    """Summarizes by appending the seqs it is given; refuses any piece holding a refused seq,
    or everything (``refuse_all``)."""

    name = "refusing"

    def __init__(self, refused: Sequence[int], refuse_all: bool = False) -> None:
        self.refused, self.refuse_all = set(refused), refuse_all
        self.attempts = 0

    def summarize(self, current_summary: str, messages: Sequence[FoldMessage]) -> SummaryResult:
        self.attempts += 1
        if self.refuse_all or self.refused & {m.seq for m in messages}:
            raise SummarizerError("request_refused", "summarizer request refused: HTTP 400")
        text = " ".join([current_summary, *(str(m.seq) for m in messages)]).strip()
        return SummaryResult(text, 1, 1, self.name)


def conversation(size: int) -> list[FoldMessage]:
    return [FoldMessage(seq, "user" if seq % 2 else "assistant", "x") for seq in range(1, size + 1)]


REFUSED = SummarizerError("request_refused", "refused")


@pytest.mark.parametrize("size", [2, 3, 8, 33, 100, 257])
def test_the_bisection_stays_within_its_call_budget(size: int) -> None:
    for refused in sorted({1, 2, size // 2, size - 1, size}):
        summarizer = Refusing([refused])
        isolated = isolate(summarizer, "", conversation(size), REFUSED)
        assert summarizer.attempts <= isolation_policy.isolation_call_budget(size)
        assert [item.seq for item in isolated.withheld] == [refused]
        summary, _, withheld_lines = isolated.result.text.partition("## Open Items")
        assert f"message {refused} withheld" in withheld_lines
        folded = [int(word) for word in summary.split()]
        # Every other message once, in order, onto the summary of the pieces before it.
        assert folded == [seq for seq in range(1, size + 1) if seq != refused]
        assert isolated.result.calls == summarizer.attempts


def test_the_call_budget_grows_with_the_logarithm_of_the_range() -> None:
    assert isolation_policy.isolation_call_budget(2) == 8
    assert isolation_policy.isolation_call_budget(1000) == 26


def test_pieces_are_cut_at_turn_boundaries_until_one_turn_is_left() -> None:
    assert (
        isolation_policy.split_index(["user", "assistant", "user", "assistant", "tool", "user"])
        == 2
    )
    assert isolation_policy.split_index(["user", "assistant", "tool", "assistant"]) == 2
    assert (
        isolation_policy.split_index(["user", "assistant", "tool", "tool", "assistant", "user"])
        == 5
    )


def test_a_refused_piece_never_splits_a_turn_it_can_keep_whole() -> None:
    messages = conversation(12)  # turns of two: user, assistant
    summarizer = Refusing([8])
    isolated = isolate(summarizer, "", messages, REFUSED)
    assert [item.seq for item in isolated.withheld] == [8]


def test_when_every_piece_is_refused_nothing_is_withheld() -> None:
    """Then the cause is not one message (the summary itself, the request's shape): the fold
    fails as any refused fold, rather than withhold the whole range."""
    with pytest.raises(IsolationFailed):
        isolate(Refusing([], refuse_all=True), "earlier", conversation(4), REFUSED)


def test_another_failure_during_the_bisection_ends_it() -> None:
    class Flaky(Refusing):
        def summarize(self, current_summary: str, messages: Sequence[FoldMessage]) -> Any:
            if self.attempts == 2:
                self.attempts += 1
                raise SummarizerError("timeout", "summarizer timeout")
            return super().summarize(current_summary, messages)

    with pytest.raises(IsolationFailed) as failed:
        isolate(Flaky([1]), "", conversation(8), REFUSED)
    assert failed.value.error.kind == "timeout"


def test_a_message_refused_once_on_its_own_gets_one_more_try_before_it_is_withheld() -> None:
    """A refusal may be a fluke: the single message a bisection pins down is asked for once
    more, and folded if that passes."""

    class RefusingItAloneOnce(Refusing):
        def summarize(self, current_summary: str, messages: Sequence[FoldMessage]) -> Any:
            if [m.seq for m in messages] == [3] and self.refused:
                self.refused.clear()  # refused alone this once; from now on accepted
                self.attempts += 1
                raise SummarizerError("request_refused", "summarizer request refused: HTTP 400")
            return super().summarize(current_summary, messages)

    summarizer = RefusingItAloneOnce([3])
    isolated = isolate(summarizer, "", conversation(8), REFUSED)
    assert isolated.withheld == ()
    assert isolated.result.text.split() == [str(seq) for seq in range(1, 9)]


def test_two_refused_messages_each_with_its_retry_fit_the_call_budget() -> None:
    summarizer = Refusing([3, 7])
    isolated = isolate(summarizer, "", conversation(8), REFUSED)
    assert [item.seq for item in isolated.withheld] == [3, 7]
    assert summarizer.attempts <= isolation_policy.isolation_call_budget(8)


def test_a_message_refused_twice_on_its_own_is_withheld() -> None:
    summarizer = Refusing([3])
    isolated = isolate(summarizer, "", conversation(8), REFUSED)
    assert [item.seq for item in isolated.withheld] == [3]
    # [1..4], [1, 2], [3, 4], [3], [3] again, [4], [5..8]
    assert summarizer.attempts == 7


def test_withheld_lines_go_under_open_items() -> None:
    summary = "## Decisions\n- use oak\n\n## Open Items\n- None\n\n## Key Artifacts\n- None"
    assert with_withheld_lines(summary, [4, 9]) == (
        "## Decisions\n- use oak\n\n## Open Items\n"
        "- message 4 withheld: the summarizer refused it\n"
        "- message 9 withheld: the summarizer refused it\n\n## Key Artifacts\n- None"
    )
    assert with_withheld_lines("## Decisions\n- x", [2]).endswith(
        "\n\n## Open Items\n- message 2 withheld: the summarizer refused it"
    )


@pytest.mark.django_db
def test_turns_at_the_bound_still_answer_while_the_range_is_refused(
    api: Any, use_fake_openai: FakeOpenAI
) -> None:
    """No background fold runs here: every turn past the bound folds first, its model fold is
    refused, and the offline summarizer folds the range instead (before_turn); the turn answers."""
    use_fake_openai.refuse_summaries_containing(MARKER)
    chat_id = int(api.post("/api/v1/chats/", {"policy": "contract"}, format="json").json()["id"])
    for number in range(14):
        content = f"{MARKER} turn {number}" if number == 1 else f"turn {number}"
        response = api.post(f"/api/v1/chats/{chat_id}/turns/", {"content": content}, format="json")
        assert response.status_code == 201, response.content
    refused = Consolidation.objects.filter(chat_id=chat_id, synchronous=True, status="failed")
    assert refused.exists() and {row.error_kind for row in refused} == {"request_refused"}
    fallback = Consolidation.objects.filter(
        chat_id=chat_id, trigger=engine.Trigger.HARD_BOUND_FALLBACK, status="succeeded"
    )
    assert fallback.exists()


class Slowing(Refusing):
    """After ``in_time`` calls, no further call could end before any deadline."""

    def __init__(self, refused: Sequence[int], in_time: int, settings: Any) -> None:
        super().__init__(refused)
        self.in_time, self.settings = in_time, settings
        settings.MEMORY_LLM_TIMEOUT_SECONDS = 1

    def summarize(self, current_summary: str, messages: Sequence[FoldMessage]) -> Any:
        if self.attempts + 1 == self.in_time:
            self.settings.MEMORY_LLM_TIMEOUT_SECONDS = 10**6
        return super().summarize(current_summary, messages)


def test_a_bisection_out_of_time_keeps_what_it_folded_up_to_a_turn_boundary(
    settings: Any,
) -> None:
    summarizer = Slowing([12], 2, settings)
    isolated = isolate(summarizer, "", conversation(16), REFUSED, time.monotonic() + 1000)
    # [1..8] folded, [9..16] refused; its first half would have been the third call.
    assert summarizer.attempts == 2
    assert (isolated.to_seq, isolated.withheld) == (8, ())
    assert isolated.result.text == " ".join(str(seq) for seq in range(1, 9))


def test_a_bisection_out_of_time_inside_a_turn_commits_nothing(settings: Any) -> None:
    # [1, 2] refused, then [1] folded; [2] (the turn's reply) would have been the third call.
    summarizer = Slowing([2], 2, settings)
    with pytest.raises(IsolationFailed):
        isolate(summarizer, "", conversation(4), REFUSED, time.monotonic() + 1000)
    assert summarizer.attempts == 2


@pytest.mark.django_db
def test_a_fold_whose_bisection_ran_out_of_time_commits_its_prefix_and_goes_on(
    api: Any, use_fake_openai: FakeOpenAI, settings: Any
) -> None:
    chat_id, refused_seq = chat_with_a_refused_message(api, use_fake_openai)
    accepted: list[int] = []

    def summary(body: dict[str, Any]) -> str:
        accepted.append(1)
        if len(accepted) == 1:  # the task's time runs out after the first accepted piece
            settings.MEMORY_LLM_TIMEOUT_SECONDS = 10**6
        return summary_text(body, 300)

    use_fake_openai.summary_fn = summary
    assert fold_once(chat_id, RequestReason.MANUAL).status == "failed"
    outcome = fold_once(chat_id, RequestReason.MANUAL, deadline=time.monotonic() + 10_000)
    assert (outcome.status, outcome.more_due) == ("succeeded", True)
    [row] = Consolidation.objects.filter(chat_id=chat_id, status="succeeded")
    brief = Brief.objects.get(chat_id=chat_id)
    assert row.to_seq == brief.last_consolidated < refused_seq
    assert row.withheld_seqs == [] and chat_violations(chat_id) == []
    settings.MEMORY_LLM_TIMEOUT_SECONDS = 5.0
    for _ in range(2):  # the rest: refused once, then bisected
        fold_once(chat_id, RequestReason.MANUAL)
    brief = Brief.objects.get(chat_id=chat_id)
    assert [item["seq"] for item in brief.withheld] == [refused_seq]
    assert brief.last_consolidated > refused_seq and chat_violations(chat_id) == []


WRITTEN = "Answers in French, please."


@pytest.mark.django_db
def test_a_bisected_fold_passes_the_fold_guard_like_any_other(
    api: Any, use_fake_openai: FakeOpenAI, run_sweep: Callable[[], list[int]]
) -> None:
    """The pieces' summarizer forgets the line a person wrote: the bisection's summary gets it
    back before its commit, and the loss report is recorded, as on every path."""
    chat_id, refused_seq = chat_with_a_refused_message(api, use_fake_openai)
    Brief.objects.filter(chat_id=chat_id).update(
        summary=f"## Goals / Preferences\n- {WRITTEN}\n- Shed code QZ-4411.", user_lines=[WRITTEN]
    )
    use_fake_openai.summary_fn = lambda body: (
        "## Facts / Constraints\n- The shed came up.\n## Decisions\n- None"
    )
    fold_once(chat_id, RequestReason.TURN)
    for _ in range(2):
        a_sweep_interval_later(chat_id)
        assert chat_id in run_sweep()
        if Brief.objects.get(chat_id=chat_id).last_consolidated > refused_seq:
            break
    brief = Brief.objects.get(chat_id=chat_id)
    assert brief.last_consolidated > refused_seq
    [row] = Consolidation.objects.filter(chat_id=chat_id, status="succeeded")
    assert row.withheld_seqs == [refused_seq]
    assert f"## Goals / Preferences\n- {WRITTEN}" in brief.summary
    assert "QZ-4411" in brief.summary and brief.user_lines == [WRITTEN]
    assert f"message {refused_seq} withheld" in brief.summary
