"""A hospital reports nothing computed on fewer patients than its policy's ``min_rows``
(issue 40): a run config whose val-fraction leaves one training row would make its feature sums
that patient's values, and one held-out row its accuracy that patient's label."""

from __future__ import annotations

from pathlib import Path

import pytest
from fedsplit.client.node_config import NodeConfig
from fedsplit.client.site import load_site
from fedsplit.protocol.config import RunConfig
from fedsplit.protocol.site_policy import PolicyRefusal


def _table(path: Path, rows: int) -> Path:
    # a continuous target: no label rule stands between the split and the row rule
    path.write_text("age,target\n" + "".join(f"{30 + i},{1.5 * i + 0.25}\n" for i in range(rows)))
    return path


@pytest.mark.parametrize("val_fraction", [0.95, 0.05])
def test_a_split_that_isolates_a_patient_is_refused(tmp_path: Path, val_fraction: float) -> None:
    data = _table(tmp_path / "north.csv", 60)
    cfg = RunConfig(target="target", val_fraction=val_fraction, task="regression")
    with pytest.raises(PolicyRefusal) as refused:
        load_site(NodeConfig(data_path=str(data), site_name="north"), 1, cfg)
    line = str(refused.value)
    assert "fewer than 5 patients (its policy's min_rows)" in line and "\n" not in line
    assert "val-fraction" in line


def test_the_hospital_may_lower_it_and_a_normal_split_passes(tmp_path: Path) -> None:
    data = _table(tmp_path / "north.csv", 60)
    policy = tmp_path / "policy.toml"
    policy.write_text("min_rows = 1\n")
    cfg = RunConfig(target="target", val_fraction=0.95, task="regression")
    site = load_site(NodeConfig(data_path=str(data), site_name="north", policy=str(policy)), 1, cfg)
    assert len(site.train) >= 1
    normal = load_site(NodeConfig(data_path=str(data), site_name="north"), 1,
                       RunConfig(target="target", task="regression"))
    assert len(normal.train) >= 5 and len(normal.val) >= 5
