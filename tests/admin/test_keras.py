"""Keras 3 ``.weights.h5`` and legacy Keras HDF5 files: upload, aggregate, download, load_weights."""

from __future__ import annotations

import importlib.util
import os
from pathlib import Path
from typing import Any

import numpy as np
import pytest

from tests.admin.conftest import ADMIN, bearer, create_round, post_file

os.environ.setdefault("KERAS_BACKEND", "torch")
if importlib.util.find_spec("keras") is None:
    pytest.skip("keras 3 is a test-only dependency (pip install keras)", allow_module_level=True)
# keras itself is imported by the tests that use it, not when the tests are collected: with its
# torch backend it imports torch's compiler stack, ml_dtypes, pandas and matplotlib (7-10 s of
# CPU on the 2-core machine). That import alone is why these run with the slow tests (CI, `make
# test`); tests/protocol/test_weights.py reads both Keras layouts in the fast suite.
pytestmark = pytest.mark.slow


def build_model(seed: int) -> Any:
    """A small Dense/BatchNorm/Dropout model with deterministic weights."""
    import keras

    keras.utils.set_random_seed(seed)
    return keras.Sequential(
        [
            keras.Input((4,)),
            keras.layers.Dense(3, activation="relu"),
            keras.layers.BatchNormalization(),
            keras.layers.Dropout(0.1),
            keras.layers.Dense(2),
        ]
    )


def weights_of(model: Any) -> list[np.ndarray]:
    """The model's variables as numpy arrays."""
    import keras

    return [keras.ops.convert_to_numpy(v) for v in model.weights]


@pytest.fixture(scope="module")
def keras_files(tmp_path_factory: pytest.TempPathFactory) -> dict[str, Any]:
    """Two sites' Keras 3 files (one compiled and trained: it carries optimizer state) and legacy files."""
    import h5py
    from keras.src.legacy.saving import legacy_h5_format

    root = tmp_path_factory.mktemp("keras")
    out: dict[str, Any] = {"weights": {}}
    for seed in (1, 2):
        model = build_model(seed)
        if seed == 2:
            model.compile(optimizer="adam", loss="mse")
            model.fit(np.ones((8, 4)), np.ones((8, 2)), verbose=0, epochs=1)
        model.save_weights(root / f"site{seed}.weights.h5")
        with h5py.File(root / f"legacy{seed}.h5", "w") as f:
            legacy_h5_format.save_weights_to_hdf5_group(f, model)
        out["weights"][seed] = weights_of(model)
    out["root"] = root
    return out


@pytest.mark.parametrize(
    ("pattern", "layout", "suffix"),
    [("site{}.weights.h5", "keras3", ".weights.h5"), ("legacy{}.h5", "keras-legacy", ".h5")],
)
def test_keras_round_trip(client, site_token, keras_files, tmp_path: Path, pattern, layout, suffix):
    """Two Keras uploads are averaged (30/90 weights) and load back into a fresh Keras model."""
    rnd = create_round(client, min_uploads=2)
    counts = {1: 30, 2: 90}
    for seed, n in counts.items():
        path = keras_files["root"] / pattern.format(seed)
        response = post_file(client, rnd["id"], site_token(f"site{seed}"), path, num_examples=n)
        assert response.status_code == 201, response.text
        assert response.json()["layout"] == layout
    receipt_names = [p["name"] for p in response.json()["parameters"]]
    assert len(receipt_names) == 8  # dense kernel+bias, 4 batch-norm vectors, dense_1 kernel+bias
    assert client.post(f"/api/v1/rounds/{rnd['id']}/aggregate", headers=ADMIN).status_code == 200

    download = client.get(f"/api/v1/rounds/{rnd['id']}/model?format=keras", headers=ADMIN)
    assert download.status_code == 200
    assert download.headers["content-disposition"].endswith(f'-model{suffix}"')
    target = tmp_path / f"aggregate{suffix}"
    target.write_bytes(download.content)
    fresh = build_model(99)
    fresh.load_weights(target)
    w1, w2 = keras_files["weights"][1], keras_files["weights"][2]
    for got, a, b in zip(weights_of(fresh), w1, w2, strict=True):
        np.testing.assert_allclose(got, (30 * a + 90 * b) / 120, rtol=1e-6, atol=1e-7)


def test_keras_format_needs_a_keras_upload(client, site_token, tmp_path):
    """?format=keras on a round of fedsplit uploads answers 409 with the alternative."""
    from tests.admin.conftest import write_model

    rnd = create_round(client)
    post_file(client, rnd["id"], site_token("a"), write_model(tmp_path / "a.h5"))
    client.post(f"/api/v1/rounds/{rnd['id']}/aggregate", headers=ADMIN)
    response = client.get(f"/api/v1/rounds/{rnd['id']}/model?format=keras", headers=ADMIN)
    assert response.status_code == 409
    assert response.json()["detail"] == (
        f"Round {rnd['id']} has no Keras layout: no upload or template of it was a Keras weights file. "
        "Download ?format=fedsplit instead. Received: format='keras'"
    )


def test_keras_upload_without_count_is_refused(client, site_token, keras_files, data_dir):
    """Keras files carry no sample count: the form field is required."""
    rnd = create_round(client)
    token = site_token("a")
    response = post_file(client, rnd["id"], token, keras_files["root"] / "site1.weights.h5")
    assert response.status_code == 422
    assert response.json()["reason"] == "num_examples"
    assert client.get(f"/api/v1/rounds/{rnd['id']}", headers=bearer(token)).json()["uploads"] == []
