"""Vertical fixtures: bundled data cut by columns into site files in a temporary folder."""

from __future__ import annotations

from pathlib import Path

import pytest
from fedsplit.orchestration.vertical.datasets import SiteFiles, write_bundled
from fedsplit.server.vertical.coordinator import LabelTable, read_label_file


@pytest.fixture
def bc_partial(tmp_path: Path) -> tuple[SiteFiles, LabelTable]:
    """Breast cancer, 2 sites, 60% of patients at both (the partial-overlap case)."""
    files = write_bundled("breast-cancer", 2, tmp_path / "bc60", overlap=0.6, seed=0)
    return files, read_label_file(str(files.labels), files.id_column, files.target, None)


@pytest.fixture
def bc_full(tmp_path: Path) -> tuple[SiteFiles, LabelTable]:
    """Breast cancer, 3 sites of 10 columns, every patient at every site."""
    files = write_bundled("breast-cancer", 3, tmp_path / "bc", seed=0)
    return files, read_label_file(str(files.labels), files.id_column, files.target, None)
