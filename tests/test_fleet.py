"""The admin's fleet page (conversations.services.fleet, admin_fleet): its counts are the
ledger's over each window, the lag percentiles as percentile_cont gives them, the chats that
need attention linked, a constant number of queries however large the ledger."""

from __future__ import annotations

from datetime import timedelta
from typing import Any

import pytest
from django.db import connection
from django.test import Client
from django.test.utils import CaptureQueriesContext

from conversations.models import Brief, Chat, Consolidation, ConsolidationStatus
from conversations.rows import database_now
from conversations.services.fleet import fleet, percentiles
from tests.support.browser import ARTIFACTS, admin_browser
from tests.test_admin import admin_user  # noqa: F401

SUCCEEDED, FAILED = ConsolidationStatus.SUCCEEDED, ConsolidationStatus.FAILED
SUPERSEDED = ConsolidationStatus.SUPERSEDED


def make_chat(user: Any, title: str, variant: str = "", last_seq: int = 0) -> Chat:
    chat = Chat.objects.create(owner=user, title=title, policy="contract", model_variant=variant)
    Chat.objects.filter(pk=chat.pk).update(last_seq=last_seq)
    Brief.objects.get_or_create(chat=chat)
    return Chat.objects.get(pk=chat.pk)


def ledger_row(chat: Chat, status: str, ago: timedelta, **fields: Any) -> Consolidation:
    now = fields.pop("now", None) or database_now()
    return Consolidation.objects.create(
        chat=chat,
        trigger=fields.pop("trigger", "overflow"),
        status=status,
        from_seq=1,
        to_seq=2,
        base_version=0,
        finished_at=now - ago,
        **fields,
    )


@pytest.fixture
def ledger(user: Any) -> dict[str, Chat]:
    plain, deep = make_chat(user, "plain"), make_chat(user, "deep", variant="deep")
    minute, hours = timedelta(minutes=1), timedelta(hours=3)
    for _ in range(3):
        ledger_row(plain, SUCCEEDED, minute, summarizer_calls=1, input_tokens=100, output_tokens=10)
    ledger_row(deep, SUCCEEDED, minute, summarizer_calls=2, input_tokens=300, output_tokens=30)
    ledger_row(plain, SUCCEEDED, minute, trigger="summarizer_fallback")
    ledger_row(plain, SUCCEEDED, minute, trigger="edit")  # not a fold
    ledger_row(plain, FAILED, minute, summarizer_calls=1, input_tokens=100)
    ledger_row(deep, SUPERSEDED, hours, summarizer_calls=1, input_tokens=50, output_tokens=5)
    ledger_row(deep, SUCCEEDED, hours)
    ledger_row(deep, SUCCEEDED, timedelta(days=3))  # before either window
    return {"plain": plain, "deep": deep}


def test_the_counts_are_the_ledgers_in_each_window(ledger: dict[str, Chat]) -> None:
    hour, day = fleet().windows
    assert (hour.committed, hour.failed, hour.superseded, hour.fallen_back) == (5, 1, 0, 1)
    assert (day.committed, day.failed, day.superseded, day.fallen_back) == (6, 1, 1, 1)
    assert hour.per_minute(hour.committed) == pytest.approx(5 / 60)
    spend = {s.variant: s for s in hour.spend}
    assert (spend[""].calls, spend[""].input_tokens, spend[""].attempts) == (4, 400, 5)
    assert (spend["deep"].calls, spend["deep"].input_tokens, spend["deep"].output_tokens) == (
        2,
        300,
        30,
    )


def test_the_lag_percentiles_interpolate_as_percentile_cont(user: Any) -> None:
    chat = make_chat(user, "lagging")
    now = database_now()
    lags = [1.0, 2.0, 3.0, 4.0, 10.0]
    for lag in lags:
        due = now - timedelta(minutes=5, seconds=lag)
        ledger_row(chat, SUCCEEDED, timedelta(minutes=5), due_at=due, now=now)
    hour = fleet().windows[0]
    assert hour.lag_p50_s == pytest.approx(3.0, abs=1e-3)
    assert hour.lag_p95_s == pytest.approx(4.0 + 0.8 * 6.0, abs=1e-3)  # 0.95 of the way: 8.8
    assert percentiles(lags) == pytest.approx((3.0, 8.8))
    assert percentiles([]) == (None, None) and percentiles([2.5]) == (2.5, 2.5)


def test_the_chats_that_need_attention_degraded_then_failing_then_not_queued(user: Any) -> None:
    degraded, failing = make_chat(user, "broken"), make_chat(user, "flaky")
    missed = make_chat(user, "missed", last_seq=90)
    long_tail = make_chat(user, "long tail", last_seq=400)  # unfolded by design: not listed
    paused = make_chat(user, "paused", last_seq=4)
    Brief.objects.filter(chat=degraded).update(degraded=True, consecutive_failures=5)
    Brief.objects.filter(chat=failing).update(consecutive_failures=1, last_error="429")
    Brief.objects.filter(chat=missed).update(enqueue_missed_at=database_now())
    Chat.objects.filter(pk=paused.pk).update(folds_paused=True)
    figures = fleet()
    assert [(c.title, c.why, c.unfolded) for c in figures.attention] == [
        ("broken", "degraded", 0),
        ("flaky", "failing", 0),
        ("missed", "not queued", 90),
    ]
    assert long_tail.pk not in {c.chat_id for c in figures.attention}
    assert (figures.degraded_chats, figures.failing_chats, figures.paused_chats) == (1, 1, 1)


def test_the_fleet_page_shows_the_figures_to_staff_only(
    client: Client,
    admin_user: Any,  # noqa: F811
    user: Any,
    ledger: dict[str, Chat],
) -> None:
    url = "/admin/conversations/chat/fleet/"
    client.force_login(user)
    assert client.get(url).status_code == 302  # not staff: the admin's log-in page
    user.is_staff = True  # staff who may not view chats
    user.save(update_fields=["is_staff"])
    assert client.get(url).status_code == 403
    client.force_login(admin_user)
    page = client.get(url).content.decode()
    assert 'data-figure="committed" data-window="last hour">5<' in page
    assert 'data-figure="superseded" data-window="last day">1<' in page
    assert f"/admin/conversations/chat/{ledger['plain'].pk}/change/" not in page  # all well
    assert "Fleet" in client.get("/admin/conversations/chat/").content.decode()


def test_the_fleet_takes_the_same_queries_for_a_larger_ledger(ledger: dict[str, Chat]) -> None:
    with CaptureQueriesContext(connection) as few:
        fleet()
    for _ in range(50):
        ledger_row(ledger["deep"], FAILED, timedelta(minutes=2))
    with CaptureQueriesContext(connection) as more:
        fleet()
    assert len(more.captured_queries) == len(few.captured_queries)


def test_the_fleet_page_in_a_browser_counts_what_the_ledger_holds(
    live_server: Any, ledger: dict[str, Chat]
) -> None:
    from selenium.webdriver.common.by import By

    Brief.objects.filter(chat=ledger["deep"]).update(degraded=True, consecutive_failures=4)
    with admin_browser(live_server, "fleet-failure.png") as driver:
        driver.find_element(By.LINK_TEXT, "Chats").click()
        driver.find_element(By.CSS_SELECTOR, 'a[href$="/chat/fleet/"]').click()  # object tools
        shown = {
            (cell.get_attribute("data-figure"), cell.get_attribute("data-window")): cell.text
            for cell in driver.find_elements(By.CSS_SELECTOR, "#fleet-folds td[data-figure]")
        }
        now = database_now()
        for label, span in (("last hour", timedelta(hours=1)), ("last day", timedelta(days=1))):
            rows = Consolidation.objects.filter(finished_at__gte=now - span)
            folds = rows.exclude(trigger="edit")
            assert shown[("committed", label)] == str(folds.filter(status=SUCCEEDED).count())
            assert shown[("failed", label)] == str(rows.filter(status=FAILED).count())
            assert shown[("superseded", label)] == str(rows.filter(status=SUPERSEDED).count())
        degraded = driver.find_element(By.CSS_SELECTOR, '#fleet-now td[data-figure="degraded"]')
        assert degraded.text == "1"
        driver.find_element(
            By.CSS_SELECTOR, f'#fleet-attention tr[data-chat="{ledger["deep"].pk}"] a'
        ).click()
        assert f"/admin/conversations/chat/{ledger['deep'].pk}/change/" in driver.current_url
        driver.back()
        assert driver.save_screenshot(str(ARTIFACTS / "fleet.png"))
