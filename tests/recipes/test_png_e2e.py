"""End to end: a recipe that lives outside fedsplit (a small CNN on PNG folders, importable only
through PYTHONPATH) in `fedsplit simulate` with three hospitals, then `fedsplit predict` on a
folder of PNG files; and the same recipe under DP, secure aggregation and the median rule."""

from __future__ import annotations

import json
import subprocess
from collections.abc import Callable
from pathlib import Path

import pandas as pd
import pytest
from fedsplit.protocol import read_weights
from fedsplit.protocol.recipe import RecipeModelId

RECIPE = "png_cnn:PngCNN"
Cli = Callable[..., subprocess.CompletedProcess]  # the `fedsplit` fixture (conftest.py)


def site_args(png_hospitals: dict[str, Path]) -> list[str]:
    return [arg for name in ("north", "south", "east")
            for arg in ("--site", f"{name}={png_hospitals[name]}")]


@pytest.mark.slow
def test_png_recipe_in_simulate_then_predict(fedsplit: Cli, recipe_dir: Path, png_hospitals: dict[str, Path],
                                             tmp_path: Path) -> None:
    """Per-hospital accuracy with the recipe's metrics; federated beats every hospital alone;
    the weight file records the recipe; predict scores a flat PNG folder with it."""
    out = tmp_path / "run"
    done = fedsplit(["simulate", *site_args(png_hospitals), "--recipe", RECIPE,
                     "--recipe-params", '{"channels": 16}', "--rounds", "8", "--out", str(out)],
                    recipe_dir)
    assert done.returncode == 0, done.stdout[-3000:] + done.stderr[-3000:]
    summary = json.loads((out / "summary.json").read_text())
    assert summary["recipe"] == {"name": "png-cnn", "version": "1.0",
                                 "params": {"channels": 16, "clip": 5.0}}
    assert summary["metric_names"] == ["loss", "accuracy", "macro-f1"]
    fed = summary["federated"]
    assert set(fed["per_site"]) == {"north", "south", "east"}
    for name, scores in fed["per_site"].items():
        assert set(scores) == {"loss", "accuracy", "macro-f1"}, name
        assert scores["accuracy"] > 0.8, (name, scores)
    for alone in summary["local_only"]:  # federated beats every hospital alone, pooled and mean
        assert fed["metrics"]["accuracy"] > alone["metrics"]["accuracy"], alone["site"]
        assert fed["mean_per_site"]["accuracy"] > alone["mean_per_site"]["accuracy"], alone["site"]
    assert "north" in done.stdout and "federated" in done.stdout
    # the hospitals' own evaluation used the recipe's metrics too (history.json)
    history = json.loads((out / "federation" / "history.json").read_text())
    assert "macro-f1" in history["rounds"][-1]["evaluate"]["metrics"]
    model = out / "federation" / "global.h5"
    recorded = RecipeModelId.from_id(read_weights(model).model)
    assert recorded.recipe.label() == "png-cnn version 1.0"
    assert recorded.input_shape == (1, 8, 8) and recorded.num_outputs == 10

    predictions = tmp_path / "pred.csv"
    done = fedsplit(["predict", str(png_hospitals["unlabelled"]), "--model", str(model),
                     "--recipe", RECIPE, "-o", str(predictions)], recipe_dir)
    assert done.returncode == 0, done.stdout[-3000:] + done.stderr[-3000:]
    scored = pd.read_csv(predictions).merge(pd.read_csv(png_hospitals["labels"]), on="input")
    assert len(scored) == 40 and {f"p_{k}" for k in range(10)} <= set(scored.columns)
    assert (scored["predicted"] == scored["label"]).mean() >= 0.85

    refused = fedsplit(["predict", str(png_hospitals["unlabelled"]), "--model", str(model),
                        "-o", str(tmp_path / "no.csv")], None)
    assert refused.returncode != 0
    assert "png-cnn version 1.0" in refused.stdout + refused.stderr


@pytest.mark.slow
@pytest.mark.parametrize(("extra", "least"), [(["--dp", "epsilon=8,delta=1e-5"], 0.2),
                                              (["--secure-aggregation", "on"], 0.7),
                                              (["--strategy", "median"], 0.7)],
                         ids=["dp", "secagg", "median"])
def test_png_recipe_with_dp_secure_aggregation_and_median(fedsplit: Cli, recipe_dir: Path,
                                                          png_hospitals: dict[str, Path],
                                                          tmp_path: Path, extra: list[str],
                                                          least: float) -> None:
    """The recipe trains under patient-level DP-SGD, SecAgg+ and the coordinate-wise median
    (3 rounds; DP-SGD's noise on ~200 images per hospital leaves it far above chance (0.1) but
    below the others)."""
    out = tmp_path / "run"
    done = fedsplit(["simulate", *site_args(png_hospitals), "--recipe", RECIPE, "--rounds", "3",
                     "--out", str(out), *extra], recipe_dir)
    assert done.returncode == 0, done.stdout[-3000:] + done.stderr[-3000:]
    summary = json.loads((out / "summary.json").read_text())
    fed = summary["federated"]
    assert set(fed["per_site"]) == {"north", "south", "east"}
    assert "macro-f1" in fed["mean_per_site"]
    assert fed["metrics"]["accuracy"] > least, fed["metrics"]


@pytest.mark.slow
def test_tabular_recipe_keeps_rounds_by_its_own_metric(fedsplit: Cli, recipe_dir: Path,
                                                      tmp_path: Path) -> None:
    """A tabular recipe with a custom loss on breast-cancer: rounds are kept by its selection
    metric (balanced accuracy), which the summary and the web view's curves use."""
    from fedsplit.server.admin.ui.curves import primary_metric, run_charts
    from fedsplit.server.admin.ui.runs import load_run

    out = tmp_path / "run"
    done = fedsplit(["simulate", "--dataset", "breast-cancer", "--sites", "3", "--rounds", "4",
                     "--recipe", "tabular_loss:FocalMLP", "--recipe-params", '{"gamma": 2.0}',
                     "--out", str(out)], recipe_dir)
    assert done.returncode == 0, done.stdout[-3000:] + done.stderr[-3000:]
    summary = json.loads((out / "summary.json").read_text())
    assert summary["selection_metric"] == "balanced-accuracy"
    assert summary["recipe"]["params"] == {"gamma": 2.0, "width": 32}
    assert summary["federated"]["metrics"]["balanced-accuracy"] > 0.9
    history = json.loads((out / "federation" / "history.json").read_text())
    assert history["selection"]["metric"] == "balanced-accuracy"
    run = load_run("recipe", out / "federation")
    assert primary_metric(run) == "balanced-accuracy"
    assert "Global balanced-accuracy per round" in {c.title for c in run_charts(run)}
