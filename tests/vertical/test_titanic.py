"""Titanic with the seed lecture's column groups: the fused model beats each branch alone."""

from __future__ import annotations

from pathlib import Path

import pytest
from fedsplit.orchestration.vertical.datasets import write_titanic
from fedsplit.orchestration.vertical.local import baselines, train_kept
from fedsplit.protocol.vertical.config import FusionParams
from fedsplit.server.vertical.coordinator import read_label_file

TITANIC = Path(__file__).resolve().parents[3] / "shared" / "data" / "titanic" / "train.csv"


@pytest.mark.skipif(not TITANIC.is_file(), reason=f"needs {TITANIC}")
@pytest.mark.slow  # a fresh process or an end-to-end run: seconds (make test)
def test_titanic_fusion_beats_each_branch_alone(tmp_path: Path) -> None:
    files = write_titanic(TITANIC, tmp_path)
    labels = read_label_file(str(files.labels), files.id_column, files.target, None)
    assert len(labels.ids) == 891
    params = FusionParams()
    fused = train_kept(labels, files.sites, files.id_column, params, rounds=8)
    base = baselines(labels, files.sites, files.id_column, params, rounds=8)
    alone = [s.metrics["accuracy"] for s in base.local_only]
    assert fused.test_examples == 178  # 20% of 891 held out, every passenger at both sites
    # every model keeps its best round on the same validation cut of the training rows
    assert fused.metrics["accuracy"] > max(alone)
    assert fused.metrics["accuracy"] >= base.centralized.metrics["accuracy"] - 0.02
