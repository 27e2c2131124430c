"""Web view fixtures: a real admin app (UI included) over SQLite in tmp_path, sites, signed-in clients."""

from __future__ import annotations

from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import pytest
from fastapi.testclient import TestClient
from fedsplit.server.admin.app import create_app
from fedsplit.server.admin.config import AdminSettings
from fedsplit.server.admin.sandbox import Sandbox
from fedsplit.server.admin.store import add_site

from tests.admin.conftest import ADMIN_TOKEN


@pytest.fixture(scope="session")
def ui_sandbox() -> Iterator[Sandbox]:
    """One upload sandbox shared by every web-view test app."""
    shared = Sandbox(workers=2, timeout_s=60)
    yield shared
    shared.close()


@pytest.fixture
def runs_dir(tmp_path: Path) -> Path:
    """The folder given as ``--runs``."""
    folder = tmp_path / "runs"
    folder.mkdir()
    return folder


@pytest.fixture
def ui_app(tmp_path: Path, runs_dir: Path, ui_sandbox: Sandbox) -> Iterator[Callable[..., TestClient]]:
    """Factory of TestClients over one data directory with the web view's ``--runs`` set."""
    clients: list[TestClient] = []

    def make(**overrides: Any) -> TestClient:
        values: dict[str, Any] = {"data_dir": tmp_path / "admin", "admin_token": ADMIN_TOKEN,
                                  "max_upload_mb": 1.0, "runs": (runs_dir,)}
        values.update(overrides)
        client = TestClient(create_app(AdminSettings(**values), sandbox=ui_sandbox),
                            base_url="http://127.0.0.1:8080")
        client.__enter__()
        clients.append(client)
        return client

    yield make
    for client in clients:
        client.__exit__(None, None, None)


@pytest.fixture
def client(ui_app: Callable[..., TestClient]) -> TestClient:
    """An anonymous browser-like client."""
    return ui_app()


@pytest.fixture
def site_token(tmp_path: Path) -> Callable[..., str]:
    """Register a site in the app's store and return its token."""

    def make(name: str, cohort_size: int | None = None) -> str:
        return add_site(data_dir=tmp_path / "admin", name=name, cohort_size=cohort_size)

    return make


def sign_in(client: TestClient, token: str) -> TestClient:
    """Post the sign-in form as the browser would (same origin)."""
    response = client.post("/ui/login", data={"token": token}, follow_redirects=False,
                           headers={"Origin": "http://127.0.0.1:8080", "Sec-Fetch-Site": "same-origin"})
    assert response.status_code == 303, response.text
    assert response.headers["location"] == "/ui"
    return client
