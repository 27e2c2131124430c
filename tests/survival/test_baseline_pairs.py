"""The centralized baseline of the local-steps path picks its round as the federation does
(issue 35): Harrell's C over each hospital's own summed concordance pairs, never pairs of
patients of two hospitals (whose baseline hazards differ)."""

from __future__ import annotations

import numpy as np
import pytest
from fedsplit.client.models import recipe_of
from fedsplit.client.survival.cox import concordance_counts
from fedsplit.orchestration.experiment import (
    _concat,
    score,
    train_baseline,
    validation_score,
)
from fedsplit.protocol.config import RunConfig
from lifelines.utils import concordance_index

from tests.survival.test_exact_path import hospitals, sites


def summed_pairs_c(model, vals) -> float:
    """Harrell's C from each hospital's (concordant, tied, comparable) counts, summed."""
    conc = tied = pairs = 0
    for v in vals:
        risk = recipe_of(model).predict(model, v.x)["risk"]
        c, t, p = concordance_counts(v.y[:, 0], v.y[:, 1] > 0.5, risk)
        conc, tied, pairs = conc + c, tied + t, pairs + p
    return (conc + tied / 2) / pairs


def test_centralized_selection_sums_each_hospitals_pairs() -> None:
    frames = hospitals(seed=4, sizes=(90, 110, 80))
    for k, name in enumerate(frames):  # hospitals with very different follow-up times
        frames[name]["T"] = frames[name]["T"] * (1 + 5 * k)
    cfg = RunConfig.from_flower({"target": "T", "event": "E", "task": "survival",
                                 "hidden": "8", "num-server-rounds": 1, "seed": 0})
    _, held = sites(frames, cfg)
    for h in held:  # 30 validation rows per hospital instead of 5
        h.val, h.train = _concat([h.val, h.train]).subset(np.arange(30)), h.train.subset(
            np.arange(25, len(h.train)))
    vals = [h.val for h in held]
    train = _concat([h.train for h in held])
    model, chosen = train_baseline(train, vals, 1, cfg, steps=20)
    pooled_rows = _concat(vals)
    risk = recipe_of(model).predict(model, pooled_rows.x)["risk"]
    across = concordance_index(pooled_rows.y[:, 0], -risk, pooled_rows.y[:, 1])
    expected = summed_pairs_c(model, vals)
    assert chosen.scores[0] == pytest.approx(expected, abs=1e-9)
    assert validation_score(model, vals, "c_index") == pytest.approx(expected, abs=1e-9)
    assert abs(expected - across) > 0.01, (expected, across)  # the rule matters on these rows
    # one hospital: its own Harrell's C; another metric: the pooled rows, as before
    assert validation_score(model, vals[:1], "c_index") == pytest.approx(
        summed_pairs_c(model, vals[:1]), abs=1e-9)
    assert validation_score(model, vals, "loss") == pytest.approx(
        score(model, pooled_rows.x, pooled_rows.y)["loss"])
