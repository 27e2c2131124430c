"""`fedsplit simulate`'s tables read whole in an 80-column pipe."""

from __future__ import annotations

import io

from fedsplit.orchestration.tables import metric_key, summary_tables
from rich.console import Console

SITES = {"cleveland": 61, "hungary": 59, "switzerland": 25, "va-long-beach": 40,
         "university-hospital-basel": 33, "charite-berlin": 52}


def _entry(score: float, rows: int, kept: int | None = None) -> dict:
    entry = {
        "num_examples": rows,
        "metrics": {"accuracy": score},
        "mean_per_site": {"accuracy": score - 0.01},
        "per_site": {name: {"accuracy": score + i / 1000} for i, name in enumerate(SITES)},
    }
    if kept is not None:
        entry |= {"rounds_kept": kept, "val_metric": [0.5 + r / 100 for r in range(10)]}
    return entry


def _summary(personalized: bool = True) -> dict:
    summary = {
        "task": "classification", "strategy": "trimmed-mean", "server_opt": {"name": "adam"},
        "test_examples": sum(SITES.values()), "test_examples_per_site": SITES,
        "config": {"num-server-rounds": 10},
        "centralized": _entry(0.8033, 587, kept=2),
        "local_only": [{"site": name, **_entry(0.6 + i / 100, 100 + i, kept=i + 1)}
                       for i, name in enumerate(SITES)],
        "federated": _entry(0.8323, 587, kept=7),
    }
    if personalized:
        summary["personalized"] = {**_entry(0.8523, 587), "prior_test": {}}
    return summary


def _render(summary: dict) -> str:
    buffer = io.StringIO()
    console = Console(file=buffer)  # not a terminal: rich's default width, 80 columns
    assert console.width == 80
    for table in summary_tables(summary):
        console.print(table)
    return buffer.getvalue()


def test_tables_fit_80_columns_in_a_pipe_with_every_name_whole() -> None:
    text = _render(_summary())
    assert max(len(line) for line in text.splitlines()) <= 80
    assert "…" not in text
    for name, rows in SITES.items():
        assert f"{name} ({rows})" in text
        assert f"{name} alone" in text
    for label in ("centralized (pooled data)", "federated (trimmed-mean + adam)", "federated + prior",
                  "+ prior", "2 of 10", "7 of 10"):
        assert label in text, label


def test_hospital_rows_carry_each_models_score_on_that_hospitals_patients() -> None:
    summary = _summary(personalized=False)
    lines = _render(summary).splitlines()
    row = next(line for line in lines if line.lstrip().startswith("hungary (59)"))
    # centralized, hungary's own model alone, federated: each scored on hungary's test patients
    assert row.split()[2:] == ["0.804", "0.611", "0.833"]
    mean = next(line for line in lines if line.lstrip().startswith("mean per hospital"))
    own = [0.6 + i / 100 + i / 1000 for i in range(len(SITES))]  # each alone model, own patients
    assert mean.split()[4] == f"{sum(own) / len(own):.3f}"
    kept = next(line for line in lines if line.lstrip().startswith("federated (trimmed-mean"))
    assert "7 of 10" in kept and "0.560" in kept  # the kept round's validation score


def test_metric_key_follows_the_runs_selection_metric() -> None:
    assert metric_key({"task": "classification"}) == "accuracy"
    assert metric_key({"task": "regression"}) == "r2"
    assert metric_key({"task": "survival", "selection_metric": "c_index"}) == "c_index"
