"""``fedsplit site egress`` and ``fedsplit site policy`` as a hospital's IT team runs them."""

from __future__ import annotations

from pathlib import Path

import pytest
from fedsplit.cli.app import app
from fedsplit.cli.errors import run_guarded
from fedsplit.client.policy import append
from fedsplit.protocol import egress_log


def record(run: int, message: str, **extra: object) -> dict:
    base = {"run": run, "coordinator": "link.example.org:9092", "site": "st-mary",
            "run_kind": "horizontal", "message": message, "group": "1", "round": 1,
            "outcome": "sent", "reason": None, "tensors": [], "counts": {}, "metrics": {},
            "labels": [], "categories": {}, "withheld": {}, "epsilon": None, "bytes": 0}
    return {**base, **extra}


@pytest.fixture
def state(tmp_path: Path) -> Path:
    """A hospital's state folder: a schema reply and a DP train reply of run 7, a refusal of
    run 8."""
    tensor = {"record": "arrays", "name": "body.0.weight", "kinds": ["weights"],
              "shape": [64, 30], "dtype": "float32", "bytes": 7680}
    append(tmp_path, record(7, "query.schema", round=None, counts={"rows": 96},
                            labels=["0", "1"], categories={"ward": ["north", "south"]},
                            withheld={"ward": 3}))
    append(tmp_path, record(7, "train", tensors=[tensor], bytes=7680,
                            counts={"num-examples": 96}, metrics={"dp-epsilon": 0.41},
                            epsilon=0.41))
    append(tmp_path, record(8, "query.psi_start", run_kind="vertical", outcome="refused",
                            reason="hospital st-mary, its policy: this hospital takes no "
                                   "vertical runs. Received: a vertical run's query.psi_start"))
    return tmp_path


def test_egress_prints_one_table_per_run_and_the_totals(state: Path, capsys) -> None:
    assert run_guarded(app, ["site", "egress", "--state-dir", str(state)]) == 0
    out = capsys.readouterr().out
    assert "run 7 (hospital st-mary, coordinator link.example.org:9092)" in out
    assert "labels 0, 1; 2 categories; 3 withheld" in out and "1 (7.7 kB)" in out
    assert "96 rows" in out and "96 examples" in out and "0.41" in out
    assert "run 7: 2 replies sent, 1 tensors, 7.7 kB; 0 refused; epsilon spent up to 0.41" in out
    assert "run 8: 0 replies sent, 0 tensors, 0 B; 1 refused" in out
    assert "total: 2 run(s), 2 replies sent, 7.7 kB, 1 refused" in out
    assert run_guarded(app, ["site", "egress", "--state-dir", str(state), "--run", "8"]) == 0
    only = capsys.readouterr().out
    assert "run 8" in only and "run 7" not in only
    assert "refused" in only and "its policy: this hospital takes no vertical runs." in only


def test_egress_verify_passes_then_names_the_changed_line(state: Path, capsys) -> None:
    assert run_guarded(app, ["site", "egress", "--state-dir", str(state), "--verify"]) == 0
    assert capsys.readouterr().out.startswith("egress log intact: 3 record(s); head ")
    log = state / egress_log.LOG_NAME
    log.write_text(log.read_text().replace('"rows":96', '"rows":12'))
    assert run_guarded(app, ["site", "egress", "--state-dir", str(state), "--verify"]) == 1
    err = capsys.readouterr().err
    assert err.startswith("egress log BROKEN: line 1 was changed") and err.count("\n") == 1


def test_egress_without_a_log_says_where_to_look(tmp_path: Path, capsys) -> None:
    code = run_guarded(app, ["site", "egress", "--state-dir", str(tmp_path), "--verify"])
    assert code == 2 and "There is no egress log in" in capsys.readouterr().err


def test_policy_prints_the_policy_in_force_and_refuses_a_bad_file(tmp_path: Path, capsys) -> None:
    good = tmp_path / "policy.toml"
    good.write_text('send = ["weights"]\nallow_plain_training = false\n')
    assert run_guarded(app, ["site", "policy", str(good)]) == 0
    out = capsys.readouterr().out
    assert 'send = ["weights"]\n' in out and "allow_plain_training = false\n" in out
    assert 'recipes = ["builtin"]  # default' in out
    bad = tmp_path / "bad.toml"
    bad.write_text("max_labels = 1\n")
    assert run_guarded(app, ["site", "policy", str(bad)]) == 2
    err = capsys.readouterr().err
    assert "max_labels" in err and "Received: max_labels=1" in err
