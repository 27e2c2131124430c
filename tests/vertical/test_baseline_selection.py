"""Vertical baselines: the federation's steps, stopped at the round a validation cut picks."""

from __future__ import annotations

from pathlib import Path

import numpy as np
import pytest
from fedsplit.orchestration.vertical.datasets import write_bundled
from fedsplit.orchestration.vertical.local import baselines, best_round, train_baseline, validation_cut
from fedsplit.protocol.vertical.config import FusionParams
from fedsplit.server.vertical.coordinator import LabelTable, read_label_file, split_rows

PARAMS = FusionParams(steps_per_round=5, embedding_dim=8, min_overlap=0.0, fill="drop")
ROUNDS = 4


@pytest.fixture
def diabetes(tmp_path: Path) -> tuple[list[Path], LabelTable]:
    """Diabetes (regression), 2 sites of 5 columns, every patient at both."""
    files = write_bundled("diabetes", 2, tmp_path / "db", seed=0)
    return files.sites, read_label_file(str(files.labels), files.id_column, files.target, None)


def test_the_validation_cut_is_drawn_from_training_rows_only() -> None:
    train, test = split_rows(442, 0.2, seed=3)
    keep, val = validation_cut(train, seed=3)
    assert len(val) == round(len(train) * 0.2)
    assert set(keep) | set(val) == set(train) and not set(keep) & set(val)
    assert not set(val) & set(test)


def test_the_kept_round_scores_best_on_validation_and_is_blind_to_test_labels(
        diabetes: tuple[list[Path], LabelTable]) -> None:
    # Prepare
    sites, labels = diabetes
    _, test = split_rows(len(labels.ids), 0.2, seed=0)
    scrambled = labels.y.copy()
    scrambled[test] = np.random.default_rng(1).permutation(scrambled[test]) * 3.0
    blind = LabelTable(labels.ids, scrambled, labels.task, labels.classes)
    # Execute
    chosen = best_round(labels, sites, "patient_id", PARAMS, ROUNDS, seed=0)
    again = best_round(blind, sites, "patient_id", PARAMS, ROUNDS, seed=0)
    # Assert
    scores = chosen.val_metric
    assert len(scores) == ROUNDS
    assert scores[chosen.rounds_kept - 1] == max(scores)
    assert all(s < max(scores) for s in scores[chosen.rounds_kept:])  # ties go to the later round
    assert chosen.val_rows == round((len(labels.ids) - len(test)) * 0.2)
    # held-out labels play no part in the choice
    assert (again.rounds_kept, again.val_metric, again.val_rows) == (
        chosen.rounds_kept, chosen.val_metric, chosen.val_rows)


def test_a_baseline_reports_the_chosen_round_and_still_shows_every_round(
        diabetes: tuple[list[Path], LabelTable]) -> None:
    sites, labels = diabetes
    result = train_baseline(labels, sites, "patient_id", PARAMS, ROUNDS, seed=0)
    assert len(result.per_round) == ROUNDS
    assert result.val_metric[result.rounds_kept - 1] == max(result.val_metric)
    assert result.metrics == result.per_round[result.rounds_kept - 1]
    assert result.final_metrics == result.per_round[-1]
    assert set(result.metrics) == {"r2", "rmse"}


def test_every_baseline_is_selected(diabetes: tuple[list[Path], LabelTable]) -> None:
    sites, labels = diabetes
    base = baselines(labels, sites, "patient_id", PARAMS.model_copy(update={"fill": "nearest"}),
                     ROUNDS, seed=0)
    for entry in [base.centralized, *base.local_only]:
        assert 1 <= entry.rounds_kept <= ROUNDS
        assert entry.metrics == entry.per_round[entry.rounds_kept - 1]
    assert [s.site for s in base.local_only] == ["site-0", "site-1"]
