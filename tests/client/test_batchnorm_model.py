"""norm=batch: the MLP with BatchNorm, its model id, and training it on awkward batch counts."""

from __future__ import annotations

import numpy as np
import pytest
import torch
from fedsplit.client.models import ModelSpec, build_model, has_batch_norm
from fedsplit.client.train import batch_bounds, fit
from fedsplit.protocol import RunConfig
from fedsplit.protocol.errors import ConfigError


def test_norm_is_part_of_the_model_id_and_the_architecture() -> None:
    """Coordinator and sites rebuild the same model from the id; old ids still mean no norm."""
    spec = ModelSpec("mlp", "classification", (5,), 3, hidden=(8, 4), norm="batch")
    assert spec.to_id() == "mlp/classification/5/3/8-4/batch"
    assert ModelSpec.from_id(spec.to_id()) == spec
    plain = ModelSpec.from_id("mlp/classification/5/3/8-4")
    assert plain.norm == "none" and plain.to_id() == "mlp/classification/5/3/8-4"
    model = build_model(spec.to_id(), seed=0)
    kinds = [type(m).__name__ for m in model.body]
    assert kinds == ["Linear", "BatchNorm1d", "ReLU", "Linear", "BatchNorm1d", "ReLU", "Linear"]
    assert has_batch_norm(model) and not has_batch_norm(build_model(plain))
    with pytest.raises(ConfigError, match="Not a fedsplit model id"):
        ModelSpec.from_id("mlp/classification/5/3/8-4/none")
    with pytest.raises(ConfigError, match="norm must be one of"):
        ModelSpec.from_id("mlp/classification/5/3/8-4/layer")


def test_cnn_with_batch_norm_is_refused() -> None:
    """norm=batch adds BatchNorm to the MLP's hidden layers only; the CNN refuses it."""
    with pytest.raises(ConfigError, match="model=mlp or norm=none"):
        ModelSpec("cnn", "classification", (1, 8, 8), 10, norm="batch")


def test_run_config_refuses_batch_norm_with_split_training_or_batches_of_one() -> None:
    """BatchNorm statistics depend on the batch: no shards or micro-batches, batch-size >= 2."""
    with pytest.raises(ConfigError, match="parallel=none"):
        RunConfig.from_flower({"norm": "batch", "parallel": "pipeline:stages=2,microbatches=2"})
    with pytest.raises(ConfigError, match="batch-size >= 2"):
        RunConfig.from_flower({"norm": "batch", "batch-size": 1})
    assert RunConfig.from_flower({"norm": "batch"}).norm == "batch"


def test_a_last_batch_of_one_row_joins_the_previous_batch_for_batch_norm() -> None:
    """33 rows in batches of 32 would leave a 1-row batch BatchNorm cannot train on."""
    assert batch_bounds(33, 32) == [(0, 32), (32, 33)]
    assert batch_bounds(33, 32, merge_single=True) == [(0, 33)]
    assert batch_bounds(34, 32, merge_single=True) == [(0, 32), (32, 34)]
    assert batch_bounds(1, 32, merge_single=True) == [(0, 1)]
    model = build_model(ModelSpec("mlp", "classification", (4,), 2, hidden=(6,), norm="batch"),
                        seed=0)
    rng = np.random.default_rng(0)
    x, y = rng.normal(size=(33, 4)).astype(np.float32), rng.integers(0, 2, 33)
    loss = fit(model, x, y, epochs=2, lr=0.01, batch_size=32, seed=0)
    assert np.isfinite(loss)
    assert int(model.body[1].num_batches_tracked) == 2  # one merged batch per epoch
    with pytest.raises(ConfigError, match="batch-size >= 2"):
        fit(model, x[:1], y[:1], epochs=1, lr=0.01, batch_size=32, seed=0)


def test_batch_norm_model_scores_in_eval_mode() -> None:
    """Scoring uses the running statistics, so one row can be scored."""
    from fedsplit.client.train import score

    model = build_model(ModelSpec("mlp", "regression", (3,), 1, hidden=(4,), norm="batch"), seed=1)
    result = score(model, np.ones((1, 3), np.float32), np.array([0.5]))
    assert np.isfinite(result["loss"])
    assert not model.training and torch.isfinite(model.body[1].running_mean).all()
