"""What a site's data file holds, as the runners record it for resume checks."""

from __future__ import annotations

import io
import json
from pathlib import Path

import numpy as np
import pytest
from fedsplit.orchestration.experiment import Experiment, stage_sites
from fedsplit.orchestration.fingerprint import data_fingerprint, fingerprint_bytes, fingerprint_file
from fedsplit.protocol.config import RunConfig
from fedsplit.protocol.errors import ConfigError


def _npz(compressed: bool = False, **arrays: np.ndarray) -> bytes:
    buffer = io.BytesIO()
    (np.savez_compressed if compressed else np.savez)(buffer, **arrays)
    return buffer.getvalue()


def test_csv_rows_columns_and_hash_of_the_bytes(tmp_path: Path) -> None:
    path = tmp_path / "data.csv"
    path.write_text("a,b,target\n1,2,0\n3,4,1\n")
    fp = fingerprint_file(path)
    assert fp["rows"] == 2 and fp["columns"] == 3
    path.write_text("a,b,target\n1,2,0\n3,5,1\n")  # one value edited
    assert fingerprint_file(path)["sha256"] != fp["sha256"]
    assert {k: v for k, v in fingerprint_file(path).items() if k != "sha256"} == {"rows": 2, "columns": 3}


def test_npz_hash_follows_the_arrays_not_the_zip_container(rng: np.random.Generator) -> None:
    x, y = rng.normal(size=(5, 8, 8)).astype(np.float32), np.arange(5)
    first = _npz(x=x, y=y)
    second = _npz(compressed=True, x=x, y=y)
    assert first != second  # the container differs ...
    fp = fingerprint_bytes("data.npz", first)
    assert fingerprint_bytes("data.npz", second) == fp  # ... the fingerprint does not
    assert fp["rows"] == 5 and fp["columns"] == 64
    assert fingerprint_bytes("data.npz", _npz(x=x, y=y[::-1].copy()))["sha256"] != fp["sha256"]
    assert fingerprint_bytes("data.npz", _npz(x=x.astype(np.float64), y=y))["sha256"] != fp["sha256"]


@pytest.mark.parametrize(
    ("name", "content"),
    [
        ("data.txt", b"a,b\n"),  # not a site data file type
        ("data.npz", b"not a zip"),  # unreadable
        ("data.npz", None),  # no x array
    ],
)
def test_unreadable_files_are_refused(name: str, content: bytes | None) -> None:
    content = _npz(features=np.zeros((2, 2))) if content is None else content
    with pytest.raises(ConfigError, match=rf"Received: {name}"):
        fingerprint_bytes(name, content)


def test_the_runner_records_each_site_and_reruns_match(tmp_path: Path) -> None:
    """stage_sites writes site-i/ and records their fingerprint; the same command gives the same one."""
    exp = Experiment(cfg=RunConfig(), out=tmp_path, dataset="wine", num_sites=2, partition="sizes:40,60")
    cfg, sites, _ = stage_sites(exp)
    # the run config names the roster; the coordinator reads the fingerprint back inline
    assert cfg.data_fingerprint == "{}" and cfg.site_names == "[]"
    assert Path(cfg.site_roster) == tmp_path / "sites" / "roster.json"
    inline = cfg.with_roster()
    recorded = json.loads(inline.data_fingerprint)
    assert sorted(recorded) == ["site-0", "site-1"] == cfg.names
    # sizes are each hospital's share; a fifth of it is its own test patients
    assert [recorded[f"site-{i}"]["rows"] for i in range(2)] == [len(s) for s in sites] == [32, 48]
    assert recorded == data_fingerprint(
        {f"site-{i}": tmp_path / "sites" / f"site-{i}" / "data.csv" for i in range(2)})
    again, _, _ = stage_sites(exp)
    assert again.with_roster().data_fingerprint == inline.data_fingerprint
    other, _, _ = stage_sites(Experiment(cfg=RunConfig(seed=1), out=tmp_path / "b", dataset="wine",
                                         num_sites=2, partition="sizes:40,60"))
    assert other.with_roster().data_fingerprint != inline.data_fingerprint
