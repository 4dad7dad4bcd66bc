"""Swagger UI (/api/v1/docs/) and the admin need their static files, and gunicorn serves none of
its own: WhiteNoise serves them, in the image or a checkout, with DEBUG off as in production (the
tests run with DEBUG off)."""

from __future__ import annotations

import re
import subprocess
import sys
from pathlib import Path
from typing import Any

import pytest
from django.core.management import call_command
from django.test import Client

pytestmark = pytest.mark.django_db

ROOT = Path(__file__).resolve().parent.parent
SWAGGER_CSS = "/static/drf_spectacular_sidecar/swagger-ui-dist/swagger-ui.css"


def assets_of_the_docs_page(client: Client) -> list[str]:
    page = client.get("/api/v1/docs/")
    assert page.status_code == 200
    assets = re.findall(r'(?:href|src)="(/static/[^"]+)"', page.content.decode())
    assert any(asset.endswith("swagger-ui-bundle.js") for asset in assets), assets
    return assets


def served(client: Client, path: str) -> bytes:
    response = client.get(path)
    assert response.status_code == 200, (path, response.status_code)
    return b"".join(response.streaming_content)  # type: ignore[attr-defined]


def test_a_checkout_serves_swagger_ui_and_the_admin_from_the_installed_apps(
    settings: Any,
) -> None:
    """Nothing collected (runserver, serve_demo, gunicorn from the source tree, the tests)."""
    nothing_collected = not Path(settings.STATIC_ROOT).is_dir()
    assert settings.WHITENOISE_USE_FINDERS is nothing_collected
    settings.WHITENOISE_USE_FINDERS = True
    client = Client()
    for asset in assets_of_the_docs_page(client):
        assert served(client, asset)
    assert b"swagger-ui" in served(client, SWAGGER_CSS)
    assert served(client, "/static/admin/css/base.css")


def test_the_image_serves_what_collectstatic_collected(settings: Any, tmp_path: Path) -> None:
    """The Dockerfile runs collectstatic into STATIC_ROOT; the files come from there."""
    settings.STATIC_ROOT = str(tmp_path / "static")
    settings.WHITENOISE_USE_FINDERS = False
    call_command("collectstatic", interactive=False, verbosity=0)
    client = Client()
    for asset in assets_of_the_docs_page(client):
        assert served(client, asset)
    assert served(client, "/static/admin/css/base.css")
    assert client.get("/static/nothing-here.css").status_code == 404


def test_the_image_collects_them_and_whitenoise_is_a_dependency() -> None:
    dockerfile = (ROOT / "Dockerfile").read_text()
    assert re.search(r"^RUN .*manage\.py collectstatic --noinput", dockerfile, re.M)
    pyproject = (ROOT / "pyproject.toml").read_text()
    assert re.search(r'^\s+"whitenoise>=', pyproject, re.M)


def test_a_checkout_without_collected_files_warns_of_nothing(tmp_path: Path) -> None:
    """WhiteNoise warns about a missing STATIC_ROOT in every process; the finders serve then."""
    script = (
        "import django, warnings; django.setup(); warnings.simplefilter('error');"
        "from conversations.middleware import StaticFilesMiddleware;"
        "m = StaticFilesMiddleware(lambda request: None);"
        f"print(m.use_finders, {SWAGGER_CSS!r} in m.files)"
    )
    env = {
        "PATH": "/usr/bin:/bin",
        "DJANGO_SETTINGS_MODULE": "chatmem_project.settings",
        "STATIC_ROOT": str(tmp_path / "never-collected"),
        "DATABASE_URL": f"sqlite:///{tmp_path}/static.sqlite3",
    }
    result = subprocess.run(
        [sys.executable, "-c", script],
        cwd=ROOT,
        env=env,
        capture_output=True,
        text=True,
        timeout=60,
    )
    assert result.returncode == 0, result.stderr
    assert result.stdout.split() == ["True", "True"]
