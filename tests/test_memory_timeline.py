"""The admin's memory timeline (conversations.services.memory_timeline, admin_timeline): every
committed fold drawn where it landed with its kind, the summary's size after each, the chat's
bounds and thresholds; a long chat drawn sampled, small at any length."""

from __future__ import annotations

import re
from dataclasses import replace
from datetime import timedelta
from typing import Any

import pytest
from django.utils import timezone

from conversations.admin_timeline import MAX_POINTS, RIGHT, WIDTH, timeline_svg
from conversations.models import Brief, Chat, Consolidation, ConsolidationStatus, Message, Role
from conversations.services.memory_timeline import (
    Fold,
    Limits,
    Timeline,
    Turn,
    fold_kind,
    memory_timeline,
)
from memory_worker.engine.policy import Trigger
from memory_worker.folding.summary_edit import edit_summary
from tests.support.browser import ARTIFACTS, admin_browser
from tests.test_admin import admin_user, chat_with_summary  # noqa: F401


def marks(svg: str, css: str) -> list[dict[str, str]]:
    found = []
    for tag in re.findall(rf'<(?:line|circle) class="{css}[^"]*"[^>]*>', svg):
        found.append(dict(re.findall(r'([\w-]+)="([^"]*)"', tag)))
    return found


def test_each_committed_fold_is_drawn_with_its_kind_and_summary_size(api: Any) -> None:
    chat = chat_with_summary(api)
    committed = Consolidation.objects.filter(chat=chat, status=ConsolidationStatus.SUCCEEDED)
    timeline = memory_timeline(chat)
    assert len(timeline.turns) == chat.messages.filter(role=Role.ASSISTANT).count()
    assert [f.id for f in timeline.folds] == sorted(c.id for c in committed)
    svg = str(timeline_svg(timeline))
    drawn = marks(svg, "fold")
    assert sorted(int(m["data-fold-id"]) for m in drawn) == sorted(c.id for c in committed)
    kinds = {c.id: fold_kind(c.trigger, c.synchronous) for c in committed}
    assert {int(m["data-fold-id"]): m["data-kind"] for m in drawn} == kinds
    sizes = {int(m["data-fold-id"]): int(m["data-tokens"]) for m in marks(svg, "summary-size")}
    assert sizes == {c.id: c.summary_tokens_after for c in committed}


def test_the_bounds_and_thresholds_are_the_engines_for_the_chats_policy(api: Any) -> None:
    chat = chat_with_summary(api)  # contract: a message bound (K + B) and its threshold
    timeline = memory_timeline(chat)
    svg = str(timeline_svg(timeline))
    lines = {m["data-line"]: int(m["data-value"]) for m in marks(svg, "bound")}
    lines |= {m["data-line"]: int(m["data-value"]) for m in marks(svg, "threshold")}
    assert lines["message bound"] == timeline.limits.message_bound
    assert lines["message threshold"] == timeline.limits.message_trigger
    # The prompt bound (90 % of a 128k window) is far above a short chat's prompts: named, not
    # drawn squashed against the axis.
    assert "prompt bound" not in lines and "prompt bound 115,200" in svg


def test_each_reply_keeps_the_memory_its_context_was_built_from(api: Any) -> None:
    chat = chat_with_summary(api, turns=4)  # no fold until the manual one at the end
    later = api.post(f"/api/v1/chats/{chat.pk}/turns/", {"content": "one more"}, format="json")
    assert later.status_code == 201
    brief = Brief.objects.get(chat=chat)
    reply = Message.objects.get(chat=chat, seq=later.json()["assistant_message"]["seq"])
    unfolded = reply.seq - 2 - brief.last_consolidated  # stored before its user message, after W
    assert reply.metadata["context"]["watermark"] == brief.last_consolidated
    assert reply.metadata["context"]["unfolded"] == unfolded
    assert reply.metadata["context"]["history_tokens"] > brief.summary_tokens
    turns = memory_timeline(chat).turns
    assert [t.unfolded for t in turns[:4]] == [0, 2, 4, 6]
    assert (turns[-1].unfolded, turns[-1].watermark) == (unfolded, brief.last_consolidated)


def test_replies_from_before_the_context_was_recorded_are_placed_by_time(api: Any) -> None:
    chat = chat_with_summary(api, turns=4)
    first_fold = timezone.now()
    Consolidation.objects.filter(chat=chat).update(finished_at=first_fold)
    Message.objects.filter(chat=chat).update(created_at=first_fold - timedelta(seconds=1))
    later = api.post(f"/api/v1/chats/{chat.pk}/turns/", {"content": "one more"}, format="json")
    assert later.status_code == 201
    for reply in Message.objects.filter(chat=chat, role=Role.ASSISTANT):
        reply.metadata.pop("context")
        reply.save(update_fields=["metadata"])
    watermark = Brief.objects.get(chat=chat).last_consolidated
    timeline = memory_timeline(chat)
    assert [t.unfolded for t in timeline.turns[:4]] == [0, 2, 4, 6]
    assert timeline.turns[-1].unfolded == timeline.turns[-1].seq - 2 - watermark
    assert [f.turn_index for f in timeline.folds] == [4]  # the first turn after it


def test_a_fold_is_drawn_at_the_first_turn_whose_context_it_served_whatever_the_clocks(
    api: Any,
) -> None:
    chat = chat_with_summary(api, turns=4)
    fold = Consolidation.objects.get(chat=chat, status=ConsolidationStatus.SUCCEEDED)
    later = api.post(f"/api/v1/chats/{chat.pk}/turns/", {"content": "one more"}, format="json")
    assert later.status_code == 201
    # The fold's commit stamped after the reply it served (another host's clock ahead).
    Consolidation.objects.filter(pk=fold.pk).update(finished_at=timezone.now() + timedelta(hours=1))
    timeline = memory_timeline(chat)
    assert [f.turn_index for f in timeline.folds] == [4]


def test_a_fold_no_turn_has_used_yet_sits_at_the_right_edge(api: Any) -> None:
    chat = chat_with_summary(api, turns=4)  # the manual fold came after the last reply
    timeline = memory_timeline(chat)
    assert [f.turn_index for f in timeline.folds] == [len(timeline.turns)]
    svg = str(timeline_svg(timeline))
    xs = [float(m["x1"]) for m in marks(svg, "fold")]
    assert xs == [WIDTH - RIGHT]
    coordinates = re.findall(r'points="([^"]*)"', svg)
    assert all(float(p.split(",")[0]) <= WIDTH - RIGHT for c in coordinates for p in c.split())


@pytest.mark.parametrize(
    ("trigger", "synchronous", "kind"),
    [
        (Trigger.OVERFLOW, False, "background"),
        (Trigger.HARD_BOUND, True, "synchronous"),
        (Trigger.HARD_BOUND_FALLBACK, True, "fallback"),
        (Trigger.SUMMARIZER_FALLBACK, False, "fallback"),
        (Trigger.MANUAL, False, "manual"),
        (Trigger.EDIT, False, "edit"),
    ],
)
def test_a_folds_kind_follows_its_trigger(trigger: str, synchronous: bool, kind: str) -> None:
    assert fold_kind(trigger, synchronous) == kind


def long_timeline(turns: int, every: int) -> Timeline:
    start = timezone.now()
    rows = [
        Turn(2 * i + 2, start + timedelta(seconds=i), 1000 + 37 * (i % every), 2 * (i % every))
        for i in range(turns)
    ]
    folds = [
        Fold(n, "background", "overflow", 1, 2 * i, start, 300 + n % 200, i)
        for n, i in enumerate(range(every, turns, every))
    ]
    limits = Limits(115_200, 108_000, 4500, 3900, 75, 71, 500)
    return Timeline(rows, folds, limits)


def test_a_ten_thousand_turn_chat_is_drawn_sampled_and_small() -> None:
    timeline = long_timeline(10_000, 15)
    # A twentieth of the turns waited for a fold: their marks share the size budget too.
    turns = [replace(t, waited=i % 20 == 0) for i, t in enumerate(timeline.turns)]
    svg = str(timeline_svg(replace(timeline, turns=turns)))
    assert len(svg.encode()) < 300_000
    prompt = re.search(r'data-series="prompt"[^>]*points="([^"]*)"', svg)
    assert prompt is not None and len(prompt.group(1).split()) <= MAX_POINTS
    # A peak survives the sampling: every bucket keeps its largest value.
    assert 'data-folds="666"' in svg and len(marks(svg, "fold")) == 666


def test_a_turn_that_waited_for_a_fold_is_marked_and_counted() -> None:
    timeline = long_timeline(40, 15)
    turns = [replace(t, waited=t.seq in (20, 52)) for t in timeline.turns]
    svg = str(timeline_svg(replace(timeline, turns=turns)))
    assert re.findall(r'<path class="waited" data-seq="(\d+)"', svg) == ["20", "52"]
    assert "turns that waited for a fold: 2" in svg


def test_the_admin_chat_page_shows_the_timeline(client: Any, admin_user: Any, api: Any) -> None:  # noqa: F811
    chat = chat_with_summary(api)
    client.force_login(admin_user)
    page = client.get(f"/admin/conversations/chat/{chat.pk}/change/").content.decode()
    assert 'class="chatmem-timeline"' in page and "Memory over time" in page
    assert Chat.objects.filter(pk=chat.pk).exists()


def test_the_chart_in_a_browser_shows_the_bounds_the_ledgers_folds_and_summary_sizes(
    live_server: Any, api: Any
) -> None:
    from selenium.webdriver.common.by import By

    chat = chat_with_summary(api)
    brief = Brief.objects.get(chat=chat)
    edit_summary(chat, brief.summary + "\n- Edited by a person.", brief.version, editor="alice")
    committed = list(Consolidation.objects.filter(chat=chat, status=ConsolidationStatus.SUCCEEDED))
    with admin_browser(live_server, "memory-timeline-failure.png") as driver:
        driver.get(f"{live_server.url}/admin/conversations/chat/{chat.pk}/change/")
        chart = driver.find_element(By.CSS_SELECTOR, "svg.chatmem-timeline")
        assert chart.find_elements(By.CSS_SELECTOR, "line.bound")  # the message bound
        lines = {
            (int(str(m.get_attribute("data-fold-id"))), m.get_attribute("data-kind"))
            for m in chart.find_elements(By.CSS_SELECTOR, "line.fold")
        }
        assert lines == {(c.id, fold_kind(c.trigger, c.synchronous)) for c in committed}
        assert {"manual", "edit"} <= {kind for _, kind in lines}
        sizes = {
            int(str(m.get_attribute("data-fold-id"))): int(str(m.get_attribute("data-tokens")))
            for m in chart.find_elements(By.CSS_SELECTOR, "circle.summary-size")
        }
        assert sizes == {c.id: c.summary_tokens_after for c in committed}
        legend = chart.find_element(By.CSS_SELECTOR, "g.legend").text
        assert f"manual folds: {sum(k == 'manual' for _, k in lines)}" in legend
        driver.execute_script("arguments[0].scrollIntoView()", chart)
        assert chart.screenshot(str(ARTIFACTS / "memory-timeline.png"))
