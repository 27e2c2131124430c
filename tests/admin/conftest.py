"""Admin API fixtures: a real app over a real SQLite database in tmp_path, sites, weight files."""

from __future__ import annotations

import sqlite3
from collections.abc import Callable, Iterator
from contextlib import ExitStack, contextmanager
from pathlib import Path
from typing import Any

import numpy as np
import pytest
from fastapi.testclient import TestClient
from fedsplit.protocol import Update, write_weights
from fedsplit.server.admin import audit
from fedsplit.server.admin.app import create_app
from fedsplit.server.admin.config import AdminSettings
from fedsplit.server.admin.sandbox import Sandbox
from fedsplit.server.admin.store import add_site

ADMIN_TOKEN = "admin-token-for-tests-0123456789"
#: Host names the test apps answer: TestClient's own and the loopback addresses.
TEST_HOSTS = ("testserver", "localhost", "127.0.0.1", "::1")


@pytest.fixture
def data_dir(tmp_path: Path) -> Path:
    """The admin API's data directory."""
    return tmp_path / "admin-data"


@contextmanager
def app_clients(sandbox: Sandbox, *, base_url: str = "http://testserver",
                **settings: Any) -> Iterator[Callable[..., TestClient]]:
    """Factory of TestClients over a real admin app (admin token `ADMIN_TOKEN`, 1 MiB uploads,
    then ``settings``, then each call's overrides); every client made is closed on leaving."""
    with ExitStack() as clients:

        def make(**overrides: Any) -> TestClient:
            values = {"admin_token": ADMIN_TOKEN, "max_upload_mb": 1.0, **settings, **overrides}
            app = create_app(AdminSettings(**values), sandbox=sandbox)
            return clients.enter_context(TestClient(app, base_url=base_url))

        yield make


@pytest.fixture
def make_client(data_dir: Path, sandbox: Sandbox) -> Iterator[Callable[..., TestClient]]:
    """Factory of TestClients over one data directory (settings overridable)."""
    with app_clients(sandbox, data_dir=data_dir, allowed_hosts=TEST_HOSTS) as make:
        yield make


@pytest.fixture
def client(make_client: Callable[..., TestClient]) -> TestClient:
    """A TestClient with a 1 MiB upload limit."""
    return make_client()


@pytest.fixture
def site_token(data_dir: Path) -> Callable[..., str]:
    """Register a site (through the same store the CLI uses) and return its token."""

    def make(name: str, cohort_size: int | None = None) -> str:
        return add_site(data_dir=data_dir, name=name, cohort_size=cohort_size)

    return make


def bearer(token: str) -> dict[str, str]:
    """Authorization header."""
    return {"Authorization": f"Bearer {token}"}


ADMIN = bearer(ADMIN_TOKEN)


def model_arrays(value: float = 0.0, *, hidden: int = 3) -> dict[str, np.ndarray]:
    """A tiny two-layer model filled with ``value``."""
    return {
        "layer.0.weight": np.full((hidden, 4), value, dtype=np.float32),
        "layer.0.bias": np.full((hidden,), value, dtype=np.float32),
        "layer.1.weight": np.full((2, hidden), value, dtype=np.float32),
    }


def write_model(path: Path, value: float = 0.0, *, num_examples: int = 10, **fields: Any) -> Path:
    """A valid fedsplit weight file."""
    hidden = fields.pop("hidden", 3)
    return write_weights(
        Update(arrays=model_arrays(value, hidden=hidden), num_examples=num_examples, **fields), path
    )


def create_round(client: TestClient, **body: Any) -> dict[str, Any]:
    """POST a round as admin and return it."""
    response = client.post("/api/v1/rounds", json={"strategy": "fedavg", **body}, headers=ADMIN)
    assert response.status_code == 201, response.text
    return response.json()


def post_file(
    client: TestClient, round_id: int, token: str, path: Path, num_examples: int | str | None = None
) -> Any:
    """Upload ``path`` as multipart to a round."""
    data = {"num_examples": str(num_examples)} if num_examples is not None else None
    with open(path, "rb") as fh:
        return client.post(
            f"/api/v1/rounds/{round_id}/uploads",
            files={"file": (path.name, fh, "application/x-hdf5")},
            data=data,
            headers=bearer(token),
        )


def verify_audit(data_dir: Path, capsys: pytest.CaptureFixture[str], *extra: str) -> tuple[int, str]:
    """`fedsplit admin audit verify`'s exit code and what it printed."""
    from fedsplit.cli.app import app as fedsplit_app
    from fedsplit.cli.errors import run_guarded

    code = run_guarded(fedsplit_app, ["admin", "audit", "verify", "--data-dir", str(data_dir), *extra])
    captured = capsys.readouterr()
    return code, captured.out + captured.err


def forge_audit_record(data_dir: Path, *, mac: str | None = None) -> int:
    """Append a record as someone with the database but not the key (hash recomputed); its id."""
    with sqlite3.connect(data_dir / "fedsplit-admin.db") as db:
        last_id, last_hash = db.execute("SELECT id, hash FROM audit_log ORDER BY id DESC LIMIT 1").fetchone()
        fields = {"id": last_id + 1, "at": "2026-12-04T00:00:00.000000+00:00", "event": "signin",
                  "actor": "admin", "site_id": None, "address": "127.0.0.1", "detail": "{}",
                  "prev_hash": last_hash}
        db.execute("INSERT INTO audit_log (id, at, event, actor, site_id, address, detail, prev_hash, "
                   "hash, mac) VALUES (:id, :at, :event, :actor, :site_id, :address, :detail, "
                   ":prev_hash, :hash, :mac)", {**fields, "hash": audit.record_hash(fields), "mac": mac})
    return last_id + 1


def post_not_hdf5(client: TestClient, round_id: int, token: str, path: Path) -> Any:
    """Write 128 bytes of text (no HDF5 signature) to ``path`` and upload it: refused with 422."""
    path.write_bytes(b"not an hdf5 file" * 8)
    response = post_file(client, round_id, token, path)
    assert response.status_code == 422, response.text
    return response
