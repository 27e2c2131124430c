"""`fedsplit simulate`'s cross-option checks live in RunConfig and Experiment: constructing
either refuses a bad combination with a message that says how to fix it."""

from __future__ import annotations

from pathlib import Path

import pytest
from fedsplit.cli.app import app
from fedsplit.cli.errors import run_guarded
from fedsplit.client.data import HEART, HEART_HOSPITALS
from fedsplit.orchestration.experiment import Experiment
from fedsplit.protocol.config import RunConfig
from fedsplit.protocol.errors import ConfigError


def test_run_config_writes_privacy_specs_canonically() -> None:
    cfg = RunConfig.from_flower({"num-server-rounds": 7, "dp": "epsilon=2,delta=1e-4",
                                 "secure-aggregation": "on"})
    assert cfg.dp == "level=patient,epsilon=2.0,delta=0.0001,clip=1.0,rounds=7"
    assert cfg.secure_aggregation.startswith("bound=1.0,levels=1048576")
    off = RunConfig.from_flower({"dp": "none", "secure-aggregation": "off"})
    assert off.dp == "" and off.secure_aggregation == ""
    # planned rounds given in the spec win over num-server-rounds
    assert RunConfig(num_server_rounds=9, dp="epsilon=1,delta=1e-3,rounds=3").dp.endswith("rounds=3")


@pytest.mark.parametrize(("config", "says"), [
    ({"norm": "layer"}, "--norm is none or batch"),
    ({"dp": "epsilon=1"}, "needs epsilon and delta"),
    ({"dp": "epsilon=1,delta=1e-3", "norm": "batch"}, "--dp needs norm=none"),
    ({"dp": "epsilon=1,delta=1e-3,level=hospital", "secure-aggregation": "on"},
     "secure aggregation hides"),
    ({"secure-aggregation": "on", "attack": "nan", "attackers": 1}, "run them without --dp"),
    ({"local-steps": 5, "local-epochs": 2}, "give one"),
])
def test_run_config_refuses_combinations(config: dict, says: str) -> None:
    with pytest.raises(ConfigError, match="Invalid run configuration") as err:
        RunConfig.from_flower(config)
    assert says in str(err.value)
    assert str(err.value).count("Received:") == 1  # one Received, not the message's and the dict's


def test_experiment_fills_and_checks_the_hospital_count(tmp_path: Path) -> None:
    assert Experiment(cfg=RunConfig(), out=tmp_path, dataset=HEART).num_sites == len(HEART_HOSPITALS)
    assert Experiment(cfg=RunConfig(), out=tmp_path, dataset="wine").num_sites == 3
    files = [tmp_path / "a.csv", tmp_path / "b.csv"]
    assert Experiment(cfg=RunConfig(), out=tmp_path, site_files=files).num_sites == 2
    with pytest.raises(ConfigError, match="split by its 4 real hospitals; drop --sites"):
        Experiment(cfg=RunConfig(), out=tmp_path, dataset=HEART, num_sites=3)
    with pytest.raises(ConfigError, match="drop --sites and --partition"):
        Experiment(cfg=RunConfig(), out=tmp_path, dataset=HEART, partition="dirichlet:0.5")
    with pytest.raises(ConfigError, match="not both or neither"):
        Experiment(cfg=RunConfig(), out=tmp_path, dataset="wine", site_files=files)
    with pytest.raises(ConfigError, match="not both or neither"):
        Experiment(cfg=RunConfig(), out=tmp_path)


def test_experiment_checks_attack_against_the_joining_sites(tmp_path: Path) -> None:
    cfg = RunConfig(attack="signflip", attackers=3)
    with pytest.raises(ConfigError):  # 3 hostile of 3 joining: none honest
        Experiment(cfg=cfg, out=tmp_path, dataset="wine", num_sites=3)
    Experiment(cfg=RunConfig(attack="signflip", attackers=1), out=tmp_path, dataset="wine")
    with pytest.raises(ConfigError, match="go together"):
        Experiment(cfg=RunConfig(attack="signflip"), out=tmp_path, dataset="wine")


def test_simulate_refuses_before_writing_anything(tmp_path: Path, capsys) -> None:
    out = tmp_path / "run"
    code = run_guarded(app, ["simulate", "--dataset", HEART, "--sites", "2", "--out", str(out)])
    assert code == ConfigError.exit_code
    assert "drop --sites" in capsys.readouterr().err
    code = run_guarded(app, ["simulate", "--dataset", "wine", "--parallel", "data:replicas=0",
                             "--out", str(out)])
    assert code == ConfigError.exit_code
    assert not out.exists()
