"""Local work in optimizer steps, and the baselines' equal step budget."""

from __future__ import annotations

import numpy as np
import pytest
from fedsplit.client.models import ModelSpec, build_model
from fedsplit.client.train import (
    MIN_LOCAL_STEPS,
    batches_per_epoch,
    fit_steps,
    local_steps_per_round,
    step_rows,
)
from fedsplit.orchestration.experiment import baseline_steps
from fedsplit.protocol.config import RunConfig
from fedsplit.protocol.errors import ConfigError


def test_steps_per_round_default_floor_and_exact_k() -> None:
    """Epochs give ceil(rows / batch) steps each, never fewer than 10; local-steps K gives K."""
    assert local_steps_per_round(38, local_steps=0, local_epochs=1, batch_size=32) == MIN_LOCAL_STEPS
    assert local_steps_per_round(1000, local_steps=0, local_epochs=2, batch_size=32) == 64
    assert local_steps_per_round(38, local_steps=100, local_epochs=1, batch_size=32) == 100
    with pytest.raises(ConfigError, match="local-steps and local-epochs both"):
        RunConfig.from_flower({"local-steps": 5, "local-epochs": 2})


@pytest.mark.parametrize(("rows", "steps", "batch"), [(38, 10, 32), (5, 7, 4), (100, 3, 32)])
def test_step_rows_make_exactly_k_batches_and_training_takes_k_steps(rows, steps, batch) -> None:
    """K batches of min(batch, rows) rows, each row used before any repeats; BatchNorm's counter
    confirms the optimizer took exactly K steps."""
    idx = step_rows(rows, steps, batch, seed=0)
    if idx is not None:
        assert len(idx) == steps * min(batch, rows)
        first = idx[: min(rows, len(idx))]
        assert len(set(first.tolist())) == len(first)  # a full pass before any row repeats
    model = build_model(ModelSpec("mlp", "classification", (3,), 2, (4,), norm="batch"), seed=0)
    rng = np.random.default_rng(0)
    x, y = rng.normal(size=(rows, 3)).astype(np.float32), rng.integers(0, 2, rows)
    fit_steps(model, x, y, steps=steps, lr=0.01, batch_size=batch, seed=0)
    assert int(model.state_dict()["body.1.num_batches_tracked"]) == steps


def test_epoch_multiples_keep_plain_epochs() -> None:
    """When whole epochs give exactly K steps, training is the usual epochs (no repeats)."""
    assert step_rows(64, 2 * batches_per_epoch(64, 32), 32, seed=0) is None


def test_baselines_get_the_federations_step_budget() -> None:
    """Each hospital alone: rounds x its steps; centralized: rounds x the sum over hospitals."""
    cfg = RunConfig(num_server_rounds=10, batch_size=32)
    central, alone = baseline_steps([38, 400, 120], cfg)
    assert alone == [100, 130, 100] and central == 330
    central, alone = baseline_steps([38, 400], RunConfig(num_server_rounds=3, local_steps=50))
    assert alone == [150, 150] and central == 300
