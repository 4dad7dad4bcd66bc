"""The Django admin for inspecting chats: summary, ledger, context preview, filters, the
"consolidate now" action; and the same walkthrough in headless Chromium (Debian's chromium and
chromium-driver), with a screenshot in artifacts/."""

from __future__ import annotations

import shutil
from pathlib import Path
from typing import Any

import pytest
from django.contrib.auth import get_user_model

from conversations.models import Brief, Chat
from memory_worker.folds import consolidate_once
from tests.conftest import require

ROOT = Path(__file__).resolve().parent.parent
PASSWORD = "admin-pw-123"


@pytest.fixture
def admin_user(db: Any) -> Any:
    return get_user_model().objects.create_superuser("root", "root@example.com", PASSWORD)


def chat_with_summary(api: Any, turns: int = 14) -> Chat:
    body = {"title": "inspected", "policy": "contract"}  # K = 6: folds come early
    chat_id = api.post("/api/v1/chats/", body, format="json").json()["id"]
    for number in range(turns):
        content = f"Remember that the launch code {number} is blue."
        response = api.post(f"/api/v1/chats/{chat_id}/turns/", {"content": content}, format="json")
        assert response.status_code == 201
    consolidate_once(chat_id, "manual")
    assert Brief.objects.get(chat_id=chat_id).last_consolidated > 0
    return Chat.objects.get(pk=chat_id)


@pytest.mark.django_db
def test_chat_page_shows_summary_ledger_and_context(client: Any, admin_user: Any, api: Any) -> None:
    chat = chat_with_summary(api)
    client.force_login(admin_user)
    page = client.get(f"/admin/conversations/chat/{chat.pk}/change/").content.decode()
    brief = Brief.objects.get(chat=chat)
    first_line = brief.summary.splitlines()[0]
    assert first_line in page  # the summary, rendered
    assert "succeeded" in page and "1..6" in page  # the ledger's first fold
    assert "What the model sees next" in page
    last = chat.messages.order_by("-seq").first()
    assert last is not None and last.content[:40] in page  # context preview and history
    assert chat.system_prompt[:40] in page


@pytest.mark.django_db
def test_filters_find_chats_with_many_unfolded_and_degraded(
    client: Any, admin_user: Any, api: Any
) -> None:
    quiet = api.post("/api/v1/chats/", {"title": "quiet-chat"}, format="json").json()["id"]
    lagging = api.post("/api/v1/chats/", {"title": "lagging-chat"}, format="json").json()["id"]
    Chat.objects.filter(pk=lagging).update(last_seq=500)
    Brief.objects.filter(chat_id=quiet).update(degraded=True)
    client.force_login(admin_user)
    listing = client.get("/admin/conversations/chat/?memory=many_unfolded").content.decode()
    assert "lagging-chat" in listing and "quiet-chat" not in listing
    listing = client.get("/admin/conversations/chat/?memory=degraded").content.decode()
    assert "quiet-chat" in listing and "lagging-chat" not in listing


@pytest.mark.django_db
def test_consolidate_now_action(client: Any, admin_user: Any, api: Any, settings: Any) -> None:
    settings.MEMORY_DISPATCH = "off"
    chat_id = api.post("/api/v1/chats/", {"title": "x"}, format="json").json()["id"]
    client.force_login(admin_user)
    response = client.post(
        "/admin/conversations/chat/",
        {"action": "consolidate_now", "_selected_action": [chat_id]},
        follow=True,
    )
    # Dispatch is off here: the action reports honestly that nothing could be queued.
    assert "Queued 0 of 1 consolidation(s); the next one could not" in response.content.decode()


def chromium_driver() -> Any:
    chromium = shutil.which("chromium")
    chromedriver = shutil.which("chromedriver")
    if not chromium or not chromedriver:
        require("Chromium", "install Debian's chromium and chromium-driver (.ci/run does)")
    try:
        from selenium import webdriver
        from selenium.webdriver.chrome.service import Service
    except ImportError as error:
        require("selenium", str(error))
    options = webdriver.ChromeOptions()
    options.binary_location = str(chromium)
    for argument in ("--headless=new", "--no-sandbox", "--disable-dev-shm-usage"):
        options.add_argument(argument)
    options.add_argument("--window-size=1400,2400")
    return webdriver.Chrome(service=Service(str(chromedriver)), options=options)


def test_admin_walkthrough_in_headless_chromium(
    live_server: Any, admin_user: Any, api: Any
) -> None:
    from selenium.webdriver.common.by import By

    chat = chat_with_summary(api)
    brief = Brief.objects.get(chat=chat)
    driver = chromium_driver()
    try:
        driver.implicitly_wait(10)
        driver.get(f"{live_server.url}/admin/login/?next=/admin/")
        driver.find_element(By.NAME, "username").send_keys("root")
        driver.find_element(By.NAME, "password").send_keys(PASSWORD)
        driver.find_element(By.CSS_SELECTOR, "input[type=submit]").click()
        driver.find_element(By.LINK_TEXT, "Chats").click()
        driver.find_element(By.LINK_TEXT, str(chat.pk)).click()
        body = driver.find_element(By.TAG_NAME, "body").text
        assert brief.summary.splitlines()[0].lstrip("#").strip() in body
        assert "succeeded" in body  # the ledger
        assert "What the model sees next" in body
        last = chat.messages.order_by("-seq").first()
        assert last is not None and last.content[:40] in body
        artifacts = ROOT / "artifacts"
        artifacts.mkdir(exist_ok=True)
        assert driver.save_screenshot(str(artifacts / "admin-chat.png"))
    finally:
        driver.quit()


@pytest.mark.django_db
def test_chat_page_shows_daily_notes(client: Any, admin_user: Any, api: Any) -> None:
    from datetime import date

    from memory_worker.daily_notes import Fact, merge_into_note

    chat_id = api.post("/api/v1/chats/", {"title": "noted"}, format="json").json()["id"]
    fact = "The staging password rotates every 30 days."
    merge_into_note(chat_id, date(2026, 11, 23), [1, 2], [Fact(1, "user", fact)], "offline")
    client.force_login(admin_user)
    page = client.get(f"/admin/conversations/chat/{chat_id}/change/").content.decode()
    assert fact in page and "Nov. 23, 2026" in page
