"""`fedsplit up --site NAME=FILE`: the local hospitals train on the operator's own files; and
`fedsplit up` never reports success with nothing trained (issue 31, findings 3, 6, 10).

The fast tests stand a recording federation in for the processes (`run_up`'s sequencing, the
CLI's exit codes and lines are real); the slow one runs two real `fedsplit up` federations on
127.0.0.1 with a hospital's own HDF5 recipe: one that trains, one whose train_step raises at
every hospital (exit 14, each hospital's reason named, no "done").
"""

from __future__ import annotations

import contextlib
import json
import os
import sys
import time
from pathlib import Path
from typing import Any, ClassVar

import pytest
from fedsplit.cli.app import app
from fedsplit.cli.errors import run_guarded
from fedsplit.orchestration import local_federation, up
from fedsplit.orchestration.flower_runtime import flower_env, spawn
from fedsplit.orchestration.local_federation import LocalFederation, Site, check_trained
from fedsplit.protocol.errors import ConfigError, FederationError, HospitalFailure, NoTrainingError
from fedsplit.protocol.record.horizontal import RunRecord

from tests._helpers.processes import run_up_process

RECIPE = "h5_signals:H5Signals"


def record(trained: bool, *, status: str = "finished") -> RunRecord:
    """A run record of one round, trained by east and west, or with both left out."""
    sites = [{"site": name, "excluded": not trained, "num_examples": 30,
              **({} if trained else {"reason": f"hospital {name}, training: RuntimeError: broken"})}
             for name in ("east", "west")]
    entry: dict[str, Any] = {"round": 1, "train": {"sites": sites}}
    if trained:
        entry["model"] = "models/round-001.h5"
    else:
        entry["error"] = "too few valid updates (0 of quorum 2)"
    return RunRecord.from_json({"status": status, "rounds": [entry]}, source="test")


class Recording:
    """Stands in for `LocalFederation`: records what run_up gives it, returns ``history``."""

    made: ClassVar[list[Recording]] = []
    history: ClassVar[RunRecord] = record(True)
    write_model: ClassVar[bool] = True

    def __init__(self, work: Path, sites: list[Site], **kw: Any) -> None:
        self.work, self.sites, self.logs, self.kw = work, sites, work / "logs", kw
        self.cfg = None
        Recording.made.append(self)

    def __enter__(self) -> Recording:
        return self

    def __exit__(self, *exc: object) -> None:
        pass

    def start(self) -> None:
        pass

    def run(self, cfg, **kw: Any) -> RunRecord:
        self.cfg = cfg
        if Recording.write_model:
            Path(cfg.out_dir).mkdir(parents=True, exist_ok=True)
            (Path(cfg.out_dir) / "global.h5").write_bytes(b"model")
        return Recording.history


@pytest.fixture
def recording(monkeypatch: pytest.MonkeyPatch) -> type[Recording]:
    Recording.made, Recording.history, Recording.write_model = [], record(True), True
    monkeypatch.setattr(up, "LocalFederation", Recording)
    return Recording


def up_cli(tmp_path: Path, *args: str) -> int:
    return run_guarded(app, ["up", "--work", str(tmp_path / "work"), "--rounds", "1", *args])


def test_site_excludes_dataset_sites_partition_and_superlink(tmp_path: Path,
                                                             capsys: pytest.CaptureFixture[str]) -> None:
    table = tmp_path / "east.csv"
    table.write_text("a,target\n1,0\n2,1\n")
    for extra, named in ((["--dataset", "digits"], "--dataset"), (["--sites", "2"], "--sites"),
                         (["--partition", "dirichlet:0.5"], "--partition")):
        assert up_cli(tmp_path, "--site", f"east={table}", *extra) == ConfigError.exit_code
        err = capsys.readouterr().err
        assert err.startswith("ConfigError: --site gives each hospital its own file") and \
            err.strip().endswith(f"Received: --site with {named}"), err
    assert up_cli(tmp_path, "--site", f"east={table}", "--superlink", "127.0.0.1:9") == 2
    assert "with --superlink the hospitals run their own agents" in capsys.readouterr().err
    assert not (tmp_path / "work").exists()


def test_a_missing_file_names_the_hospital_before_anything_starts(
        tmp_path: Path, recording: type[Recording], capsys: pytest.CaptureFixture[str]) -> None:
    table = tmp_path / "west.csv"
    table.write_text("a,target\n1,0\n2,1\n")
    gone = tmp_path / "data" / "gone.h5"
    assert up_cli(tmp_path, "--site", f"west={table}", "--site", f"east={gone}") == \
        HospitalFailure.exit_code  # the same line as `fedsplit simulate`'s (site_files)
    err = capsys.readouterr().err.strip()
    assert err == (f"HospitalFailure: hospital east, reading its data: data file {gone} does not "
                   f"exist. Check the path given with --site NAME=FILE (a CSV/Parquet table, an "
                   f"NPZ, or what --recipe's reader reads). Received: --site east={gone}")
    assert recording.made == []


def test_train_test_pairs_and_twice_the_same_name_are_refused(tmp_path: Path) -> None:
    a, b = tmp_path / "a.csv", tmp_path / "b.csv"
    for path in (a, b):
        path.write_text("x,target\n1,0\n2,1\n")
    with pytest.raises(ConfigError, match=r"hospital east: fedsplit up trains each hospital on its "
                                          r"whole file.*Received: east=.*a\.csv:.*b\.csv$"):
        up.own_sites([f"east={a}:{b}"])
    with pytest.raises(ConfigError, match="Received: east more than once"):
        up.own_sites([f"east={a}", f"east={b}"])
    assert [s.name for s in up.own_sites([str(a), f"west={b}"])] == ["a", "west"]


def test_an_unlabelled_file_is_refused_in_one_line_before_any_process(
        own_recipe, tmp_path: Path, recording: type[Recording],
        capsys: pytest.CaptureFixture[str]) -> None:
    east = own_recipe.write_hospital(tmp_path / "east.h5", 30, seed=1, labels=False)
    west = own_recipe.write_hospital(tmp_path / "west.h5", 30, seed=2)
    code = up_cli(tmp_path, "--site", f"east={east}", "--site", f"west={west}", "--recipe", RECIPE)
    assert code == HospitalFailure.exit_code
    err = capsys.readouterr().err.strip()
    assert len(err.splitlines()) == 1
    assert err.startswith("HospitalFailure: hospital east, reading its data: KeyError:"), err
    assert err.endswith(f"Received: {east}")
    assert recording.made == []


def test_each_hospital_trains_on_its_own_file_named_and_fingerprinted(
        own_recipe, tmp_path: Path, recording: type[Recording],
        capsys: pytest.CaptureFixture[str]) -> None:
    east = own_recipe.write_hospital(tmp_path / "east.h5", 30, seed=1)
    table = tmp_path / "north.csv"
    # five rows per label: a hospital names no class label held by fewer (its policy's default)
    table.write_text("age,target\n" + "".join(f"{40 + i},{i % 2}\n" for i in range(30)))
    # the table is read by the table reader (the recipe's reader declines it): two readers, one run
    code = up_cli(tmp_path, "--site", f"east={east}", "--site", f"north={table}", "--recipe", RECIPE,
                  "--recipe-params", '{"width": 4}')
    assert code == 0, capsys.readouterr()
    (federation,) = recording.made
    assert [(s.name, s.data, s.recipe, s.recipe_params) for s in federation.sites] == [
        ("east", east, RECIPE, '{"width": 4}'), ("north", table, RECIPE, '{"width": 4}')]
    cfg = federation.cfg
    assert cfg.min_nodes == 2
    fingerprint = json.loads(cfg.data_fingerprint)
    assert fingerprint["north"]["rows"] == 30 and fingerprint["north"]["columns"] == 2
    assert fingerprint["east"]["rows"] == 30 and len(fingerprint["east"]["sha256"]) == 64
    assert "done" in capsys.readouterr().out


def test_nothing_trained_is_exit_14_with_each_hospitals_reason_and_no_done(
        tmp_path: Path, recording: type[Recording], capsys: pytest.CaptureFixture[str]) -> None:
    recording.history, recording.write_model = record(False), False
    assert up_cli(tmp_path, "--sites", "2") == NoTrainingError.exit_code
    captured = capsys.readouterr()
    assert "done" not in captured.out and "global model" not in captured.out
    err = captured.err.strip()
    assert len(err.splitlines()) == 1 and err.startswith("NoTrainingError: "), err
    assert "hospital east, training: RuntimeError: broken" in err
    assert "hospital west, training: RuntimeError: broken" in err
    assert err.endswith("status finished, 0 of 1 round(s) with a model")


def test_a_model_that_is_not_on_disk_is_never_presented(
        tmp_path: Path, recording: type[Recording], capsys: pytest.CaptureFixture[str]) -> None:
    recording.write_model = False  # the record says round 1 saved a model; global.h5 is absent
    assert up_cli(tmp_path, "--sites", "2") == NoTrainingError.exit_code
    captured = capsys.readouterr()
    assert "done" not in captured.out
    assert f"{tmp_path / 'work' / 'out' / 'global.h5'} does not exist" in captured.err


def test_a_hospital_failing_every_round_is_named_after_done(
        tmp_path: Path, recording: type[Recording], capsys: pytest.CaptureFixture[str]) -> None:
    """The model exists (trained by east) and is presented; then west, whose train_step raised
    in every round, is named with exit 13, as fedsplit simulate does."""
    rounds = [{"round": n, "model": f"models/round-00{n}.h5", "train": {"sites": [
        {"site": "east", "num_examples": 30},
        {"site": "west", "excluded": True,
         "reason": "hospital west, training: RuntimeError: broken (at r.py:3 in train_step)"}]}}
        for n in (1, 2)]
    recording.history = RunRecord.from_json({"status": "finished", "rounds": rounds}, source="t")
    assert up_cli(tmp_path, "--sites", "2") == HospitalFailure.exit_code
    captured = capsys.readouterr()
    assert "done in" in captured.out and "global model" in captured.out
    err = captured.err.strip()
    assert err.startswith("HospitalFailure: hospital west, training: RuntimeError: broken"), err
    assert "in every round" in err and "without it" in err and len(err.splitlines()) == 1
    assert err.endswith(f"Received: {tmp_path / 'work' / 'out' / 'history.json'}")
    rounds[1]["train"]["sites"][1] = {"site": "west", "num_examples": 20}  # west joined round 2
    recording.history = RunRecord.from_json({"status": "finished", "rounds": rounds}, source="t")
    assert up_cli(tmp_path, "--sites", "2") == 0


def test_the_attach_path_checks_the_record_too(tmp_path: Path, monkeypatch: pytest.MonkeyPatch,
                                               capsys: pytest.CaptureFixture[str]) -> None:
    monkeypatch.setattr(up, "attach", lambda *a, **kw: record(False))
    code = up_cli(tmp_path, "--superlink", "127.0.0.1:9", "--out", str(tmp_path / "out"))
    assert code == NoTrainingError.exit_code
    assert "hospital west, training" in capsys.readouterr().err
    monkeypatch.setattr(up, "attach", lambda *a, **kw: record(True))
    (tmp_path / "out").mkdir()
    (tmp_path / "out" / "global.h5").write_bytes(b"model")
    assert up_cli(tmp_path, "--superlink", "127.0.0.1:9", "--out", str(tmp_path / "out")) == 0


def test_check_trained(tmp_path: Path) -> None:
    (tmp_path / "global.h5").write_bytes(b"model")
    check_trained(record(True), tmp_path)  # trained, model present: nothing to say
    with pytest.raises(NoTrainingError, match="0 of 1 round"):
        check_trained(record(False), tmp_path)  # a stale global.h5 does not make it trained
    with pytest.raises(NoTrainingError, match="status failed"):
        check_trained(record(True, status="failed"), tmp_path)


def test_an_agent_that_stops_on_its_data_ends_the_run_with_its_line(tmp_path: Path) -> None:
    """A hospital agent exiting with HospitalFailure (13) or ConfigError (2) is not restarted:
    the run stops with the agent's own line."""
    fed = LocalFederation(tmp_path, [Site("east", tmp_path / "east.h5")], admin_port=None,
                          say=lambda _m: None, port=9)
    line = ("HospitalFailure: hospital east, reading its data: KeyError: 'label'. The file "
            "lacks its labels. Received: east.h5")
    fed.procs["east"] = spawn([sys.executable, "-c", f"import sys; print('start'); "
                                                     f"print({line!r}, file=sys.stderr); sys.exit(13)"],
                              flower_env(tmp_path / "h"), fed.logs / "east.log")
    fed.procs["east"].wait(30)
    with pytest.raises(HospitalFailure) as info:
        fed._check_sites()
    assert str(info.value) == line.removeprefix("HospitalFailure: ")
    assert local_federation.AGENT_FATAL[2] == "ConfigError"


@pytest.mark.parametrize(("error", "raised"), [
    ("FederationError: only 1 of 2 hospitals connected within round-timeout", FederationError),
    ("RuntimeError: the ServerApp crashed", NoTrainingError),
])
def test_a_failed_run_raises_the_coordinators_error_or_no_training(
        tmp_path: Path, monkeypatch: pytest.MonkeyPatch, error: str, raised: type) -> None:
    """The local path follows the run record like attach: the coordinator's own fedsplit error
    keeps its class (exit code); any other failure with nothing trained is NoTrainingError."""
    from fedsplit.protocol.config import RunConfig

    fed = LocalFederation(tmp_path / "work", [], admin_port=None, say=lambda _m: None, port=9)
    out = tmp_path / "out"
    out.mkdir()
    record = json.dumps({"status": "failed", "error": error, "rounds": []})
    # "flwr run": the coordinator records the failed run right after the submission
    monkeypatch.setattr(fed, "submit", lambda app_dir: (out / "history.json").write_text(record))
    for name in (local_federation.SUPERLINK, local_federation.COORDINATOR, local_federation.RUN):
        fed.procs[name] = spawn([sys.executable, "-c", "import time; time.sleep(60)"],
                                flower_env(tmp_path / "h"), tmp_path / f"{name}.log")
    cfg = RunConfig(out_dir=str(out))
    try:
        with pytest.raises(raised) as info:
            fed.run(cfg, timeout=30)
    finally:
        fed.close()
    assert error.partition(": ")[2] in str(info.value)


# --- two real federations ---------------------------------------------------------------------


def _alive(pids_file: Path) -> list[int]:
    alive = []
    for pid in json.loads(pids_file.read_text()).values():
        with contextlib.suppress(ProcessLookupError, PermissionError):
            os.killpg(pid, 0)
            alive.append(pid)
    return alive


@pytest.mark.slow
def test_up_trains_on_the_hospitals_own_files_and_refuses_a_run_that_trained_nothing(
        own_recipe, tmp_path: Path) -> None:
    (tmp_path / "data").mkdir()
    east = own_recipe.write_hospital(tmp_path / "data" / "east.h5", 60, seed=1)
    west = own_recipe.write_hospital(tmp_path / "data" / "west.h5", 40, seed=2)
    env = flower_env(tmp_path / "cli-home")
    env["PATH"] = os.pathsep.join(["/usr/bin", "/bin"])  # the venv's bin is not on the caller's PATH
    common = ["--site", f"east={east}", "--site", f"west={west}", "--recipe", RECIPE, "--rounds",
              "1", "--round-timeout", "120", "--no-admin"]

    t0 = time.monotonic()
    work = tmp_path / "ok"
    # the SuperLink's state in SQLite (issue 43); an earlier federation's file is made anew
    database = work / "superlink.db"
    database.parent.mkdir(parents=True)
    database.write_bytes(b"not a database: an earlier federation's, or anything else")
    code = run_up_process([*common, "--work", str(work), "--superlink-database", str(database)],
                          tmp_path / "ok.log", env, 420)
    printed = (tmp_path / "ok.log").read_text()
    trained_s = time.monotonic() - t0
    assert code == 0, printed[-3000:]
    assert f"global model {work / 'out' / 'global.h5'}" in printed
    assert (work / "out" / "global.h5").is_file()
    history = json.loads((work / "out" / "history.json").read_text())
    (entry,) = history["rounds"]
    assert {s["site"] for s in entry["train"]["sites"] if not s.get("excluded")} == {"east", "west"}
    assert entry["model"] == "models/round-001.h5"
    assert json.loads(history["config"]["data-fingerprint"])["east"]["rows"] == 60
    assert database.read_bytes().startswith(b"SQLite format 3")
    assert not _alive(work / "pids.json")

    t1 = time.monotonic()
    work = tmp_path / "broken"
    code = run_up_process([*common, "--recipe-params", '{"fail_training": true}', "--work", str(work)],
                   tmp_path / "broken.log", env, 420)
    printed = (tmp_path / "broken.log").read_text()
    assert code == NoTrainingError.exit_code, printed[-3000:]
    assert "done" not in printed and not (work / "out" / "global.h5").exists()
    error = next(line for line in printed.splitlines() if line.startswith("NoTrainingError: "))
    assert "0 of 1 round(s)" in error and "east" in error and "west" in error, error
    assert "this hospital's train_step is broken" in error, error
    assert not _alive(work / "pids.json")
    print(f"fedsplit up --site (2 hospitals, own .h5 files, 1 round): trained in {trained_s:.0f} s; "
          f"the broken train_step run refused (exit 14) after {time.monotonic() - t1:.0f} s")


def test_a_renamed_column_names_the_odd_hospital_and_the_start_line_names_the_model(
        tmp_path: Path, recording: type[Recording], capsys: pytest.CaptureFixture[str]) -> None:
    """Issue 41, items 2 and 6: the hospital that renamed a column (or the target) is named
    with both sides before any process starts; a run's start line names the model it trains."""
    rows = "".join(f"{40 + i},{i % 2}\n" for i in range(30))
    files = {}
    for name, header in (("north", "age,target"), ("south", "age,target"), ("east", "years,target"),
                         ("west", "age,outcome")):
        files[name] = tmp_path / f"{name}.csv"
        files[name].write_text(f"{header}\n{rows}")
    code = up_cli(tmp_path, *[a for n in ("north", "south", "east")
                              for a in ("--site", f"{n}={files[n]}")])
    assert code == ConfigError.exit_code
    err = capsys.readouterr().err.strip()
    assert err.startswith("ConfigError: The hospitals' columns differ: Hospital east differs from "
                          "the majority (north, south): east lacks 'age' and has 'years' "
                          "(renamed?)."), err
    code = up_cli(tmp_path, *[a for n in ("north", "south", "west")
                              for a in ("--site", f"{n}={files[n]}")])
    assert code == ConfigError.exit_code
    assert ("west lacks 'target' (the target, --target) and has 'outcome' (renamed?)"
            in capsys.readouterr().err)
    assert recording.made == []
    code = up_cli(tmp_path, "--site", f"north={files['north']}", "--site", f"south={files['south']}")
    assert code == 0, capsys.readouterr()
    assert "federation: 2 hospitals, built-in MLP (hidden 64-32), fedavg, 1 rounds" in \
        capsys.readouterr().out


def test_the_superlink_database_reaches_the_superlink_made_anew(
        tmp_path: Path, recording: type[Recording], monkeypatch: pytest.MonkeyPatch,
        capsys: pytest.CaptureFixture[str]) -> None:
    """``--superlink-database FILE``: Flower's --database on the SuperLink `up` starts (issue 43),
    an earlier federation's file (and SQLite's side files) removed first; refused with
    --superlink or a folder."""
    database = tmp_path / "link.db"
    assert up_cli(tmp_path, "--superlink-database", str(database), "--no-admin") == 0
    assert recording.made[-1].kw["database"] == database.resolve()
    assert up_cli(tmp_path, "--no-admin") == 0 and recording.made[-1].kw["database"] is None
    code = up_cli(tmp_path, "--superlink-database", str(database), "--superlink", "127.0.0.1:9")
    assert code == ConfigError.exit_code
    assert "the running one keeps its own" in capsys.readouterr().err
    assert up_cli(tmp_path, "--superlink-database", str(tmp_path)) == ConfigError.exit_code
    assert "not a folder" in capsys.readouterr().err

    started: list[list[str]] = []
    monkeypatch.setattr(LocalFederation, "_start", lambda self, name, cmd, env: started.append(cmd))
    monkeypatch.setattr(local_federation, "wait_http", lambda *a, **k: None)
    for stale in (database, tmp_path / "link.db-wal", tmp_path / "link.db-shm"):
        stale.write_bytes(b"an earlier federation's")
    LocalFederation(tmp_path / "work", [], admin_port=None, database=database).start_superlink()
    (cmd,) = started
    assert cmd[cmd.index("--database") + 1] == str(database)
    assert not list(tmp_path.glob("link.db*"))
    started.clear()
    LocalFederation(tmp_path / "work2", [], admin_port=None).start_superlink()
    assert "--database" not in started[0]


def test_the_coordinators_processes_get_the_allocator_settings_and_hospitals_keep_theirs(
        tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """The SuperLink and the coordinator's SuperExec (so its ServerApp) start with
    `COORDINATOR_MALLOC` (issue 43: Flower's freed chunks go back to the system); an operator's
    own setting wins; the hospitals' agents keep glibc's defaults."""
    from fedsplit.orchestration.flower_runtime import COORDINATOR_MALLOC
    from fedsplit.orchestration.local_federation import Site

    envs: dict[str, dict[str, str]] = {}
    monkeypatch.setattr(LocalFederation, "_start",
                        lambda self, name, cmd, env: envs.__setitem__(name, env))
    monkeypatch.setattr(local_federation, "wait_http", lambda *a, **k: None)
    monkeypatch.delenv("MALLOC_MMAP_THRESHOLD_", raising=False)
    monkeypatch.setenv("MALLOC_ARENA_MAX", "8")  # the operator's own
    fed = LocalFederation(tmp_path / "work", [Site("north", tmp_path)], admin_port=None)
    fed.start_superlink()
    fed.start_coordinator()
    fed.start_site(fed.sites[0])
    assert set(envs) == {local_federation.SUPERLINK, local_federation.COORDINATOR, "north"}
    for role in (local_federation.SUPERLINK, local_federation.COORDINATOR):
        assert envs[role]["MALLOC_MMAP_THRESHOLD_"] == COORDINATOR_MALLOC["MALLOC_MMAP_THRESHOLD_"]
        assert envs[role]["MALLOC_ARENA_MAX"] == "8"
    assert "MALLOC_MMAP_THRESHOLD_" not in envs["north"]
