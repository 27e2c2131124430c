"""The models table shows the federated row's kept round and its validation score (issue 26),
also when a round made no model (its validation scores are listed by round number)."""

from __future__ import annotations

import io

from fedsplit.orchestration.tables import models_table
from rich.console import Console


def _scores(score: float) -> dict:
    return {"metrics": {"accuracy": score}, "mean_per_site": {"accuracy": score},
            "per_site": {"a": {"accuracy": score}}}


def test_the_federated_row_shows_its_kept_round_and_that_rounds_score() -> None:
    # Prepare: round 2 made no model, so the candidates are rounds 1, 3 and 4
    summary = {
        "task": "classification", "strategy": "fedavg", "config": {"num-server-rounds": 4},
        "test_examples_per_site": {"a": 10},
        "centralized": {**_scores(0.7), "num_examples": 40, "rounds_kept": 1,
                        "val_metric": [0.61, 0.6, 0.6, 0.6]},
        "local_only": [],
        "federated": {**_scores(0.8), "num_examples": 40, "keep": "best-val", "rounds_kept": 3,
                      "val_metric": [0.5, 0.777, 0.6], "val_rounds": [1, 3, 4]},
    }
    buffer = io.StringIO()
    # Execute
    Console(file=buffer, width=120).print(models_table(summary))
    # Assert
    federated = next(line for line in buffer.getvalue().splitlines() if "federated" in line)
    assert "3 of 4" in federated and "0.777" in federated
    centralized = next(line for line in buffer.getvalue().splitlines() if "centralized" in line)
    assert "1 of 4" in centralized and "0.610" in centralized
