"""Large weight files (issue 43): an upload costs its own size on disk once. The body is streamed
to one file in the files directory, checked there by the sandbox (no canonical copy of a
fedsplit-layout file) and renamed into its round; the aggregate weights it by the count the
server recorded. Over the limit: refused with the limit named, nothing half-written left."""

from __future__ import annotations

import hashlib
import shutil
from pathlib import Path
from typing import Any

import numpy as np
import pytest
from fedsplit.protocol import read_weights
from fedsplit.server.admin.errors import InsufficientStorageError, status_of
from fedsplit.server.admin.receive import check_disk_space

from tests.admin.conftest import ADMIN, create_round, post_file, write_model

LIMIT_MB = 4.0
# hidden units of the conftest model (7 float32 per unit) whose file is just under LIMIT_MB
NEAR_LIMIT_HIDDEN = int(LIMIT_MB * 1024 * 1024 * 0.97) // 28


def _files(root: Path) -> dict[str, int]:
    """Every file under ``root`` and its size."""
    return {str(p.relative_to(root)): p.stat().st_size for p in root.rglob("*") if p.is_file()}


def _written() -> int:
    """Bytes this process has handed to write() so far (/proc/self/io wchar): the app runs here."""
    for line in Path("/proc/self/io").read_text().splitlines():
        if line.startswith("wchar:"):
            return int(line.split()[1])
    raise AssertionError("no wchar line in /proc/self/io")


class _Witness:
    """The real sandbox, noting which files the files directory holds while it checks one."""

    def __init__(self, inner: Any, root: Path) -> None:
        self.inner, self.root = inner, root
        self.during: list[dict[str, int]] = []

    def inspect(self, *args: Any) -> Any:
        self.during.append(_files(self.root))
        result = self.inner.inspect(*args)
        self.during.append(_files(self.root))
        return result


def test_an_upload_near_the_limit_is_stored_once(make_client, site_token, tmp_path, data_dir):
    client = make_client(max_upload_mb=LIMIT_MB)
    ctx = client.app.state.admin
    witness = _Witness(ctx.sandbox, data_dir / "files")
    ctx.sandbox = witness
    rnd = create_round(client)
    model = write_model(tmp_path / "big.h5", 0.5, num_examples=10, hidden=NEAR_LIMIT_HIDDEN)
    size = model.stat().st_size
    assert 0.9 * LIMIT_MB * 1024 * 1024 < size < LIMIT_MB * 1024 * 1024
    before_files, before = _files(data_dir / "files"), _written()
    answer = post_file(client, rnd["id"], site_token("hosp-a"), model, num_examples=30)
    written = _written() - before
    assert answer.status_code == 201, answer.text
    # while the sandbox checked it, and after: one file of the upload's size, no second copy
    for seen in witness.during:
        grown = {k: v for k, v in seen.items() if k not in before_files}
        assert list(grown.values()) == [size], grown
    stored = {k: v for k, v in _files(data_dir / "files").items() if k not in before_files}
    assert list(stored.values()) == [size], stored
    (path,) = (data_dir / "files" / k for k in stored)
    assert hashlib.sha256(path.read_bytes()).hexdigest() == answer.json()["sha256"]
    # the bytes written for it: the file once, plus the database and the audit record
    assert size <= written < 1.1 * size, f"{written} bytes written for a {size}-byte upload"

    # the aggregate weights it by the count the server recorded (30), not the file's own (10)
    second = write_model(tmp_path / "b.h5", 1.5, num_examples=10, hidden=NEAR_LIMIT_HIDDEN)
    assert post_file(client, rnd["id"], site_token("hosp-b"), second).status_code == 201
    done = client.post(f"/api/v1/rounds/{rnd['id']}/aggregate", headers=ADMIN)
    assert done.status_code == 200, done.text
    aggregate = read_weights(data_dir / "files" / "rounds" / str(rnd["id"]) / "model.h5")
    assert aggregate.num_examples == 40
    np.testing.assert_allclose(aggregate.arrays["layer.0.bias"][:5], (30 * 0.5 + 10 * 1.5) / 40)


def test_an_upload_over_the_limit_is_refused_and_leaves_nothing(make_client, site_token, tmp_path,
                                                                data_dir):
    client = make_client(max_upload_mb=LIMIT_MB)
    rnd = create_round(client)
    model = write_model(tmp_path / "big.h5", 0.5, hidden=int(NEAR_LIMIT_HIDDEN * 1.1))
    assert model.stat().st_size > LIMIT_MB * 1024 * 1024
    before = _files(data_dir / "files")
    answer = post_file(client, rnd["id"], site_token("hosp-a"), model)
    assert answer.status_code == 413
    assert f"limit of {int(LIMIT_MB * 1024 * 1024)} bytes" in answer.json()["detail"]
    assert "--max-upload-mb" in answer.json()["detail"]
    assert _files(data_dir / "files") == before  # no part file, nothing in the round


def test_an_upload_the_disk_cannot_hold_is_refused_before_its_body(tmp_path):
    """The free-space check (HTTP 507) names the free bytes, the upload's and the fix."""
    free = shutil.disk_usage(tmp_path).free
    check_disk_space(tmp_path, 1024, reserve=0)
    with pytest.raises(InsufficientStorageError) as refused:
        check_disk_space(tmp_path, free + 2**30, reserve=0)
    assert status_of(refused.value) == 507
    assert "--data-dir" in str(refused.value) and f"{free + 2**30} bytes" in str(refused.value)
