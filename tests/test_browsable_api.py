"""The browsable API: a logged-in browser gets HTML pages with forms; a token client (no
Accept, */*, or application/json) still gets JSON; session writes need the CSRF token."""

from typing import Any

import pytest
from django.test import Client

from conversations.models import Chat

pytestmark = pytest.mark.django_db

BROWSER_ACCEPT = "text/html,application/xhtml+xml,application/xml;q=0.9,*/*;q=0.8"


@pytest.fixture
def browser(user: Any) -> Client:
    client = Client(enforce_csrf_checks=True)
    client.force_login(user)
    return client


def test_a_logged_in_browser_gets_the_browsable_api(browser: Client, api: Any) -> None:
    chat_id = api.post("/api/v1/chats/", {"title": "seen in HTML"}, format="json").json()["id"]
    page = browser.get(f"/api/v1/chats/{chat_id}/", HTTP_ACCEPT=BROWSER_ACCEPT)
    assert page.status_code == 200
    assert page["Content-Type"].startswith("text/html")
    html = page.content.decode()
    assert "seen in HTML" in html and "PATCH" in html and "csrfmiddlewaretoken" in html


@pytest.mark.parametrize("accept", [None, "*/*", "application/json"])
def test_token_clients_still_get_json(api: Any, accept: str | None) -> None:
    headers = {} if accept is None else {"HTTP_ACCEPT": accept}
    response = api.get("/api/v1/chats/", **headers)
    assert response.status_code == 200
    assert response["Content-Type"] == "application/json"
    assert response.json()["count"] == 0


def test_a_session_write_without_the_csrf_token_is_refused(browser: Client) -> None:
    response = browser.post("/api/v1/chats/", {"title": "forged"}, content_type="application/json")
    assert response.status_code == 403
    assert "CSRF" in response.json()["detail"]
    assert Chat.objects.count() == 0


def test_the_login_page_for_the_browsable_api_is_served(client: Any, db: Any) -> None:
    response = client.get("/api-auth/login/?next=/api/v1/chats/")
    assert response.status_code == 200
    assert 'name="username"' in response.content.decode()


def test_an_anonymous_browser_gets_a_401_page_with_a_login_link(client: Any, db: Any) -> None:
    response = client.get("/api/v1/chats/", HTTP_ACCEPT=BROWSER_ACCEPT)
    assert response.status_code == 401
    assert "/api-auth/login/" in response.content.decode()
