"""Messages that name the odd one out (issue 41, items 2, 3 and 6), at the commands:

- `fedsplit simulate --site`: a renamed column or target names the hospital that differs from
  the majority and both sides, before anything is written or started;
- a missing, empty or unreadable file at any hospital is one line naming every such hospital,
  before torch, Flower or pandas load (a fresh interpreter shows what got imported);
- a non-JSON ``--recipe-params`` is one line naming the option and the value, never the run
  config; ``site run`` refuses parameters without its own recipe;
- `simulate`'s start line names the model the hospitals train.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
import time
from pathlib import Path

import numpy as np
import pandas as pd
import pytest
from fedsplit.cli.app import app
from fedsplit.cli.errors import run_guarded
from fedsplit.orchestration import experiment
from fedsplit.orchestration.experiment import Experiment
from fedsplit.protocol.config import RunConfig
from fedsplit.protocol.errors import ConfigError, HospitalFailure

ROOT = Path(__file__).resolve().parents[2]

#: Runs ``fedsplit ARGS`` in a fresh interpreter; prints its exit code, its seconds and
#: the top-level modules it loaded.
PROBE = """
import json, sys, time
start = time.perf_counter()
from fedsplit.cli.app import app
from fedsplit.cli.errors import run_guarded
code = run_guarded(app, sys.argv[1:])
print(json.dumps({"code": code, "seconds": time.perf_counter() - start,
                  "modules": sorted({m.split(".")[0] for m in sys.modules})}))
"""


def hospitals(folder: Path, **renamed: dict[str, str]) -> list[str]:
    """north, south and east as CSV files (``--site NAME=FILE`` arguments), each with its
    columns renamed as given."""
    rng = np.random.default_rng(0)
    out = []
    for name in ("north", "south", "east"):
        frame = pd.DataFrame({"mean_radius": rng.normal(14, 3, 40).round(2),
                              "age": rng.integers(30, 80, 40), "target": [0, 1] * 20})
        path = folder / f"{name}.csv"
        frame.rename(columns=renamed.get(name, {})).to_csv(path, index=False)
        out.append(f"{name}={path}")
    return out


def simulate(tmp_path: Path, *args: str) -> int:
    return run_guarded(app, ["simulate", "--out", str(tmp_path / "run"), "--rounds", "1", *args])


def one_line(capsys: pytest.CaptureFixture[str]) -> str:
    err = capsys.readouterr().err.strip()
    assert len(err.splitlines()) == 1, err
    return err


def test_simulate_names_the_hospital_that_renamed_a_column(
        tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    sites = hospitals(tmp_path, east={"mean_radius": "radius_mean"})
    args = [a for s in sites for a in ("--site", s)]
    assert simulate(tmp_path, *args) == ConfigError.exit_code
    err = one_line(capsys)
    assert ("ConfigError: The hospitals' columns differ: Hospital east differs from the majority "
            "(north, south): east lacks 'mean_radius' and has 'radius_mean' (renamed?).") in err
    assert err.endswith("Received: east lacks ['mean_radius'] has ['radius_mean']")
    assert not (tmp_path / "run" / "sites").exists() and not (tmp_path / "run" / "flower").exists()


def test_simulate_names_the_hospital_that_renamed_the_target(
        tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    sites = hospitals(tmp_path, east={"target": "diagnosis"})
    assert simulate(tmp_path, *[a for s in sites for a in ("--site", s)]) == 2
    err = one_line(capsys)
    assert ("Hospital east differs from the majority (north, south): east lacks 'target' (the "
            "target, --target) and has 'diagnosis' (renamed?)") in err
    # two hospitals, one renamed a column: no majority, each side named
    assert simulate(tmp_path, "--site", sites[0], "--site", hospitals(
        tmp_path, east={"age": "years"})[2]) == 2
    assert ("no majority (2 hospitals, half on each side) for 'age' at north but not at east; "
            "'years' at east but not at north") in one_line(capsys)


def probe(args: list[str]) -> dict:
    done = subprocess.run([sys.executable, "-c", PROBE, *args], cwd=ROOT, capture_output=True,
                          text=True, env=os.environ, timeout=300)
    result = json.loads(done.stdout.strip().splitlines()[-1])
    result["err"] = done.stderr.strip()
    return result


@pytest.mark.parametrize("command", ["simulate", "up"])
def test_a_missing_file_at_any_hospital_is_one_line_before_torch_or_flower(
        tmp_path: Path, command: str) -> None:
    ok = hospitals(tmp_path)[0]
    gone, empty = tmp_path / "data" / "gone.csv", tmp_path / "empty.csv"
    empty.write_text("")
    out = (["--out", str(tmp_path / "run")] if command == "simulate"
           else ["--work", str(tmp_path / "work")])
    started = time.perf_counter()
    result = probe([command, *out, "--site", ok, "--site", f"west={gone}",
                    "--site", f"south={empty}"])
    seconds = time.perf_counter() - started
    assert result["code"] == HospitalFailure.exit_code
    assert len(result["err"].splitlines()) == 1, result["err"]
    assert result["err"] == (
        f"HospitalFailure: hospital west, reading its data: data file {gone} does not exist; "
        f"hospital south's data file {empty} is empty (0 bytes) too. Check the path given with "
        f"--site NAME=FILE (a CSV/Parquet table, an NPZ, or what --recipe's reader reads). "
        f"Received: --site west={gone}, --site south={empty}")
    loaded = set(result["modules"])
    assert not loaded & {"torch", "flwr", "pandas", "sklearn"}, loaded
    assert not (tmp_path / "run").exists() and not (tmp_path / "work").exists()
    print(f"{command}: refused in {result['seconds']:.2f} s in-process, {seconds:.2f} s in all")


@pytest.mark.parametrize("command", [
    ["simulate", "--dataset", "wine"], ["up"],
    ["site", "run", "--superlink", "127.0.0.1:9", "--insecure", "--data", "x.csv", "--recipe",
     "mlp"]])
def test_a_non_json_recipe_params_names_the_option_and_the_value(
        tmp_path: Path, command: list[str], capsys: pytest.CaptureFixture[str]) -> None:
    where = ["--out", str(tmp_path / "run")] if command[0] == "simulate" else (
        ["--work", str(tmp_path / "work")] if command[0] == "up" else [])
    assert run_guarded(app, [*command, *where, "--recipe-params", "width=3"]) == 2
    err = one_line(capsys)
    assert err.startswith("ConfigError: --recipe-params must be a JSON object, e.g. "
                          "'{\"width\": 32}'."), err
    assert err.endswith("Received: 'width=3'") and "num_server_rounds" not in err
    assert run_guarded(app, [*command, *where, "--recipe-params", "[3]"]) == 2
    assert one_line(capsys).endswith("Received: '[3]'")
    assert not (tmp_path / "run").exists() and not (tmp_path / "work").exists()


def test_run_config_names_the_value_not_the_whole_config() -> None:
    with pytest.raises(ConfigError) as err:
        RunConfig.from_flower({"recipe-params": "width=3", "num-server-rounds": 4})
    assert str(err.value).endswith("Received: 'width=3'.") and "num" not in str(err.value)


def test_site_run_refuses_recipe_params_without_its_recipe(
        tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    code = run_guarded(app, ["site", "run", "--superlink", "127.0.0.1:9", "--insecure", "--data",
                             str(tmp_path / "x.csv"), "--recipe-params", '{"width": 3}'])
    assert code == 2
    assert one_line(capsys) == (
        "ConfigError: --recipe-params are this hospital's own recipe's parameters: give the "
        "recipe with --recipe (the run's recipe takes the run's parameters). Received: "
        "--recipe-params '{\"width\": 3}' without --recipe")


class Stop(Exception):
    """Raised where Flower would start."""


@pytest.mark.parametrize(("recipe", "names"), [
    ("", "built-in MLP (hidden 64-32)"),
    ("mlp", 'recipe mlp (mlp version 1, params {"hidden": [64, 32], "norm": "none"})')])
def test_simulate_start_line_names_the_model(tmp_path: Path, monkeypatch: pytest.MonkeyPatch,
                                             recipe: str, names: str) -> None:
    def no_flower(*_a, **_kw):
        raise Stop

    monkeypatch.setattr(experiment, "simulation", no_flower)
    lines: list[str] = []
    exp = Experiment(cfg=RunConfig(recipe=recipe, num_server_rounds=2), out=tmp_path / "run",
                     site_files=hospitals(tmp_path)[:2])
    with pytest.raises(Stop):
        experiment.run_experiment(exp, on_stage=lines.append)
    assert lines == [f"federation: 2 hospitals (north, south), {names}, fedavg, 2 rounds"]
