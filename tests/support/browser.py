"""Debian's headless Chromium for the browser tests, and the admin in it logged in as a
superuser; a failing step's page is kept in ``artifacts/`` (gitignored; CI keeps what is there)."""

from __future__ import annotations

import shutil
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path
from typing import Any

from django.contrib.auth import get_user_model

from tests.conftest import require

ARTIFACTS = Path(__file__).resolve().parents[2] / "artifacts"
PASSWORD = "admin-pw-123"


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
