"""The heart-disease demo with Flower: the federated row is the round its validation picks (issue 26).

`fedsplit simulate --dataset heart-disease`: the coordinator keeps the round whose federated
evaluation (each hospital's validation rows) scores best; ``global.h5`` is that round's saved
model, ``last.h5`` the last round's, and the models table's "kept" column shows it for every
row. Then the vertical diabetes case through `fedsplit vertical simulate` (Flower).
"""

from __future__ import annotations

import json
from pathlib import Path

import numpy as np
import pytest
from fedsplit.cli.app import app
from fedsplit.cli.errors import run_guarded
from fedsplit.protocol import read_weights
from fedsplit.protocol.selection import BestRound

ROUNDS = 6
VERTICAL_ROUNDS = 10


def same_weights(a: Path, b: Path) -> bool:
    wa, wb = read_weights(a).arrays, read_weights(b).arrays
    return wa.keys() == wb.keys() and all(np.array_equal(wa[k], wb[k]) for k in wa)


@pytest.mark.slow
def test_heart_disease_demo_keeps_its_best_validation_round(
        tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    # Execute
    out = tmp_path / "demo"
    code = run_guarded(app, ["simulate", "--dataset", "heart-disease", "--rounds", str(ROUNDS),
                             "--out", str(out)])
    # Assert: the kept round is the last of the best federated validation scores
    assert code == 0
    summary = json.loads((out / "summary.json").read_text())
    fed = summary["federated"]
    scores = fed["val_metric"]
    assert fed["keep"] == "best-val" and fed["val_rounds"] == list(range(1, ROUNDS + 1))
    assert fed["rounds_kept"] == max(r for r, s in enumerate(scores, 1) if s == max(scores))
    history = json.loads((out / "federation" / "history.json").read_text())
    evaluated = [r["evaluate"]["metrics"]["accuracy"] for r in history["rounds"]]
    assert scores == pytest.approx(evaluated)  # the federated evaluation that already runs
    # global.h5 is the kept round's saved model; last.h5 the last round's
    kept = out / "federation" / "models" / f"round-{fed['rounds_kept']:03d}.h5"
    assert same_weights(out / "federation" / "global.h5", kept)
    assert same_weights(out / "federation" / "last.h5",
                        out / "federation" / "models" / f"round-{ROUNDS:03d}.h5")
    # the row's test scores are the kept round's
    row = summary["rounds"][fed["rounds_kept"] - 1]
    assert fed["per_site"] == row["per_site"] and fed["metrics"] == row["metrics"]
    # every row of the models table says which round it keeps
    printed = "".join(capsys.readouterr().out.split())
    assert f"{fed['rounds_kept']}of{ROUNDS}" in printed
    for entry in [summary["centralized"], *summary["local_only"]]:
        assert f"{entry['rounds_kept']}of{ROUNDS}" in printed


@pytest.mark.slow
def test_vertical_diabetes_case_with_flower(tmp_path: Path) -> None:
    """The issue's vertical case through `fedsplit vertical simulate`: 10 rounds over-train the
    fused model (its validation score peaks at round 4 and falls after round 8; 20 rounds took
    twice as long for the same check); kept by validation it is within 0.03 of centralized (or
    above)."""
    from tests.vertical.test_fused_selection import diabetes_case

    sites, labels = diabetes_case(tmp_path / "data")
    out = tmp_path / "run"
    code = run_guarded(app, ["vertical", "simulate", "--site", str(sites[0]), "--site", str(sites[1]),
                             "--labels", str(labels), "--task", "regression",
                             "--rounds", str(VERTICAL_ROUNDS), "--out", str(out)])
    assert code == 0
    summary = json.loads((out / "summary.json").read_text())
    fed, central = summary["federated"], summary["centralized"]
    assert fed["rounds_kept"] < VERTICAL_ROUNDS
    assert fed["metrics"] == summary["rounds"][fed["rounds_kept"] - 1]["metrics"]
    assert fed["metrics"]["r2"] >= central["metrics"]["r2"] - 0.03
    assert (out / "federation" / "head" / "head.npz").is_file()
    assert (out / "federation" / "last" / "head" / "head.npz").is_file()


@pytest.mark.slow
def test_keep_last_then_a_run_killed_after_its_best_round_resumes_and_keeps_the_choice(
        tmp_path: Path) -> None:
    """`fedsplit simulate` twice in one --out. The first run, --keep last, keeps its last round
    (global.h5 is last.h5). Its record is then cut right after its best validation round (as if
    the coordinator died there); the second run resumes with the default --keep best-val (keep
    may change on a resume) and trains on: the recorded scores survive and the choice is the
    best-val rule over all rounds. (One simulate run fewer: --keep last had a run of its own.)"""
    out = tmp_path / "run"
    args = ["simulate", "--dataset", "breast-cancer", "--sites", "2", "--local-steps", "3",
            "--out", str(out)]
    assert run_guarded(app, [*args, "--rounds", "3", "--keep", "last"]) == 0
    fed = json.loads((out / "summary.json").read_text())["federated"]
    assert fed["keep"] == "last" and fed["rounds_kept"] == 3
    assert same_weights(out / "federation" / "global.h5", out / "federation" / "last.h5")
    record = out / "federation" / "history.json"
    first = json.loads(record.read_text())
    assert first["selection"]["rounds_kept"] == 3
    # the round best-val keeps (the rule's own replay of the recorded scores)
    best = BestRound.replay((s["round"], s["score"]) for s in first["selection"]["val_metric"]).round
    kept_scores = [s for s in first["selection"]["val_metric"] if s["round"] <= best]
    # the coordinator dies right after the best round's evaluation
    first["rounds"] = [r for r in first["rounds"] if r["round"] <= best]
    first["status"] = "running"
    first.pop("finished_at", None)
    record.write_text(json.dumps(first))
    # Execute: resume with the default --keep best-val and train to round 5
    assert run_guarded(app, [*args, "--rounds", "5"]) == 0
    # Assert: the recorded rounds and scores survive; the choice is the rule over all rounds
    history = json.loads(record.read_text())
    assert history["resumed"][-1]["after_round"] == best
    chosen = history["selection"]
    assert [s for s in chosen["val_metric"] if s["round"] <= best] == kept_scores
    scores = {s["round"]: s["score"] for s in chosen["val_metric"]}
    assert sorted(scores) == [1, 2, 3, 4, 5]
    top = max(scores.values())
    assert chosen["rounds_kept"] == max(r for r, v in scores.items() if v >= top - 1e-9)
    if all(v < scores[best] for r, v in scores.items() if r > best):
        assert chosen["rounds_kept"] == best  # still reports the round found before the restart
    summary = json.loads((out / "summary.json").read_text())
    assert summary["federated"]["rounds_kept"] == chosen["rounds_kept"]
    assert same_weights(out / "federation" / "global.h5",
                        out / "federation" / "models" / f"round-{chosen['rounds_kept']:03d}.h5")
    assert same_weights(out / "federation" / "last.h5", out / "federation" / "models" / "round-005.h5")
