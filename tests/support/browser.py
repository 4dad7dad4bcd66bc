"""The admin in headless Chromium, logged in as a superuser; a failing step's page is kept in
``artifacts/`` (gitignored; CI keeps what is there)."""

from __future__ import annotations

from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path
from typing import Any

from django.contrib.auth import get_user_model

from tests.test_admin import chromium_driver

ARTIFACTS = Path(__file__).resolve().parents[2] / "artifacts"
PASSWORD = "admin-pw-123"


@contextmanager
def admin_browser(live_server: Any, failure: str) -> Iterator[Any]:
    from selenium.webdriver.common.by import By
    from selenium.webdriver.support.ui import WebDriverWait

    get_user_model().objects.create_superuser("root", "root@example.com", PASSWORD)
    driver = chromium_driver()
    ARTIFACTS.mkdir(exist_ok=True)
    try:
        driver.implicitly_wait(2)
        driver.get(f"{live_server.url}/admin/login/?next=/admin/")
        driver.find_element(By.NAME, "username").send_keys("root")
        driver.find_element(By.NAME, "password").send_keys(PASSWORD)
        driver.find_element(By.CSS_SELECTOR, "input[type=submit]").click()
        # Logged in once the admin's index is there: a page asked for before that would race
        # the log-in's redirect, which then replaces it.
        WebDriverWait(driver, 20).until(
            lambda _: (
                driver.find_elements(By.ID, "user-tools")
                and driver.current_url.rstrip("/").endswith("/admin")
            )
        )
        yield driver
    except Exception:
        driver.save_screenshot(str(ARTIFACTS / failure))
        raise
    finally:
        driver.quit()
