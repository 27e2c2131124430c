"""The simulation roster: the run config stays small however many hospitals, and the coordinator
still records and compares every hospital's name and data fingerprint."""

from __future__ import annotations

import json
import os
from pathlib import Path

import pytest
from fedsplit.protocol.config import RunConfig
from fedsplit.protocol.errors import ConfigError
from fedsplit.protocol.roster import ROSTER_FILE, read_roster, write_roster
from fedsplit.server.history import data_changes


def _hospitals(n: int, rows: int = 40) -> tuple[list[str], dict[str, dict[str, object]]]:
    names = [f"hospital-{i}" for i in range(n)]
    return names, {name: {"rows": rows, "columns": 9, "sha256": f"{i:064x}"}
                   for i, name in enumerate(names)}


def _config(folder: Path, n: int, rows: int = 40) -> RunConfig:
    path = write_roster(folder, *_hospitals(n, rows))
    return RunConfig(data_dir=str(folder), site_roster=str(path))


def test_the_run_config_does_not_grow_with_the_hospitals(tmp_path: Path) -> None:
    few, many = _config(tmp_path / "a", 3), _config(tmp_path / "b", 1000)
    size = [len(json.dumps(c.to_flower())) for c in (few, many)]
    assert size[0] == size[1] < 4000
    # the same hospitals inline: what the roster keeps out of every message
    assert len(json.dumps(many.with_roster().to_flower())) > 100_000


def test_names_and_fingerprints_read_back_from_the_roster(tmp_path: Path) -> None:
    cfg = _config(tmp_path, 5)
    names, prints = _hospitals(5)
    assert cfg.names == names
    inline = cfg.with_roster()
    assert json.loads(inline.site_names) == names and inline.names == names
    assert json.loads(inline.data_fingerprint) == prints
    assert RunConfig().with_roster() == RunConfig()  # nothing to inline
    assert RunConfig(site_names='["x"]', site_roster=cfg.site_roster).names == ["x"]  # inline wins


def test_a_resume_against_other_data_names_the_hospital(tmp_path: Path) -> None:
    before = json.loads(_config(tmp_path / "a", 4).with_roster().data_fingerprint)
    after = json.loads(_config(tmp_path / "b", 4, rows=38).with_roster().data_fingerprint)
    assert data_changes(before, after) == [f"hospital-{i}: rows 40 -> 38" for i in range(4)]
    assert data_changes(before, before) == []


def test_a_rewritten_roster_is_read_again(tmp_path: Path) -> None:
    path = write_roster(tmp_path, ["a"], {})
    assert read_roster(path).site_names == ["a"]
    stat = path.stat()
    write_roster(tmp_path, ["a", "b"], {})
    os.utime(path, ns=(stat.st_atime_ns, stat.st_mtime_ns + 1_000_000))
    assert read_roster(path).site_names == ["a", "b"]
    assert not [p for p in tmp_path.iterdir() if p.name != ROSTER_FILE]  # nothing half-written


def test_a_missing_or_broken_roster_says_what_to_do(tmp_path: Path) -> None:
    missing = tmp_path / ROSTER_FILE
    with pytest.raises(ConfigError, match=r"cannot be read .*rerun the simulation.*Received: "
                                          r"site-roster="):
        RunConfig(site_roster=str(missing)).with_roster()
    missing.write_text('{"site-names": "not a list"}')
    with pytest.raises(ConfigError, match=r"is not a roster file .*Received: site-roster="):
        read_roster(missing)
    with pytest.raises(ValueError, match="rows"):
        write_roster(tmp_path, ["a"], {"a": {"rows": -1, "columns": 2, "sha256": "0"}})
