"""docs/examples/flower_app.py, a Flower user's own app using fedsplit's strategy, runs as shown."""

from __future__ import annotations

import json
from pathlib import Path

import numpy as np
import pytest
from fedsplit.orchestration.flower_runtime import (
    flower_env,
    run_app,
    simulation_superlink,
    stage_app,
    write_connection,
)
from fedsplit.protocol.config import RunConfig

EXAMPLE = Path(__file__).resolve().parents[1] / "docs" / "examples" / "flower_app.py"


@pytest.mark.slow
def test_flower_users_app_merges_with_fedsplits_trimmed_mean(tmp_path: Path) -> None:
    out = tmp_path / "out"
    cfg = RunConfig(num_server_rounds=2, min_nodes=5, out_dir=str(out), data_dir=str(tmp_path))
    app = stage_app(tmp_path / "app", cfg, components=("flower_app:server", "flower_app:client"),
                    extra_modules=[EXAMPLE])
    env = flower_env(tmp_path / "flwr-home")
    with simulation_superlink(tmp_path, env) as address:
        write_connection(tmp_path / "flwr-home", address)
        history = run_app(app, env, tmp_path / "flower.log", out / "history.json",
                          federation_config="num-supernodes=5 client-resources-num-cpus=1",
                          timeout=600)
    assert history["status"] == "finished"
    assert len(history["rounds"]) == 2
    # five hospitals each move halfway towards their own target 0..4; trimming 20% per side
    # keeps the middle three (targets 1, 2, 3), averaged unweighted: 0 -> 1.0 -> 1.5
    kept = np.array([1.0, 2.0, 3.0])
    after_one = (0.5 * kept).mean()
    expected = after_one + 0.5 * (kept - after_one).mean()
    final = np.load(out / "final.npy")
    np.testing.assert_allclose(final, np.full(4, expected), rtol=1e-5)
    report = json.loads(next((out / "models").glob("round-002.report.json")).read_text())
    assert report["strategy"] == "trimmed-mean"
