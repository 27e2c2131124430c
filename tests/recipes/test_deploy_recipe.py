"""A recipe in the deployment runtime: one deployment (SuperLink, coordinator, `fedsplit site run
--recipe` agents on PNG folders) that runs the recipe and then refuses a hospital on another
recipe version; and `fedsplit site run --recipe`'s node config.

`fedsplit up --recipe` (the recipe in the run config, the local hospitals on the digits
partitions) runs end to end in tests/deploy/test_deploy_up_e2e.py, in the same `fedsplit up
--tls` deployment as the fault injection there."""

from __future__ import annotations

import json
import os
import subprocess
import sys
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import pytest
from fedsplit.orchestration.flower_runtime import node_config
from fedsplit.protocol import read_weights
from fedsplit.protocol.errors import ConfigError
from fedsplit.protocol.recipe import RecipeModelId
from flwr.common.config import parse_config_args

FEDSPLIT = [sys.executable, "-c", "import sys; from fedsplit.cli.app import main; sys.exit(main())"]


def fedsplit(args: list[str], recipe_dir: Path, timeout: float = 900) -> subprocess.CompletedProcess:
    env = {**os.environ, "PYTHONPATH": os.pathsep.join(
        filter(None, [str(recipe_dir), os.environ.get("PYTHONPATH")]))}
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


@pytest.mark.slow  # a fresh process or an end-to-end run: seconds (make test)
def test_site_run_refuses_bad_recipe_params_before_starting(recipe_dir: Path,
                                                            png_hospitals: dict[str, Path]) -> None:
    """The hospital's recipe is imported and its params validated before any SuperNode starts."""
    done = fedsplit(["site", "run", "--superlink", "127.0.0.1:9", "--insecure", "--data",
                     str(png_hospitals["north"]), "--recipe", "png_cnn:PngCNN",
                     "--recipe-params", '{"channels": 0}'], recipe_dir, timeout=120)
    assert done.returncode != 0
    assert "png-cnn version 1.0 refuses its parameters" in done.stdout + done.stderr


# --- one deployment of `fedsplit site run --recipe` agents on PNG folders, two runs ---------


@dataclass
class DeploymentRuns:
    """What the two runs of the shared PNG deployment left: the recipe run's record and
    history, then the refused run's error message and history."""

    record_status: str
    history: dict[str, Any]
    global_model: Path
    refusal: str
    refused_history: dict[str, Any]
    seconds: dict[str, float]


@pytest.fixture(scope="module")
def png_deployment(recipe_dir: Path, png_hospitals: dict[str, Path],
                   tmp_path_factory: pytest.TempPathFactory) -> DeploymentRuns:
    """One SuperLink + coordinator with three `fedsplit site run --data FOLDER --recipe
    png_cnn:PngCNN` agents (north, south, east), each reading its own PNG folder with the
    recipe's reader: first a two-round run; then a fourth agent, west, joins with
    --recipe png_cnn_v2:PngCNNv2 (version 1.1) and a run that needs all four is refused before
    round 1. (Started once: the two runs used to be two deployments.)"""
    from fedsplit.orchestration.local_federation import LocalFederation, Site
    from fedsplit.protocol.config import RunConfig

    root = tmp_path_factory.mktemp("png-deployment")
    sites = [Site(name, png_hospitals[name], recipe="png_cnn:PngCNN")
             for name in ("north", "south", "east")]
    seconds: dict[str, float] = {}
    with pytest.MonkeyPatch.context() as patch:
        # every agent process imports the recipes
        patch.setenv("PYTHONPATH", str(recipe_dir), prepend=os.pathsep)
        with LocalFederation(root / "work", sites, admin_port=None, say=lambda _m: None) as fed:
            t0 = time.monotonic()
            fed.start()
            cfg = RunConfig(num_server_rounds=2, min_nodes=3, round_timeout=300,
                            out_dir=str(root / "out"))
            record = fed.run(cfg, timeout=800)
            seconds["recipe run"] = time.monotonic() - t0
            # west: the same recipe one version later (any data: the run stops before round 1)
            west = Site("west", png_hospitals["north"], recipe="png_cnn_v2:PngCNNv2")
            fed.sites.append(west)
            fed.start_site(west)
            t1 = time.monotonic()
            refused = RunConfig(num_server_rounds=2, min_nodes=4, round_timeout=120,
                                out_dir=str(root / "refused"))
            with pytest.raises(ConfigError) as caught:  # the coordinator's recorded error
                fed.run(refused, timeout=600)
            seconds["refused run"] = time.monotonic() - t1
    return DeploymentRuns(
        record_status=record.status,
        history=json.loads((root / "out" / "history.json").read_text()),
        global_model=root / "out" / "global.h5",
        refusal=str(caught.value),
        refused_history=json.loads((root / "refused" / "history.json").read_text()),
        seconds=seconds,
    )


@pytest.mark.slow
def test_site_agents_read_their_png_folders(png_deployment: DeploymentRuns) -> None:
    """Three `fedsplit site run --data FOLDER --recipe png_cnn:PngCNN` agents, each reading its
    own PNG folder with the recipe's reader: two rounds, the recipe's metrics per hospital."""
    assert png_deployment.record_status == "finished"
    history = png_deployment.history
    assert RecipeModelId.from_id(history["model_id"]).recipe.label() == "png-cnn version 1.0"
    evaluated = history["rounds"][-1]["evaluate"]
    assert {s["site"] for s in evaluated["sites"]} == {"north", "south", "east"}
    assert evaluated["metrics"]["accuracy"] > 0.6 and "macro-f1" in evaluated["metrics"]
    assert read_weights(png_deployment.global_model).model == history["model_id"]
    print(f"PNG deployment: {png_deployment.seconds}")


@pytest.mark.slow
def test_hospital_on_another_recipe_version_is_refused_before_round_1(
        png_deployment: DeploymentRuns) -> None:
    """A fourth agent, west, with --recipe png_cnn_v2:PngCNNv2 (version 1.1) beside three on
    png_cnn:PngCNN (1.0): the coordinator refuses the run before round 1, naming west and the
    versions."""
    refusal = png_deployment.refusal
    assert "hospital west runs png-cnn version 1.1 (version '1.1' vs '1.0')" in refusal, refusal
    history = png_deployment.refused_history
    assert history["status"] == "failed" and not history["rounds"]
