"""The fused model is kept by the rule every baseline follows (issue 26).

The label holder cuts validation rows from its training rows; after each round the fused model
is scored on them and the best round by the task metric is kept (ties to the later round), or
the last one with ``keep=last``. The kept round's head and branches are what is saved where
``fedsplit vertical predict`` reads them; the last round's go to ``last/``.
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import numpy as np
import pandas as pd
import pytest
from fedsplit.client.vertical.site import SiteAgent
from fedsplit.orchestration.vertical.local import LocalTransport, baselines, train_kept
from fedsplit.protocol.record.vertical import VerticalEvaluation, VerticalRunRecord
from fedsplit.protocol.vertical.config import FusionParams
from fedsplit.server.vertical.app import train_and_save
from fedsplit.server.vertical.coordinator import LabelTable, VerticalCoordinator, read_label_file

PARAMS = FusionParams(steps_per_round=4, embedding_dim=4, head_hidden=8, batch_size=32, fill="mean")


def diabetes_case(folder: Path, seed: int = 0) -> tuple[list[Path], Path]:
    """sklearn's diabetes split by columns: one site with age/sex/bmi/bp and every patient, one
    with the six serum columns and 85% of them; each file (and the labels) in its own order."""
    from sklearn.datasets import load_diabetes

    data = load_diabetes()
    rng = np.random.default_rng(seed)
    ids = np.array([f"P{i:04d}" for i in rng.permutation(len(data.target))])
    frame = pd.DataFrame(data.data, columns=data.feature_names)
    frame.insert(0, "id", ids)
    folder.mkdir(parents=True, exist_ok=True)
    sites = [folder / "demographics.csv", folder / "serum.csv"]
    frame[["id", "age", "sex", "bmi", "bp"]].sample(frac=1.0, random_state=seed + 1).to_csv(
        sites[0], index=False)
    frame[["id", "s1", "s2", "s3", "s4", "s5", "s6"]].sample(frac=0.85, random_state=seed + 2).to_csv(
        sites[1], index=False)
    labels = folder / "labels.csv"
    pd.DataFrame({"id": ids, "target": data.target}).sample(
        frac=1.0, random_state=seed + 3).to_csv(labels, index=False)
    return sites, labels


class Scripted(VerticalCoordinator):
    """Real split training and saving; only the validation score of each round is scripted.

    Keeps, per round, the head's and every site's branch parameters as they were when scored.
    """

    def __init__(self, *args: Any, script: list[float], transport: LocalTransport,
                 **kwargs: Any) -> None:
        super().__init__(*args, send=transport, **kwargs)
        self.script = list(script)
        self.local = transport
        self.snapshots: list[dict[str, np.ndarray]] = []

    def evaluate(self, rows: np.ndarray | None = None) -> VerticalEvaluation:
        result = super().evaluate(rows)
        if rows is self.val_rows:
            result.metrics["r2"] = self.script.pop(0)
            assert self.head is not None
            state = {f"head.{k}": v.detach().numpy().copy()
                     for k, v in self.head.module.state_dict().items()}
            for node, site in self.local.states.items():
                state.update({f"site{node}.branch.{k[len('branch.param.'):]}": v.copy()
                              for k, v in site.arrays.items() if k.startswith("branch.param.")})
            self.snapshots.append(state)
        return result


def scripted_run(tmp_path: Path, script: list[float], keep: str) -> tuple[Scripted, dict[str, Any]]:
    sites, label_file = diabetes_case(tmp_path / "data")
    labels = read_label_file(str(label_file), "id", "target", "regression")
    agents = {i: SiteAgent(str(p), "id", f"site-{i}", str(tmp_path / f"site-{i}"))
              for i, p in enumerate(sites)}
    coordinator = Scripted(labels, PARAMS, list(agents), transport=LocalTransport(agents),
                           script=script, val_fraction=0.2 if keep == "best-val" else 0.0)
    coordinator.align()
    coordinator.prepare()
    record = VerticalRunRecord(rounds=[])
    train_and_save(coordinator, len(script), keep, tmp_path / "out", record,
                   lambda: record.save(tmp_path / "history.json"))
    return coordinator, record.to_json()


def saved(tmp_path: Path, slot: str) -> dict[str, np.ndarray]:
    """The head and branches saved in ``slot`` ('' = the kept model, 'last')."""
    out: dict[str, np.ndarray] = {}
    with np.load(tmp_path / "out" / slot / "head" / "head.npz") as npz:
        out.update({f"head.{k}": npz[k] for k in npz.files})
    for node in (0, 1):
        with np.load(tmp_path / f"site-{node}" / slot / "branch.npz") as npz:
            out.update({f"site{node}.branch.{k}": npz[k] for k in npz.files})
    return out


def assert_same(a: dict[str, np.ndarray], b: dict[str, np.ndarray]) -> None:
    shared = set(a) & set(b)
    assert shared and all(k.startswith(("head.", "site")) for k in shared)
    assert {k.split(".")[0] for k in shared} == {"head", "site0", "site1"}
    for key in shared:
        np.testing.assert_array_equal(a[key], b[key], err_msg=key)


def test_the_best_validation_round_is_saved_and_a_tie_goes_to_the_later_round(tmp_path: Path) -> None:
    # Prepare / Execute: rounds 2 and 4 tie at the top
    coordinator, history = scripted_run(tmp_path, [0.1, 0.5, 0.3, 0.5, 0.2], "best-val")
    # Assert
    chosen = history["selection"]
    assert chosen == {"keep": "best-val", "metric": "r2", "rounds_kept": 4, "val_score": 0.5,
                      "val_metric": [0.1, 0.5, 0.3, 0.5, 0.2]}
    assert_same(saved(tmp_path, ""), coordinator.snapshots[3])
    assert_same(saved(tmp_path, "last"), coordinator.snapshots[4])
    with pytest.raises(AssertionError):  # the kept model is not the last one
        assert_same(saved(tmp_path, ""), coordinator.snapshots[4])
    # validation rows: from the training label rows, never trained on, never test rows
    val, train, test = (set(coordinator.val_rows), set(coordinator.train_rows),
                        set(coordinator.test_rows))
    assert len(val) > 50 and not val & train and not val & test
    assert json.loads((tmp_path / "history.json").read_text())["selection"]["rounds_kept"] == 4


def test_keep_last_saves_the_last_round_and_cuts_no_validation_rows(tmp_path: Path) -> None:
    sites, label_file = diabetes_case(tmp_path / "data")
    labels = read_label_file(str(label_file), "id", "target", "regression")
    agents = {i: SiteAgent(str(p), "id", f"site-{i}", str(tmp_path / f"site-{i}"))
              for i, p in enumerate(sites)}
    coordinator = VerticalCoordinator(labels, PARAMS, list(agents), LocalTransport(agents))
    coordinator.align()
    coordinator.prepare()
    record = VerticalRunRecord(rounds=[])
    rule = train_and_save(coordinator, 3, "last", tmp_path / "out", record, lambda: None)
    assert rule.round == 3 and record.selection is not None and record.selection.rounds_kept == 3
    assert len(coordinator.val_rows) == 0
    assert_same(saved(tmp_path, ""), saved(tmp_path, "last"))


def test_fused_and_baselines_keep_rounds_by_the_same_rule_and_rows(tmp_path: Path) -> None:
    # Prepare
    sites, label_file = diabetes_case(tmp_path / "data")
    labels = read_label_file(str(label_file), "id", "target", "regression")
    # Execute
    fused = train_kept(labels, sites, "id", PARAMS, 5)
    last = train_kept(labels, sites, "id", PARAMS, 5, keep="last")
    # Assert: the kept round scores best on validation (ties later) and its test score is reported
    scores = fused.val_metric
    assert fused.rounds_kept == max(r for r, s in enumerate(scores, 1) if s == max(scores))
    assert fused.per_round is not None and fused.rounds_kept is not None
    assert fused.metrics == fused.per_round[fused.rounds_kept - 1]
    assert last.rounds_kept == 5 and last.val_rows == 0 and last.val_metric == [None] * 5
    assert last.num_examples > fused.num_examples  # keep=last trains on the validation rows too
    assert fused.val_rows == round((len(labels.ids) - (fused.test_examples or 0)) * 0.2)


@pytest.mark.slow
def test_on_the_diabetes_case_the_fused_model_is_as_good_as_centralized(tmp_path: Path) -> None:
    """The issue's case: 20 rounds over-train; each model keeps its best validation round."""
    # Prepare
    sites, label_file = diabetes_case(tmp_path / "data")
    labels: LabelTable = read_label_file(str(label_file), "id", "target", "regression")
    params = FusionParams()  # `fedsplit vertical simulate`'s defaults
    # Execute
    fused = train_kept(labels, sites, "id", params, 20)
    base = baselines(labels, sites, "id", params, 20)
    # Assert
    central = base.centralized
    assert fused.rounds_kept < 20 and central.rounds_kept < 20
    assert fused.metrics["r2"] >= central.metrics["r2"] - 0.03
    assert fused.final_metrics is not None
    assert fused.metrics["r2"] > fused.final_metrics["r2"]  # the last round over-trained
