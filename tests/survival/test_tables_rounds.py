"""simulate's models table shows the rounds a model really had (issue 35): an exact Newton fit
takes its own number of rounds, not ``--rounds`` ("6 of 3" before)."""

from __future__ import annotations

import io

from fedsplit.orchestration.tables import models_table
from rich.console import Console


def scores(c: float) -> dict:
    return {"metrics": {"c_index": c}, "mean_per_site": {"c_index": c},
            "per_site": {"a": {"c_index": c}, "b": {"c_index": c}}}


def rendered(summary: dict) -> str:
    buffer = io.StringIO()
    Console(file=buffer, width=100).print(models_table(summary))
    return buffer.getvalue()


def test_kept_round_counts_the_rounds_each_model_had() -> None:
    newton = {
        "task": "survival", "selection_metric": "c_index", "config": {"num-server-rounds": 3},
        "test_examples_per_site": {"a": 10, "b": 12},
        "centralized": {**scores(0.70), "num_examples": 90, "rounds_kept": 1,
                        "val_metric": [0.71]},
        "local_only": [{**scores(0.6), "site": "a", "num_examples": 40, "rounds_kept": 1,
                        "val_metric": [0.66]}],
        "federated": {**scores(0.72), "num_examples": 90, "keep": "last", "rounds_kept": 6,
                      "val_metric": [None] * 6, "val_rounds": [1, 2, 3, 4, 5, 6]},
        "rounds": [{"round": r, **scores(0.7)} for r in range(1, 7)],
    }
    text = rendered(newton)
    assert "6 of 6" in text and "1 of 1" in text and "of 3" not in text
    # local steps: every model had the run's rounds
    steps = {**newton, "centralized": {**newton["centralized"], "rounds_kept": 2,
                                       "val_metric": [0.7, 0.72, 0.71]},
             "federated": {**newton["federated"], "rounds_kept": 2, "val_metric": [0.6, 0.7, 0.65],
                           "val_rounds": [1, 2, 3]},
             "local_only": [], "rounds": [{"round": r, **scores(0.7)} for r in range(1, 4)]}
    text = rendered(steps)
    assert text.count("2 of 3") == 2 and "of 6" not in text
