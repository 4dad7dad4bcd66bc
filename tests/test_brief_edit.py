"""A person's edit of the summary (PATCH …/brief/ with If-Match): fenced like a fold, so an edit
and a fold that read the same version never both commit, and a fold never overwrites an edit
with a summary computed from the text before it."""

import json
import threading
import time
from typing import Any

import pytest
from django.db import connection
from django.utils import timezone

from conversations.chat_model.tokens import count_tokens
from conversations.models import Brief, Chat, Consolidation, Message
from conversations.services import chats as chat_service
from memory_worker.engine import policy as engine
from memory_worker.folding import execute as folds
from memory_worker.folding.commit import commit_fold
from memory_worker.folding.ledger import record_running
from memory_worker.folding.snapshot import load_snapshot
from memory_worker.folding.summary_edit import VersionMoved, edit_summary
from memory_worker.summaries.contract import SummaryResult
from memory_worker.tasks import fold_chat
from tests.conftest import client_for, contract_chat_after_turns
from tests.support.fake_openai import read_fold_input
from tests.support.invariants import chat_violations
from tests.support.workers import Worker, wait_until
from tests.test_worker_faults import chat_with_fold_due, ledger_running, model_env

pytestmark = pytest.mark.django_db

EDITED = "## Facts / Constraints\n- The vault code is 4471\n- Call me Sam, never Samuel\n"


def brief_url(chat_id: int) -> str:
    return f"/api/v1/chats/{chat_id}/brief/"


def patch(api: Any, chat_id: int, body: Any, if_match: str | None) -> Any:
    headers = {"HTTP_IF_MATCH": if_match} if if_match is not None else {}
    return api.patch(brief_url(chat_id), body, format="json", **headers)


def test_the_briefs_etag_summary_and_running_summary_are_of_one_version(
    api, user, monkeypatch
) -> None:  # type: ignore[no-untyped-def]
    """An edit committing between the brief's two reads (the row, then the memory view) must
    not pair one version's ETag with the other's summary."""
    chat_id = contract_chat_after_turns(api, 6)
    version = api.get(brief_url(chat_id)).json()["version"]
    real_view, edits = chat_service.memory_view, iter([EDITED])

    def view_after_an_edit(chat: Chat) -> Any:
        for text in edits:  # once: the edit lands between the two reads
            edit_summary(chat, text, version, editor="someone")
        return real_view(chat)

    monkeypatch.setattr(chat_service, "memory_view", view_after_an_edit)
    response = api.get(brief_url(chat_id))
    body = response.json()
    assert response["ETag"] == f'"{body["version"]}"' == f'"{version + 1}"'
    assert body["summary"] == body["running_summary"]["summary"] == EDITED


def test_the_brief_has_its_version_as_etag_and_an_edit_moves_it(api, user) -> None:  # type: ignore[no-untyped-def]
    chat_id = contract_chat_after_turns(api, 6)
    api.post(f"/api/v1/chats/{chat_id}/consolidate/")
    before = api.get(brief_url(chat_id))
    version = before.json()["version"]
    assert before["ETag"] == f'"{version}"'
    response = patch(api, chat_id, {"summary": EDITED}, f'"{version}"')
    assert response.status_code == 200, response.content
    body = response.json()
    assert body["summary"] == EDITED and body["version"] == version + 1
    assert response["ETag"] == f'"{version + 1}"'
    assert body["user_lines"] == ["The vault code is 4471", "Call me Sam, never Samuel"]
    edit = Consolidation.objects.get(chat_id=chat_id, trigger="edit")
    assert (edit.status, edit.edited_by) == ("succeeded", user.username)
    assert edit.summary_tokens_before == before.json()["summary_tokens"]
    assert edit.summary_tokens_after == body["summary_tokens"] > 0
    ledger = api.get(f"/api/v1/chats/{chat_id}/consolidations/").json()["results"]
    assert ledger[0]["trigger"] == "edit" and ledger[0]["edited_by"] == user.username
    assert chat_violations(chat_id) == []


def test_an_edit_without_if_match_is_428_and_a_stale_one_412_and_neither_stores(api) -> None:  # type: ignore[no-untyped-def]
    chat_id = contract_chat_after_turns(api, 1)
    missing = patch(api, chat_id, {"summary": EDITED}, None)
    assert missing.status_code == 428 and "If-Match" in missing.json()["detail"]
    stale = patch(api, chat_id, {"summary": EDITED}, '"7"')
    assert stale.status_code == 412, stale.content
    assert stale.json()["code"] == "version_moved"
    assert stale.json()["detail"].startswith(
        "Version 7 of the summary never existed (it is at version 0)"
    )
    star = patch(api, chat_id, {"summary": EDITED}, "*")
    assert star.status_code == 400
    brief = Brief.objects.get(chat_id=chat_id)
    assert (brief.summary, brief.version) == ("", 0)
    assert not Consolidation.objects.filter(chat_id=chat_id).exists()


def test_a_weak_etag_in_if_match_never_matches_and_is_412(api) -> None:  # type: ignore[no-untyped-def]
    """RFC 9110 §13.1.1: If-Match compares strongly, and a weak tag never matches, even the
    current version's."""
    chat_id = contract_chat_after_turns(api, 1)
    weak = patch(api, chat_id, {"summary": EDITED}, 'W/"0"')
    assert weak.status_code == 412, weak.content
    assert weak.json()["code"] == "version_moved" and "weak" in weak.json()["detail"]
    brief = Brief.objects.get(chat_id=chat_id)
    assert (brief.summary, brief.version) == ("", 0)
    assert not Consolidation.objects.filter(chat_id=chat_id).exists()


def test_the_owner_sees_a_staff_edit_as_staff_not_the_staff_persons_username(api, user) -> None:  # type: ignore[no-untyped-def]
    chat_id = contract_chat_after_turns(api, 1)
    chat = Chat.objects.get(pk=chat_id)
    edit_summary(chat, EDITED, 0, editor="ops-alice")  # as the admin's editor saves it
    assert patch(api, chat_id, {"summary": EDITED + "- mine\n"}, '"1"').status_code == 200
    ledger = api.get(f"/api/v1/chats/{chat_id}/consolidations/").json()["results"]
    assert [row["edited_by"] for row in ledger] == [user.username, "staff"]
    assert "ops-alice" not in json.dumps(ledger)
    # The record itself keeps who it was, for the staff.
    assert Consolidation.objects.filter(chat_id=chat_id, edited_by="ops-alice").exists()


def test_an_edit_over_the_cap_or_with_unknown_fields_is_400_and_stores_nothing(api) -> None:  # type: ignore[no-untyped-def]
    chat_id = api.post(
        "/api/v1/chats/", {"policy_overrides": {"summary_token_cap": 64}}, format="json"
    ).json()["id"]
    long = patch(api, chat_id, {"summary": "- word " * 200}, '"0"')
    assert long.status_code == 400
    assert "cap (summary_token_cap) is 64 tokens" in long.json()["summary"][0]
    unknown = patch(api, chat_id, {"summary": "- fine", "version": 0}, '"0"')
    assert unknown.status_code == 400 and "version" in unknown.json()
    not_text = patch(api, chat_id, {"summary": 5}, '"0"')
    assert not_text.status_code == 400
    assert Brief.objects.get(chat_id=chat_id).version == 0
    assert not Consolidation.objects.filter(chat_id=chat_id).exists()


def test_another_users_brief_is_404_to_read_and_to_edit(api, other_api) -> None:  # type: ignore[no-untyped-def]
    chat_id = contract_chat_after_turns(api, 1)
    assert other_api.get(brief_url(chat_id)).status_code == 404
    for if_match in (None, '"0"'):
        assert patch(other_api, chat_id, {"summary": EDITED}, if_match).status_code == 404
    assert Brief.objects.get(chat_id=chat_id).version == 0


def test_user_lines_are_those_a_person_wrote(api) -> None:  # type: ignore[no-untyped-def]
    chat_id = contract_chat_after_turns(api, 1)
    first = patch(api, chat_id, {"summary": "- alpha line\n- beta line"}, '"0"').json()
    assert first["user_lines"] == ["alpha line", "beta line"]
    Brief.objects.filter(chat_id=chat_id).update(
        summary="- alpha line\n- beta line\n- folded gamma", user_lines=["alpha line"]
    )
    second = patch(api, chat_id, {"summary": "- alpha line\n- folded gamma\n- delta"}, '"1"')
    # beta was no longer the person's (a fold let it go); gamma a fold wrote; delta is new.
    assert second.json()["user_lines"] == ["alpha line", "delta"]


THAI = "- ผมชอบกินข้าวผัดกุ้งที่ร้านริมแม่น้ำเจ้าพระยาทุกวันเสาร์ตอนเย็นกับครอบครัว\n" * 3


def test_an_edit_is_counted_as_the_chats_model_counts_it(api, settings) -> None:  # type: ignore[no-untyped-def]
    # A model without a tokenizer or tiktoken mapping: its Thai counts with the non-Latin margin,
    # about twice the default encoding's count.
    settings.MODEL_VARIANTS = "local=local-model:32000"
    model_tokens, default_tokens = count_tokens(THAI, "local-model"), count_tokens(THAI)
    cap = (model_tokens + default_tokens) // 2
    assert default_tokens < cap < model_tokens
    body = {"model_variant": "local", "policy_overrides": {"summary_token_cap": cap}}
    chat_id = api.post("/api/v1/chats/", body, format="json").json()["id"]
    over = patch(api, chat_id, {"summary": THAI}, '"0"')
    assert over.status_code == 400, over.content
    assert f"is {model_tokens} tokens" in over.json()["summary"][0]
    # Under the cap, the brief and the ledger row carry the model's count.
    api.patch(f"/api/v1/chats/{chat_id}/", {"policy_overrides": {}}, format="json")
    edited = patch(api, chat_id, {"summary": THAI}, '"0"')
    assert edited.status_code == 200, edited.content
    assert edited.json()["summary_tokens"] == model_tokens
    assert Brief.objects.get(chat_id=chat_id).summary_tokens == model_tokens
    edit = Consolidation.objects.get(chat_id=chat_id, trigger="edit")
    assert edit.summary_tokens_after == model_tokens


# --- Races against real PostgreSQL --------------------------------------------------------------

# Each order is forced in a third of them: enough for either to surface a lost or double commit.
RACES = 300


def chat_with_messages(user: Any, count: int) -> Chat:
    """A contract chat with ``count`` stored messages (written directly: the races fold them one
    at a time and need no model)."""
    api = client_for(user)
    chat = Chat.objects.get(
        pk=api.post("/api/v1/chats/", {"policy": "contract"}, format="json").json()["id"]
    )
    Message.objects.bulk_create(
        Message(chat=chat, seq=seq, role="user", content=f"fact {seq}", token_count=3)
        for seq in range(1, count + 1)
    )
    Chat.objects.filter(pk=chat.pk).update(last_seq=count)
    chat.refresh_from_db()
    return chat


class Order:
    """Which racer acts first in each race: in one race of three the folder, in one the editor,
    each waiting for the other to finish first (so every run proves both orders, whatever the
    scheduler does); in the rest both at once."""

    def __init__(self) -> None:
        self.first_done = threading.Event()

    @staticmethod
    def first(race: int) -> str | None:
        return ("fold", "edit", None)[race % 3]


class Racer(threading.Thread):
    """Runs ``act(race)`` at each race's start, on its own connection, and records the result;
    ``name`` waits its turn when the race's ``order`` puts the other racer first."""

    def __init__(
        self, start: threading.Barrier, done: threading.Barrier, act: Any, name: str, order: Order
    ) -> None:
        super().__init__(daemon=True)
        self.start_line, self.done, self.act = start, done, act
        self.role, self.order = name, order
        self.results: list[Any] = []
        self.race = 0

    def act_in_order(self, race: int) -> Any:
        first = self.order.first(race)
        if first not in (None, self.role):
            assert self.order.first_done.wait(timeout=30)
        try:
            return self.act(race)
        finally:
            if first == self.role:
                self.order.first_done.set()

    def run(self) -> None:
        try:
            for self.race in range(RACES):
                try:
                    self.start_line.wait(timeout=30)
                except threading.BrokenBarrierError:
                    return
                try:
                    self.results.append(self.act_in_order(self.race))
                except Exception as error:
                    self.results.append(error)
                try:
                    self.done.wait(timeout=30)
                except threading.BrokenBarrierError:
                    return
        finally:
            connection.close()


def test_an_edit_racing_a_fold_on_one_version_commits_one_of_them_300_times(
    require_postgres, user
) -> None:  # type: ignore[no-untyped-def]
    """A fold and an edit read one version, then commit: exactly one of them lands, in each of
    300 races, whichever order they take; each order is also forced in a third of them."""
    chat = chat_with_messages(user, RACES + 2)
    state: dict[str, Any] = {}

    def fold(race: int) -> str:
        snapshot, ledger = state["snapshot"], state["ledger"]
        watermark = snapshot.last_consolidated
        decision = engine.Decision(engine.Trigger.MANUAL, watermark + 1, watermark + 1)
        result = SummaryResult(f"- fold {race}", 10, 5, "test")
        outcome, _ = commit_fold(
            chat, snapshot, decision, ledger, result, now=timezone.now(), started=time.monotonic()
        )
        return str(outcome.status)

    def edit(race: int) -> str:
        try:
            edit_summary(chat, f"- edit {race}", state["snapshot"].version, editor="alice")
        except VersionMoved:
            return "refused"
        return "committed"

    start, done, order = threading.Barrier(3), threading.Barrier(3), Order()
    folder, editor = (
        Racer(start, done, fold, "fold", order),
        Racer(start, done, edit, "edit", order),
    )
    folder.start()
    editor.start()
    try:
        wins = run_races(chat, state, start, done, folder, editor, order)
    finally:
        start.abort()  # a failed race frees the racers (and their connections)
        done.abort()
        folder.join(timeout=30)
        editor.join(timeout=30)
    assert sum(wins.values()) == RACES
    assert chat_violations(chat.pk) == []
    edits = Consolidation.objects.filter(chat_id=chat.pk, trigger="edit")
    assert edits.count() == wins["edit"] == edits.filter(status="succeeded").count()


def run_races(
    chat: Chat,
    state: dict[str, Any],
    start: threading.Barrier,
    done: threading.Barrier,
    folder: Racer,
    editor: Racer,
    order: Order,
) -> dict[str, int]:
    wins = {"fold": 0, "edit": 0}
    for race in range(RACES):
        order.first_done.clear()
        snapshot = load_snapshot(chat.pk)
        state["snapshot"] = snapshot
        state["ledger"] = ledger = Consolidation(
            chat=chat,
            trigger="manual",
            from_seq=snapshot.last_consolidated + 1,
            to_seq=snapshot.last_consolidated + 1,
            base_version=snapshot.version,
        )
        record_running(ledger)
        start.wait(timeout=30)
        done.wait(timeout=30)
        folded, edited = folder.results[race], editor.results[race]
        brief = Brief.objects.get(chat_id=chat.pk)
        assert brief.version == snapshot.version + 1, (race, folded, edited)
        # A forced order decides the winner: whoever acts first commits.
        assert order.first(race) in (None, "edit" if edited == "committed" else "fold"), race
        if edited == "committed":
            # The fold read the version before the edit: it must not have written anything.
            assert folded == "superseded", (race, folded)
            assert brief.summary == f"- edit {race}"
            assert brief.last_consolidated == snapshot.last_consolidated
            assert brief.user_lines == [f"edit {race}"]
            wins["edit"] += 1
        else:
            assert (folded, edited) == ("succeeded", "refused"), race
            assert brief.summary == f"- fold {race}"
            wins["fold"] += 1
    return wins


def test_a_patch_during_a_workers_fold_supersedes_it_and_the_rerun_keeps_the_edit(
    require_postgres, broker, settings, user, use_fake_openai
) -> None:  # type: ignore[no-untyped-def]
    use_fake_openai.summarize_latency = 2.0  # the fold is in flight when the edit arrives
    api = client_for(user)
    chat_id = chat_with_fold_due(user, settings)
    # Deadlines with room for a loaded machine (a fresh worker's first fold loads the token
    # encoding), still in the order the worker checks at start.
    roomy = {
        "MEMORY_LLM_TIMEOUT_SECONDS": "10",
        "MEMORY_TASK_SOFT_TIME_LIMIT": "20",
        "MEMORY_TASK_TIME_LIMIT": "25",
        "BROKER_VISIBILITY_TIMEOUT": "40",
    }
    worker = Worker(broker, "briefedit", env={**model_env(use_fake_openai), **roomy})
    try:
        worker.wait_ready()
        assert api.post(f"/api/v1/chats/{chat_id}/consolidate/").status_code == 202
        assert wait_until(lambda: ledger_running(chat_id), timeout=30), worker.log()
        response = patch(api, chat_id, {"summary": EDITED}, '"0"')
        assert response.status_code == 200, response.content
        assert wait_until(
            lambda: (
                Consolidation.objects.filter(chat_id=chat_id, status="succeeded")
                .exclude(trigger="edit")
                .exists()
            ),
            timeout=30,
        ), worker.log()
    finally:
        worker.stop()
    statuses = list(
        Consolidation.objects.filter(chat_id=chat_id)
        .order_by("id")
        .values_list("status", "trigger")
    )
    assert statuses[:2] == [("superseded", "manual"), ("succeeded", "edit")], statuses
    # The rerun read the edited text and its summary still states it.
    last_input = use_fake_openai.summarize_requests()[-1]
    summary, _ = read_fold_input(last_input.text)
    assert "4471" in summary
    brief = Brief.objects.get(chat_id=chat_id)
    assert "4471" in brief.summary and "Sam" in brief.summary
    assert "The vault code is 4471" in brief.user_lines
    assert chat_violations(chat_id) == []


def test_a_manual_fold_an_edit_supersedes_is_run_again_as_a_manual_fold(user, monkeypatch) -> None:  # type: ignore[no-untyped-def]
    """The 202 of POST …/consolidate/ promises a fold. An edit committing while it summarizes
    supersedes it; the rerun, on the edited text, is still the manual fold, not one judged by
    the policy's own triggers (none is due here, so that one would fold nothing)."""
    api = client_for(user)
    chat_id = contract_chat_after_turns(api, 4)  # 8 messages: under K + B, no fold due
    assert folds.fold_once(chat_id, folds.RequestReason.TURN).status == "nothing"
    real = folds.guard
    edited: list[int] = []

    def edit_meanwhile(*args: Any, **kwargs: Any) -> Any:
        if not edited:  # a person's edit commits while the first fold summarizes
            edited.append(edit_summary(Chat.objects.get(pk=chat_id), EDITED, 0, editor="x").version)
        return real(*args, **kwargs)

    monkeypatch.setattr(folds, "guard", edit_meanwhile)
    assert fold_chat(chat_id, "manual") == ["superseded", "succeeded"]
    rows = list(
        Consolidation.objects.filter(chat_id=chat_id)
        .order_by("id")
        .values_list("status", "trigger")
    )
    assert rows == [("superseded", "manual"), ("succeeded", "edit"), ("succeeded", "manual")]
    brief = Brief.objects.get(chat_id=chat_id)
    assert brief.last_consolidated == 2
    assert "4471" in brief.summary
