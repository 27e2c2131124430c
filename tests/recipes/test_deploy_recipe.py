"""A recipe in the deployment runtime: `fedsplit up --recipe` end to end (SuperLink, coordinator,
three `fedsplit site run` agents), and `fedsplit site run --recipe`'s node config."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest
from fedsplit.orchestration.flower_runtime import node_config
from fedsplit.protocol import read_weights
from fedsplit.protocol.recipe import RecipeModelId
from flwr.common.config import parse_config_args

FEDSPLIT = [sys.executable, "-c", "import sys; from fedsplit.cli.app import main; sys.exit(main())"]


def fedsplit(args: list[str], recipe_dir: Path, timeout: float = 900) -> subprocess.CompletedProcess:
    env = {**os.environ, "PYTHONPATH": str(recipe_dir)}
    return subprocess.run([*FEDSPLIT, *args], env=env, capture_output=True, text=True,
                          timeout=timeout, cwd=recipe_dir)


def test_node_config_carries_the_hospitals_recipe(tmp_path: Path) -> None:
    """Flower's own parser reads back the data path, the recipe and its JSON parameters."""
    text = node_config(tmp_path / "north", "north", recipe="png_cnn:PngCNN",
                       recipe_params='{"channels": 8, "clip": 2.5}')
    parsed = parse_config_args([text])
    assert parsed == {"data-path": str(tmp_path / "north"), "site-name": "north",
                      "recipe": "png_cnn:PngCNN", "recipe-params": '{"channels": 8, "clip": 2.5}'}
    assert "recipe" not in parse_config_args([node_config(tmp_path, "north")])


def test_site_run_refuses_bad_recipe_params_before_starting(recipe_dir: Path,
                                                            png_hospitals: dict[str, Path]) -> None:
    """The hospital's recipe is imported and its params validated before any SuperNode starts."""
    done = fedsplit(["site", "run", "--superlink", "127.0.0.1:9", "--insecure", "--data",
                     str(png_hospitals["north"]), "--recipe", "png_cnn:PngCNN",
                     "--recipe-params", '{"channels": 0}'], recipe_dir, timeout=120)
    assert done.returncode != 0
    assert "png-cnn version 1.0 refuses its parameters" in done.stdout + done.stderr


@pytest.mark.slow
def test_up_runs_a_recipe(recipe_dir: Path, tmp_path: Path) -> None:
    """`fedsplit up --recipe`: every local hospital trains the recipe's model; the coordinator
    records it (model id, history) without importing it; hospitals report its metrics."""
    work = tmp_path / "up"
    done = fedsplit(["up", "--dataset", "digits", "--sites", "3", "--rounds", "2",
                     "--recipe", "png_cnn:PngCNN", "--recipe-params", '{"channels": 8}',
                     "--no-admin", "--work", str(work), "--timeout", "800"], recipe_dir)
    assert done.returncode == 0, done.stdout[-3000:] + done.stderr[-3000:]
    history = json.loads((work / "out" / "history.json").read_text())
    assert history["status"] == "finished"
    made = RecipeModelId.from_id(history["model_id"])
    assert (made.recipe.name, made.recipe.params["channels"]) == ("png-cnn", 8)
    last = history["rounds"][-1]["evaluate"]["metrics"]
    assert {"accuracy", "macro-f1"} <= set(last) and last["accuracy"] > 0.5, last
    assert read_weights(work / "out" / "global.h5").model == history["model_id"]


@pytest.mark.slow
def test_hospital_on_another_recipe_version_is_refused_before_round_1(
        recipe_dir: Path, tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """Three `fedsplit site run` agents, south with --recipe png_cnn_v2:PngCNNv2 (version 1.1):
    the coordinator refuses the run before round 1, naming south and the versions."""
    from fedsplit.orchestration.experiment import prepare_partitions
    from fedsplit.orchestration.flower_runtime import FlowerRunError
    from fedsplit.orchestration.local_federation import LocalFederation, Site
    from fedsplit.protocol.config import RunConfig

    monkeypatch.setenv("PYTHONPATH", str(recipe_dir))  # every agent process imports the recipes
    files = prepare_partitions(tmp_path / "sites", "digits", 3)
    recipes = {"hospital-1": "png_cnn:PngCNN", "hospital-2": "png_cnn_v2:PngCNNv2",
               "hospital-3": "png_cnn:PngCNN"}
    sites = [Site(name, path.parent, recipe=recipes[name]) for name, path in files.items()]
    cfg = RunConfig(num_server_rounds=2, min_nodes=3, round_timeout=120,
                    out_dir=str(tmp_path / "out"))
    with LocalFederation(tmp_path / "work", sites, admin_port=None, say=lambda _m: None) as fed:
        fed.start()
        with pytest.raises(FlowerRunError, match=r"hospital hospital-2 runs png-cnn version 1\.1 "
                                                 r"\(version '1\.1' vs '1\.0'\)"):
            fed.run(cfg, timeout=600)
    history = json.loads((tmp_path / "out" / "history.json").read_text())
    assert history["status"] == "failed" and not history["rounds"]


@pytest.mark.slow
def test_site_agents_read_their_png_folders(recipe_dir: Path, png_hospitals: dict[str, Path],
                                            tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """Three `fedsplit site run --data FOLDER --recipe png_cnn:PngCNN` agents, each reading its
    own PNG folder with the recipe's reader: two rounds, the recipe's metrics per hospital."""
    from fedsplit.orchestration.local_federation import LocalFederation, Site
    from fedsplit.protocol.config import RunConfig

    monkeypatch.setenv("PYTHONPATH", str(recipe_dir))
    sites = [Site(name, png_hospitals[name], recipe="png_cnn:PngCNN")
             for name in ("north", "south", "east")]
    cfg = RunConfig(num_server_rounds=2, min_nodes=3, round_timeout=300,
                    out_dir=str(tmp_path / "out"))
    with LocalFederation(tmp_path / "work", sites, admin_port=None, say=lambda _m: None) as fed:
        fed.start()
        record = fed.run(cfg, timeout=800)
    assert record.status == "finished"
    history = json.loads((tmp_path / "out" / "history.json").read_text())
    assert RecipeModelId.from_id(history["model_id"]).recipe.label() == "png-cnn version 1.0"
    evaluated = history["rounds"][-1]["evaluate"]
    assert {s["site"] for s in evaluated["sites"]} == {"north", "south", "east"}
    assert evaluated["metrics"]["accuracy"] > 0.6 and "macro-f1" in evaluated["metrics"]
