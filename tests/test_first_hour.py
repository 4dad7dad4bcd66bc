"""The self-hoster's first hour, in headless Chromium (the driver tests/test_admin.py uses): log
in, open Swagger UI (/api/v1/docs/) and press "Try it out" then "Execute", changing nothing but
the chat's id, on creating a chat, a turn, the brief and a rename; each answers 2xx. A
screenshot of each answer is kept in artifacts/ (first-hour-*.png)."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import pytest

from conversations.models import Brief, Chat, Message
from tests.test_admin import chromium_driver

pytestmark = pytest.mark.django_db

ROOT = Path(__file__).resolve().parent.parent
ARTIFACTS = ROOT / "artifacts"
PASSWORD = "pw-alice-123"  # tests/conftest.py's user


def try_it_out(driver: Any, operation_id: str, chat_id: int | None = None) -> str:
    """Expands the operation, presses "Try it out", fills in the path's id if given, presses
    "Execute"; returns the live response's status code."""
    from selenium.webdriver.common.by import By
    from selenium.webdriver.support import expected_conditions as ready
    from selenium.webdriver.support.ui import WebDriverWait

    wait = WebDriverWait(driver, 20)
    block = wait.until(
        ready.presence_of_element_located((By.ID, f"operations-chats-{operation_id}"))
    )
    driver.execute_script("arguments[0].scrollIntoView()", block)
    block.find_element(By.CSS_SELECTOR, ".opblock-summary").click()
    wait.until(lambda _: block.find_elements(By.CSS_SELECTOR, "button.try-out__btn"))
    block.find_element(By.CSS_SELECTOR, "button.try-out__btn").click()
    if chat_id is not None:
        block.find_element(By.CSS_SELECTOR, 'tr[data-param-name="id"] input').send_keys(
            str(chat_id)
        )
    block.find_element(By.CSS_SELECTOR, "button.execute").click()
    status = wait.until(
        lambda _: block.find_elements(
            By.CSS_SELECTOR, ".live-responses-table .response .response-col_status"
        )
    )[0]
    driver.execute_script("arguments[0].scrollIntoView()", status)
    ARTIFACTS.mkdir(exist_ok=True)
    assert driver.save_screenshot(str(ARTIFACTS / f"first-hour-{operation_id}.png"))
    return str(status.text).strip()


def test_swagger_try_it_out_creates_a_chat_takes_a_turn_and_reads_the_brief(
    live_server: Any, user: Any
) -> None:
    from selenium.webdriver.common.by import By

    driver = chromium_driver()
    try:
        driver.implicitly_wait(2)
        # Session login (the browsable API's page): Swagger UI then sends the session cookie
        # and the CSRF token with its requests.
        driver.get(f"{live_server.url}/api-auth/login/?next=/api/v1/docs/")
        driver.find_element(By.NAME, "username").send_keys(user.username)
        driver.find_element(By.NAME, "password").send_keys(PASSWORD)
        driver.find_element(By.CSS_SELECTOR, "[type=submit]").click()

        assert try_it_out(driver, "chats_create") == "201"
        chat = Chat.objects.get(owner=user)
        assert chat.title == "Trip planning"  # the first example, as it stands
        assert try_it_out(driver, "chats_turns_create", chat.pk) == "201"
        stored = list(Message.objects.filter(chat=chat).values_list("seq", "role", "content"))
        assert stored[0] == (1, "user", "Hello") and stored[1][:2] == (2, "assistant")
        assert try_it_out(driver, "chats_brief_retrieve", chat.pk) == "200"
        assert Brief.objects.filter(chat=chat).exists()
        assert try_it_out(driver, "chats_partial_update", chat.pk) == "200"
        assert Chat.objects.get(pk=chat.pk).title == "Trip planning (Lisbon)"
    except Exception:
        ARTIFACTS.mkdir(exist_ok=True)  # what the page showed when a step failed
        driver.save_screenshot(str(ARTIFACTS / "first-hour-failure.png"))
        raise
    finally:
        driver.quit()
