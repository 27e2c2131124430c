"""The overlap report, the warning under 30% and the refusal under the floor."""

from __future__ import annotations

import logging
from pathlib import Path

import numpy as np
import pandas as pd
import pytest
from fedsplit.orchestration.vertical.local import local_coordinator
from fedsplit.protocol.vertical.config import FusionParams
from fedsplit.server.vertical.coordinator import OverlapError, encode_labels


def _files(tmp_path: Path, shared: int) -> tuple[list[Path], object]:
    ids = [f"id{i}" for i in range(100)]
    labels = encode_labels(ids, np.array([i % 2 for i in range(100)]), None)
    a = pd.DataFrame({"pid": ids, "x": np.arange(100.0)})
    b = pd.DataFrame({"pid": ids[:shared] + [f"other{i}" for i in range(50)], "z": np.arange(shared + 50.0)})
    a.to_csv(tmp_path / "a.csv", index=False)
    b.to_csv(tmp_path / "b.csv", index=False)
    return [tmp_path / "a.csv", tmp_path / "b.csv"], labels


def test_refuses_under_the_floor_and_says_why(tmp_path: Path) -> None:
    files, labels = _files(tmp_path, 15)
    coord, _ = local_coordinator(labels, files, "pid", FusionParams())
    with pytest.raises(OverlapError, match=r"site-1.*fewer than 20%.*little to stand on.*Received: "
                                           r"\[\('site-1', 0.15\)\]"):
        coord.align()


def test_warns_under_30_percent_and_reports_every_site(tmp_path: Path, caplog) -> None:
    files, labels = _files(tmp_path, 25)
    coord, _ = local_coordinator(labels, files, "pid", FusionParams())
    with caplog.at_level(logging.WARNING):
        report = coord.align()
    assert [(o.site, o.shared, o.status) for o in report] == [("site-0", 100, "ok"),
                                                                       ("site-1", 25, "low")]
    assert report[1].share_of_site == pytest.approx(25 / 75, abs=1e-3)
    assert "site-1 shares only 25.0%" in caplog.text


def test_floor_is_configurable(tmp_path: Path) -> None:
    files, labels = _files(tmp_path, 15)
    coord, _ = local_coordinator(labels, files, "pid", FusionParams(min_overlap=0.1))
    assert coord.align()[1].shared == 15
