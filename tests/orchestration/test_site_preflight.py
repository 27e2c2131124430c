"""`fedsplit site run` reads the hospital's data as its agent will before the SuperNode starts,
and refuses in one line naming the hospital, the stage and the cause (issue 31, finding 5)."""

from __future__ import annotations

from pathlib import Path

import pytest
from fedsplit.cli.app import app
from fedsplit.cli.errors import run_guarded
from fedsplit.orchestration import site_agent
from fedsplit.orchestration.site_agent import read_site_data
from fedsplit.protocol.errors import HospitalFailure

RECIPE = "h5_signals:H5Signals"


@pytest.fixture
def no_supernode(monkeypatch: pytest.MonkeyPatch) -> list[list[str]]:
    """Records the SuperNode command instead of starting it."""
    started: list[list[str]] = []
    monkeypatch.setattr(site_agent, "supervise", lambda cmd, env, **kw: started.append(cmd) or 0)
    return started


def site_run(data: Path, *extra: str) -> int:
    return run_guarded(app, ["site", "run", "--superlink", "127.0.0.1:9", "--insecure",
                             "--data", str(data), "--flwr-home", str(data.parent / "home"), *extra])


def test_a_readable_file_starts_the_supernode_with_its_node_config(
        own_recipe, no_supernode: list[list[str]], tmp_path: Path,
        capsys: pytest.CaptureFixture[str]) -> None:
    data = own_recipe.write_hospital(tmp_path / "east.h5", 40, seed=1)
    assert site_run(data, "--name", "east", "--recipe", RECIPE) == 0
    (cmd,) = no_supernode
    config = cmd[cmd.index("--node-config") + 1]
    assert f"data-path='{data}'" in config and "site-name='east'" in config
    assert f"recipe='{RECIPE}'" in config
    assert "data " + str(data) + " (40 rows)" in capsys.readouterr().err


@pytest.mark.parametrize(("case", "cause"), [
    ("missing", "ConfigError: data file {data} does not exist"),
    ("unlabelled", "KeyError: \"Unable to synchronously open object (object 'label'"),
    ("wrong suffix", "ConfigError: east.txt is not a .csv, .parquet or .npz file, and recipe "
                     f"{RECIPE}'s read_data does not read it"),
])
def test_unreadable_data_is_refused_naming_hospital_stage_and_cause(
        own_recipe, no_supernode: list[list[str]], tmp_path: Path,
        capsys: pytest.CaptureFixture[str], case: str, cause: str) -> None:
    data = {"missing": tmp_path / "gone.h5", "unlabelled": tmp_path / "east.h5",
            "wrong suffix": tmp_path / "east.txt"}[case]
    if case == "unlabelled":
        own_recipe.write_hospital(data, 30, seed=2, labels=False)
    if case == "wrong suffix":
        data.write_text("signals\n")
    assert site_run(data, "--name", "east", "--recipe", RECIPE) == HospitalFailure.exit_code
    err = capsys.readouterr().err.strip()
    assert len(err.splitlines()) == 1, err  # one line, no traceback
    assert err.startswith("HospitalFailure: hospital east, reading its data: "), err
    assert cause.format(data=data) in err
    assert err.endswith(f"Received: {data}")
    assert no_supernode == []  # refused before any SuperNode started


def test_without_a_recipe_a_file_only_a_recipe_reads_is_refused_with_the_fix(
        own_recipe, no_supernode: list[list[str]], tmp_path: Path,
        capsys: pytest.CaptureFixture[str]) -> None:
    data = own_recipe.write_hospital(tmp_path / "west.h5", 30, seed=3)
    assert site_run(data) == HospitalFailure.exit_code
    err = capsys.readouterr().err
    assert "hospital west, reading its data" in err and "--recipe REF" in err
    assert no_supernode == []


def test_tables_and_npz_are_read_as_the_agent_reads_them(tmp_path: Path) -> None:
    table = tmp_path / "north.csv"
    table.write_text("age,outcome\n50,1\n61,0\n47,1\n")
    # no run config here: the target column is the coordinator's to name, the rows are read
    assert read_site_data(table, "north") == (3, table)
    folder = tmp_path / "south"
    folder.mkdir()
    (folder / "rows.csv").write_text("a,target\n1,0\n")
    with pytest.raises(HospitalFailure, match=r"hospital south, reading its data: ConfigError: "
                                              r"a hospital needs at least 2 rows"):
        read_site_data(folder, "south")
    npz = tmp_path / "images.npz"
    import numpy as np

    np.savez(npz, x=np.zeros((4, 8, 8), np.float32))  # no labels
    with pytest.raises(HospitalFailure, match=r"hospital images, reading its data: ConfigError: "
                                              r".*'x' .* and 'y' \(labels\)"):
        read_site_data(npz, "images")


def test_what_the_pre_flight_read_is_not_kept(own_recipe, tmp_path: Path) -> None:
    """The agent (and `up`) read a hospital's file once; the process keeps no copy of it."""
    from fedsplit.client import site as client_site
    from fedsplit.orchestration.site_agent import forget_reads

    data = own_recipe.write_hospital(tmp_path / "east.h5", 30, seed=4)
    assert read_site_data(data, "east", recipe=RECIPE) == (30, data)
    assert client_site._READ
    forget_reads()
    assert not client_site._READ and client_site._load.cache_info().currsize == 0
