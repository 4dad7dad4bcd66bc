"""The self-hoster's first hour, in headless Chromium (the driver tests/test_admin.py uses): log
in, open Swagger UI (/api/v1/docs/) and press "Try it out" then "Execute", changing nothing but
the chat's id, on creating a chat, a turn, the brief, a rename and (authorized with a token, as
OpenAI clients are) ``/v1/chat/completions``; each answers 2xx. Then the admin: log in, open a
chat that has had a fold, and see its summary once, each history row marked folded or verbatim,
and the line saying when the next fold is due.

Screenshots are kept in ``artifacts/`` at the repository's root (gitignored; CI keeps what is
there): ``first-hour-<operationId>.png`` for each Swagger answer, ``first-hour-admin-chat.png``
for the admin's chat page, ``first-hour-failure.png`` for the page a failed step left."""

from __future__ import annotations

from typing import Any

import pytest
from rest_framework.authtoken.models import Token

from conversations.models import Brief, Chat, Message
from tests.support.browser import ARTIFACTS, admin_browser, chromium_driver
from tests.test_admin import chat_with_summary

pytestmark = pytest.mark.django_db

PASSWORD = "pw-alice-123"  # tests/conftest.py's user


def find_operation(driver: Any, operation_id: str) -> Any:
    """Swagger UI renders only the operations near the viewport: scroll down until this one is
    there. Its element id is "operations-<tag>-<operationId>", the tag CSS-escaped."""
    from selenium.webdriver.common.by import By

    selector = f'.opblock[id$="-{operation_id}"]'
    for _ in range(60):
        found = driver.find_elements(By.CSS_SELECTOR, selector)
        if found:
            return found[0]
        driver.execute_script("window.scrollBy(0, 600)")
    shown = [e.get_attribute("id") for e in driver.find_elements(By.CSS_SELECTOR, ".opblock")]
    raise AssertionError(f"no operation {operation_id} on the page, only {shown}")


def try_it_out(driver: Any, operation_id: str, chat_id: int | None = None) -> str:
    """Expands the operation, presses "Try it out", fills in the path's id if given, presses
    "Execute"; returns the live response's status code."""
    from selenium.webdriver.common.by import By
    from selenium.webdriver.support import expected_conditions as ready
    from selenium.webdriver.support.ui import WebDriverWait

    wait = WebDriverWait(driver, 20)
    wait.until(ready.presence_of_element_located((By.CSS_SELECTOR, ".opblock")))
    block = find_operation(driver, operation_id)
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

        authorize(driver, Token.objects.create(user=user).key)
        assert try_it_out(driver, "chat_completions_create") == "200"
        assert Message.objects.filter(chat__owner=user, content="Hello").count() == 2
    except Exception:
        ARTIFACTS.mkdir(exist_ok=True)  # what the page showed when a step failed
        driver.save_screenshot(str(ARTIFACTS / "first-hour-failure.png"))
        raise
    finally:
        driver.quit()


def authorize(driver: Any, token: str) -> None:
    """Swagger UI's Authorize dialog: the token as bearerAuth, as /v1 takes it."""
    from selenium.webdriver.common.by import By
    from selenium.webdriver.support.ui import WebDriverWait

    wait = WebDriverWait(driver, 20)
    driver.execute_script("window.scrollTo(0, 0)")
    driver.find_element(By.CSS_SELECTOR, "button.authorize").click()
    field = wait.until(
        lambda _: driver.find_elements(By.CSS_SELECTOR, 'input[aria-label="auth-bearer-value"]')
    )[0]
    field.send_keys(token)
    field.find_element(By.XPATH, "./ancestor::form").find_element(
        By.CSS_SELECTOR, "button[type=submit]"
    ).click()
    driver.find_element(By.CSS_SELECTOR, "button.btn-done").click()


def test_the_admin_shows_a_folded_chats_memory_once_and_plainly(live_server: Any, api: Any) -> None:
    from selenium.webdriver.common.by import By

    chat = chat_with_summary(api)  # a contract chat whose turns and a manual fold folded it
    brief = Brief.objects.get(chat=chat)
    with admin_browser(live_server, "first-hour-failure.png") as driver:
        driver.find_element(By.LINK_TEXT, "Chats").click()
        driver.find_element(By.LINK_TEXT, str(chat.pk)).click()
        summaries = driver.find_elements(By.CSS_SELECTOR, ".chatmem-summary")
        assert len(summaries) == 1
        first_line = brief.summary.splitlines()[0].lstrip("#").strip()
        assert first_line in summaries[0].text
        assert driver.page_source.count('chatmem-summary"') == 1
        body = driver.find_element(By.TAG_NAME, "body").text
        assert f"{brief.summary_tokens:,} / " in body  # its tokens against the cap
        rows = driver.find_elements(By.CSS_SELECTOR, ".chatmem-table tr")
        marks = [row.find_elements(By.TAG_NAME, "td") for row in rows]
        marked = {cells[1].text for cells in marks if len(cells) > 2}
        assert {"folded", "verbatim"} <= marked
        assert "next fold: when" in body or "due now:" in body
        assert "succeeded" in body  # the ledger
        assert "What the model sees next" in body
        last = chat.messages.order_by("-seq").first()
        assert last is not None and last.content[:40] in body
        assert driver.save_screenshot(str(ARTIFACTS / "first-hour-admin-chat.png"))
