"""Web view fixtures: a real admin app (UI included) over SQLite in tmp_path, sites, signed-in clients."""

from __future__ import annotations

from collections.abc import Callable, Iterator
from pathlib import Path

import pytest
from fastapi.testclient import TestClient
from fedsplit.server.admin.sandbox import Sandbox

# the admin tests' client and site_token fixtures, over this folder's make_client and data_dir
from tests.admin.conftest import app_clients, client, site_token  # noqa: F401
from tests.ui.browser import browser_missing


@pytest.fixture
def runs_dir(tmp_path: Path) -> Path:
    """The folder given as ``--runs``."""
    folder = tmp_path / "runs"
    folder.mkdir()
    return folder


@pytest.fixture
def data_dir(tmp_path: Path) -> Path:
    """The web view's admin API data directory."""
    return tmp_path / "admin"


@pytest.fixture
def make_client(data_dir: Path, runs_dir: Path, sandbox: Sandbox) -> Iterator[Callable[..., TestClient]]:
    """Factory of TestClients over one data directory with the web view's ``--runs`` set (the
    admin tests' ``client`` and ``site_token`` fixtures use it here)."""
    with app_clients(sandbox, base_url="http://127.0.0.1:8080", data_dir=data_dir,
                     runs=(runs_dir,)) as make:
        yield make


def sign_in(anonymous: TestClient, token: str) -> TestClient:
    """Post the sign-in form as the browser would (same origin); the client, now signed in."""
    response = anonymous.post("/ui/login", data={"token": token}, follow_redirects=False,
                           headers={"Origin": "http://127.0.0.1:8080", "Sec-Fetch-Site": "same-origin"})
    assert response.status_code == 303, response.text
    assert response.headers["location"] == "/ui"
    return anonymous


@pytest.fixture(scope="module")
def need_browser() -> None:
    """Skips, with the reason, where Debian's Chromium and chromedriver cannot run (the browser
    tests name it first: ``usefixtures`` on a ``browser`` module, or an argument)."""
    reason = browser_missing()
    if reason is not None:
        pytest.skip(reason)
