"""`fedsplit predict`: a saved model scores a raw hospital file with the schema stored beside it."""

from __future__ import annotations

from pathlib import Path

import numpy as np
import pandas as pd
import pytest
from fedsplit.cli.app import app
from fedsplit.cli.errors import run_guarded
from fedsplit.client.data import encode_table, local_schema
from fedsplit.client.models import ModelSpec, build_model
from fedsplit.client.train import fit, set_statistics
from fedsplit.protocol import Update, read_weights, write_weights
from fedsplit.protocol.errors import ConfigError, WeightFileError
from fedsplit.protocol.schema import TableSettings
from fedsplit.protocol.stats import combine_moments, moments
from fedsplit.protocol.weights import read_schema

SETTINGS = TableSettings(target="disease", id_column="id", min_category_count=2)


def raw_patients(n: int, seed: int) -> pd.DataFrame:
    """Raw rows as a hospital exports them: text, TRUE/FALSE, empty cells and '?'."""
    rng = np.random.default_rng(seed)
    age = rng.integers(30, 80, n)
    cp = rng.choice(["asymptomatic", "typical angina", "non-anginal"], n)
    frame = pd.DataFrame({
        "id": [f"p{seed}-{i}" for i in range(n)], "age": age.astype(str),
        "cp": cp, "exang": rng.choice(["TRUE", "FALSE"], n),
        "disease": ((age > 55) | (cp == "asymptomatic")).astype(int).astype(str),
    })
    frame.loc[1, "age"], frame.loc[2, "exang"] = "?", ""
    return frame


@pytest.fixture
def model_file(tmp_path: Path) -> Path:
    """A model trained on raw rows and saved with its schema, as the coordinator saves global.h5."""
    frame = raw_patients(200, seed=0)
    schema = local_schema(frame, SETTINGS)
    data = encode_table(schema, frame, source="train")
    model = build_model(ModelSpec("mlp", "classification", (data.x.shape[1],), 2, (16,)), seed=0)
    mean, std = combine_moments([moments(data.x)])
    set_statistics(model, mean, std)
    fit(model, data.x, data.y, epochs=30, lr=0.01, batch_size=32, seed=0)
    path = tmp_path / "global.h5"
    update = Update.from_state_dict(model.state_dict(), num_examples=len(data))
    write_weights(Update(arrays=update.arrays, num_examples=len(data), model=model.spec.to_id()),
                  path, schema=schema.to_json())
    return path


def test_predict_scores_every_raw_row(tmp_path: Path, model_file: Path) -> None:
    """One output row per input row: the ID, a probability per class, the predicted label;
    columns in another order, an unseen category and the target column present are all fine."""
    # Prepare
    rows = raw_patients(40, seed=1)[["exang", "disease", "cp", "age", "id"]]
    rows.loc[5, "cp"] = "never seen"
    rows.to_csv(tmp_path / "patients.csv", index=False)
    # Execute
    code = run_guarded(app, ["predict", "--model", str(model_file), str(tmp_path / "patients.csv"),
                             "-o", str(tmp_path / "pred.csv")])
    # Assert
    assert code == 0
    pred = pd.read_csv(tmp_path / "pred.csv", dtype={"predicted": str})
    assert list(pred.columns) == ["id", "p_0", "p_1", "predicted"] and len(pred) == 40
    assert pred["id"].tolist() == rows["id"].tolist()
    np.testing.assert_allclose(pred["p_0"] + pred["p_1"], 1.0, rtol=1e-6)
    assert set(pred["predicted"]) <= {"0", "1"}
    assert (pred["predicted"] == rows["disease"].to_numpy()).mean() > 0.8


def test_predict_refuses_unknown_missing_and_mistyped_columns(tmp_path: Path, model_file: Path,
                                                              capsys) -> None:
    """The column is named in each refusal, and nothing is written."""
    rows = raw_patients(10, seed=2)
    cases = [(rows.assign(ward="A"), "column(s) the model does not know: ward"),
             (rows.drop(columns=["cp"]), "lacks column(s) the model needs: cp"),
             (rows.assign(age="old"), "column 'age' must hold numbers; 'old' is not"),
             (rows.assign(exang="maybe"), "column 'exang' must hold true/false")]
    for i, (frame, named) in enumerate(cases):
        path = tmp_path / f"bad-{i}.csv"
        frame.to_csv(path, index=False)
        code = run_guarded(app, ["predict", "--model", str(model_file), str(path),
                                 "-o", str(tmp_path / f"out-{i}.csv")])
        assert code == ConfigError.exit_code
        assert named in capsys.readouterr().err
        assert not (tmp_path / f"out-{i}.csv").exists()


def test_the_schema_travels_in_the_weight_file_and_the_strict_reader_checks_it(
        tmp_path: Path, model_file: Path) -> None:
    """read_schema returns the stored schema; a file with a broken schema is refused."""
    assert '"format":"fedsplit.schema"' in read_schema(model_file)
    update = read_weights(model_file)
    import h5py

    broken = tmp_path / "broken.h5"
    write_weights(update, broken)
    assert read_schema(broken) is None
    with h5py.File(broken, "a") as f:
        f.attrs["schema"] = '{"format": "fedsplit.schema", "version": 9}'
    with pytest.raises(WeightFileError, match="'schema' is not a valid table schema"):
        read_weights(broken)


def test_predict_on_a_renamed_file_names_the_missing_column_and_the_likely_rename(
        tmp_path: Path, model_file: Path, capsys) -> None:
    """Issue 41, item 2: the expected column that is missing, and the unexpected one beside it."""
    path = tmp_path / "renamed.csv"
    raw_patients(10, seed=3).rename(columns={"cp": "chest_pain"}).to_csv(path, index=False)
    code = run_guarded(app, ["predict", "--model", str(model_file), str(path),
                             "-o", str(tmp_path / "out.csv")])
    assert code == ConfigError.exit_code
    err = capsys.readouterr().err.strip()
    assert len(err.splitlines()) == 1, err
    assert ("lacks column(s) the model needs: cp; it has column(s) the model does not know: "
            "chest_pain (renamed? give them the model's names)") in err
    assert "Received: lacks ['cp'], unknown ['chest_pain']; columns " in err
    assert not (tmp_path / "out.csv").exists()
