"""Web view fixtures: a real admin app (UI included) over SQLite in tmp_path, sites, signed-in clients."""

from __future__ import annotations

from collections.abc import Callable, Iterator
from pathlib import Path

import pytest
from fastapi.testclient import TestClient
from fedsplit.server.admin.sandbox import Sandbox

from tests.admin.conftest import app_clients, site_tokens
from tests.ui.browser import browser_missing


@pytest.fixture
def runs_dir(tmp_path: Path) -> Path:
    """The folder given as ``--runs``."""
    folder = tmp_path / "runs"
    folder.mkdir()
    return folder


@pytest.fixture
def ui_app(tmp_path: Path, runs_dir: Path, sandbox: Sandbox) -> Iterator[Callable[..., TestClient]]:
    """Factory of TestClients over one data directory with the web view's ``--runs`` set."""
    with app_clients(sandbox, base_url="http://127.0.0.1:8080", data_dir=tmp_path / "admin",
                     runs=(runs_dir,)) as make:
        yield make


@pytest.fixture
def client(ui_app: Callable[..., TestClient]) -> TestClient:
    """An anonymous browser-like client."""
    return ui_app()


@pytest.fixture
def site_token(tmp_path: Path) -> Callable[..., str]:
    """Register a site in the app's store and return its token."""
    return site_tokens(tmp_path / "admin")


def sign_in(client: TestClient, token: str) -> TestClient:
    """Post the sign-in form as the browser would (same origin)."""
    response = client.post("/ui/login", data={"token": token}, follow_redirects=False,
                           headers={"Origin": "http://127.0.0.1:8080", "Sec-Fetch-Site": "same-origin"})
    assert response.status_code == 303, response.text
    assert response.headers["location"] == "/ui"
    return client


@pytest.fixture(scope="module")
def need_browser() -> None:
    """Skips, with the reason, where Debian's Chromium and chromedriver cannot run (the browser
    tests name it first: ``usefixtures`` on a ``browser`` module, or an argument)."""
    reason = browser_missing()
    if reason is not None:
        pytest.skip(reason)
