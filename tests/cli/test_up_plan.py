"""`fedsplit up`'s sequencing (orchestration.up): what it refuses before any process starts."""

from __future__ import annotations

from pathlib import Path

import pytest
from fedsplit.cli.app import app
from fedsplit.cli.errors import run_guarded
from fedsplit.orchestration.up import UpPlan, run_up
from fedsplit.protocol.config import RunConfig
from fedsplit.protocol.errors import ConfigError


def test_a_rule_secure_aggregation_cannot_run_stops_before_any_data_or_process(tmp_path: Path,
                                                                              capsys) -> None:
    cfg = RunConfig(strategy="krum", secure_aggregation="on", out_dir=str(tmp_path / "out"))
    with pytest.raises(ConfigError, match="krum cannot run with secure aggregation"):
        run_up(UpPlan(cfg=cfg, work=tmp_path / "work"))
    assert not (tmp_path / "work").exists()
    code = run_guarded(app, ["up", "--work", str(tmp_path / "w2"), "--strategy", "median",
                             "--secure-aggregation", "on"])
    assert code == ConfigError.exit_code and "masked sum" in capsys.readouterr().err
    assert not (tmp_path / "w2").exists()

