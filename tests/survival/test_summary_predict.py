"""`fedsplit predict --times`: survival probabilities from a survival model and the baseline its
run wrote beside it, and the refusals (not a survival model, missing or mismatched baseline,
bad or too late times)."""

from __future__ import annotations

import json

import numpy as np
import pandas as pd
import pytest
from fedsplit.cli.app import app
from fedsplit.client.models import build_model
from fedsplit.client.recipes import ModelInputs, load_recipe
from fedsplit.orchestration.predict import predict_file
from fedsplit.protocol import Update, write_weights
from fedsplit.protocol import survival_summary as ss
from fedsplit.protocol.errors import ConfigError
from fedsplit.protocol.update import state_dict_arrays
from typer.testing import CliRunner

from tests.survival.test_summary import COLUMNS, hospitals

COX = "fedsplit.client.survival.recipe:Cox"


def cox_model_file(tmp_path, beta=(0.5, -0.3, 0.1)):
    """A linear Cox model file with its survival schema (standardisation at identity), as the
    coordinator writes global.h5."""
    import torch
    from fedsplit.client.data import local_schema
    from fedsplit.protocol.schema import TableSettings

    rows = hospitals(seed=3, sizes=(40,))[0]
    rows.insert(0, "pid", [f"q{i}" for i in range(len(rows))])
    schema = local_schema(rows, TableSettings(target="T", event="E", id_column="pid"),
                          task="survival")
    assert schema.feature_names == COLUMNS
    recipe = load_recipe(COX, {})
    spec = recipe.model_spec(ModelInputs("survival", (3,), 1))
    model = build_model(spec, recipe=recipe)
    with torch.no_grad():
        model[-1].weight[:] = torch.tensor([beta])
        model[-1].bias[:] = 0
    path = tmp_path / "global.h5"
    write_weights(Update(arrays=state_dict_arrays(model.state_dict()), num_examples=100,
                         model=spec.to_id()), path, schema=schema.to_json())
    return path


def patients_csv(tmp_path):
    frame = hospitals(seed=4, sizes=(12,))[0].drop(columns=["T", "E"])
    frame.insert(0, "pid", [f"p{i}" for i in range(len(frame))])
    path = tmp_path / "patients.csv"
    frame.to_csv(path, index=False)
    return path, frame


def test_predict_times_gives_survival_and_refuses_bad_requests(tmp_path) -> None:
    model = cox_model_file(tmp_path)
    table, frame = patients_csv(tmp_path)
    base = ss.Baseline(ss.file_sha256(model), (2.0, 5.0, 9.0), (0.1, 0.3, 0.7), 5, 100, 40)
    (tmp_path / "global.baseline.json").write_text(json.dumps(base.to_json()))
    out = tmp_path / "pred.csv"
    result = CliRunner().invoke(app, ["predict", str(table), "--model", str(model), "-o", str(out),
                                      "--times", "1,2,6,9"])
    assert result.exit_code == 0, result.output
    pred = pd.read_csv(out)
    risk = frame[COLUMNS].to_numpy() @ np.array([0.5, -0.3, 0.1])
    np.testing.assert_allclose(pred["risk"], risk, rtol=1e-5)
    np.testing.assert_allclose(pred["survival_at_1"], 1.0)  # before the first time: H0 = 0
    np.testing.assert_allclose(pred["survival_at_6"], np.exp(-0.3 * np.exp(risk)), rtol=1e-5)
    cols = ["survival_at_1", "survival_at_2", "survival_at_6", "survival_at_9"]
    probs = pred[cols].to_numpy()
    assert np.all((probs > 0) & (probs <= 1)) and np.all(np.diff(probs, axis=1) <= 0)

    def refused(match, **kw):
        with pytest.raises(ConfigError, match=match):
            predict_file(kw.pop("model", model), table, tmp_path / "x.csv", **kw)

    refused("Ask for times up to 9", times=[10.0])
    refused("needs the model's baseline hazard", times=[2.0], baseline=tmp_path / "nope.json")
    other = tmp_path / "other"
    other.mkdir()
    refused("computed for another model file", times=[2.0],
            model=cox_model_file(other, beta=(0.1, 0.1, 0.1)), baseline=tmp_path /
            "global.baseline.json")
    (tmp_path / "bad.json").write_text(json.dumps({"format": "something"}))
    refused("not a fedsplit baseline", times=[2.0], baseline=tmp_path / "bad.json")
    mlp = tmp_path / "mlp"
    mlp.mkdir()
    from fedsplit.client.models import ModelSpec

    reg = build_model(ModelSpec("mlp", "regression", (3,), 1, (4,)), seed=0)
    write_weights(Update(arrays=state_dict_arrays(reg.state_dict()), num_examples=10,
                         model=reg.spec.to_id()), mlp / "global.h5")
    refused("--times gives survival probabilities of a survival model", times=[2.0],
            model=mlp / "global.h5")
    runner = CliRunner()
    for args, match in ((["--times", "0"], "positive"), (["--times", "1,x"], "positive"),
                        (["--baseline", str(tmp_path / "b.json")], "only with --times")):
        result = runner.invoke(app, ["predict", str(table), "--model", str(model), "-o",
                                     str(out), *args])
        assert result.exit_code != 0 and match in str(result.exception) + result.output


# The whole path through Flower (simulate under secure aggregation, the summary, predict --times)
# is one slow test with the survival task: tests/survival/test_recipe.py.
