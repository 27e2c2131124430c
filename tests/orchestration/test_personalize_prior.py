"""``--personalize prior``: each hospital refits the final bias, kept when a likelihood-ratio test
rejects the global one."""

from __future__ import annotations

from dataclasses import replace
from pathlib import Path

import numpy as np
import pytest
import torch
from fedsplit.client.data import Dataset
from fedsplit.client.models import SiteModel
from fedsplit.client.train import score
from fedsplit.orchestration.experiment import _concat, train_baseline
from fedsplit.orchestration.personalize import (
    PRIOR,
    PRIOR_TEST_LEVEL,
    final_bias,
    parse_budget,
    personalize,
    prior_test,
    resolve_scope,
)
from fedsplit.protocol.config import RunConfig
from fedsplit.protocol.errors import ConfigError
from scipy.stats import chi2

from tests.orchestration.test_personalize import hospitals, simulate_refuses


def tensors(model: SiteModel) -> dict[str, np.ndarray]:
    return {k: v.detach().numpy().copy() for k, v in model.state_dict().items()}


def pooled_model(trains: dict[str, Dataset], cfg: RunConfig, num_outputs: int) -> SiteModel:
    pooled = _concat(list(trains.values()))
    return train_baseline(pooled, pooled, num_outputs, cfg, steps=60)[0]


def skewed(data: Dataset, keep: int, share: float, seed: int = 0) -> Dataset:
    """``data`` resampled so that class ``keep`` makes ``share`` of its rows (a hospital whose
    label mix is not the federation's)."""
    rng = np.random.default_rng(seed)
    mine, other = np.flatnonzero(data.y == keep), np.flatnonzero(data.y != keep)
    n_other = max(1, round(len(mine) * (1 - share) / share))
    rows = np.concatenate([mine, rng.choice(other, size=min(n_other, len(other)), replace=False)])
    return replace(data, x=data.x[rows], y=data.y[rows])


def test_a_hospital_whose_label_mix_differs_refits_only_its_bias(tmp_path: Path) -> None:
    # Prepare: a global model of the pooled rows; a hospital that is 95% class 1
    cfg = RunConfig(seed=0, target="target", hidden="16")
    trains, _ = hospitals("breast-cancer", tmp_path, cfg)
    model = pooled_model(trains, cfg, num_outputs=2)
    pooled = _concat(list(trains.values()))
    hospital = skewed(pooled, keep=1, share=0.95)
    before = tensors(model)
    # Execute
    tuned, test = prior_test(model, hospital)
    # Assert: the test rejects the global bias, and only the final bias moved
    assert test.adopted and test.p_value < PRIOR_TEST_LEVEL and test.df == 1
    assert test.p_value == pytest.approx(chi2.sf(test.statistic, 1))
    bias = final_bias(model)
    after = tensors(tuned)
    assert all(np.array_equal(before[k], after[k]) for k in before if k != bias)
    assert all(np.array_equal(before[k], v) for k, v in tensors(model).items())  # global untouched
    shift = after[bias] - before[bias]
    assert shift[1] - shift[0] > 0  # towards the hospital's majority class
    np.testing.assert_allclose(shift, test.bias_shift, atol=1e-6)
    # the maximum-likelihood condition: the mean predicted probability of each class equals
    # its share of the hospital's rows
    with torch.no_grad():
        probs = torch.softmax(tuned(torch.as_tensor(hospital.x)), 1).numpy().mean(0)
    np.testing.assert_allclose(probs, np.bincount(hospital.y, minlength=2) / len(hospital),
                               atol=1e-4)
    # and it fits the hospital's rows better than the global model
    assert score(tuned, hospital.x, hospital.y)["loss"] < score(model, hospital.x, hospital.y)["loss"]


def test_a_bias_already_at_its_optimum_is_kept(tmp_path: Path) -> None:
    # Prepare: a model whose bias was just refitted to these rows
    cfg = RunConfig(seed=0, target="target", hidden="16")
    trains, _ = hospitals("wine", tmp_path, cfg)
    model = pooled_model(trains, cfg, num_outputs=3)
    refitted, first = prior_test(model, trains["site-1"])
    if not first.adopted:  # the global bias was kept: it is the one to test again
        refitted = model
    # Execute
    again, second = prior_test(refitted, trains["site-1"])
    # Assert: nothing left to gain, so the test keeps the bias and the model is unchanged
    assert second.df == 2
    assert not second.adopted and second.p_value > 0.5
    assert second.statistic == pytest.approx(0.0, abs=1e-3) or not first.adopted
    assert all(np.array_equal(a, b) for a, b in zip(tensors(refitted).values(),
                                                    tensors(again).values(), strict=True))


def test_a_regression_shifts_by_the_mean_residual(tmp_path: Path) -> None:
    # Prepare: a hospital whose targets sit well above what the global model predicts
    cfg = RunConfig(seed=0, target="target", hidden="16")
    trains, _ = hospitals("diabetes", tmp_path, cfg)
    model = pooled_model(trains, cfg, num_outputs=1)
    site = trains["site-0"]
    hospital = replace(site, y=site.y + 60.0)
    # Execute
    tuned, test = prior_test(model, hospital)
    # Assert: least squares over one intercept is the mean residual, in the model's output scale
    with torch.no_grad():
        out = model(torch.as_tensor(hospital.x)).numpy()[:, 0].astype(np.float64)
    scaled = (hospital.y - float(model.target_mean)) / float(model.target_std)
    assert test.adopted and test.df == 1
    assert test.bias_shift[0] == pytest.approx(float(np.mean(scaled - out)), abs=1e-4)
    mse = np.mean((scaled - out) ** 2), np.mean((scaled - out - np.mean(scaled - out)) ** 2)
    assert test.statistic == pytest.approx(len(hospital) * np.log(mse[0] / mse[1]), rel=1e-4)
    assert score(tuned, hospital.x, hospital.y)["rmse"] < score(model, hospital.x, hospital.y)["rmse"]


def test_personalize_prior_records_every_hospitals_test(tmp_path: Path) -> None:
    cfg = RunConfig(seed=0, target="target", hidden="16")
    trains, tests = hospitals("breast-cancer", tmp_path, cfg)
    model = pooled_model(trains, cfg, num_outputs=2)
    entry = personalize(model, trains, tests, cfg, steps=PRIOR)
    names = [name for name, _ in tests]
    assert entry.scope == "bias" and "steps_per_site" not in entry.to_json()
    assert list(entry.prior_test) == names
    for name, test in tests:
        record = entry.prior_test[name]
        assert record.adopted == (record.p_value < PRIOR_TEST_LEVEL)
        if not record.adopted:  # a kept bias scores exactly as the global model
            assert entry.per_site[name] == score(model, test.x, test.y)


def test_prior_is_a_budget_and_refuses_the_all_scope() -> None:
    assert parse_budget("Prior") == PRIOR
    assert resolve_scope(PRIOR, "auto") == "bias" == resolve_scope(PRIOR, "bias")
    assert resolve_scope(100, "auto") == "all" and resolve_scope("alone", "bias") == "bias"
    with pytest.raises(ConfigError, match=r"refits only the final layer's bias.*Received: "):
        resolve_scope(PRIOR, "all")


def test_simulate_refuses_prior_with_every_weight(
        tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    err = simulate_refuses(tmp_path, capsys, "--dataset", "wine", "--personalize", "prior",
                           "--personalize-scope", "all")
    assert "--personalize prior refits only the final layer's bias" in err


def test_a_hospital_without_rows_is_refused(tmp_path: Path) -> None:
    cfg = RunConfig(seed=0, target="target", hidden="none")
    trains, _ = hospitals("wine", tmp_path, cfg)
    model = pooled_model(trains, cfg, num_outputs=3)
    empty = replace(trains["site-0"], x=trains["site-0"].x[:0], y=trains["site-0"].y[:0])
    with pytest.raises(ConfigError, match=r"has none\. Received: 0 rows"):
        prior_test(model, empty)


@pytest.mark.slow
def test_simulate_records_the_prior_test_in_the_summary(tmp_path: Path) -> None:
    # Prepare: a short real federation (Flower simulation), label-skewed hospitals
    from fedsplit.orchestration.experiment import Experiment, run_experiment

    cfg = RunConfig(num_server_rounds=1, local_steps=3, seed=0, target="target", hidden="none")
    exp = Experiment(cfg=cfg, out=tmp_path / "run", dataset="wine", num_sites=3,
                     partition="dirichlet:0.3", personalize="prior")
    # Execute
    summary = run_experiment(exp)
    # Assert: every hospital's test is recorded; a kept bias scores as the global model
    tuned, federated = summary.personalized, summary.federated
    assert tuned is not None and federated is not None and tuned.prior_test is not None
    assert tuned.steps == PRIOR and tuned.scope == "bias"
    assert set(tuned.prior_test) == set(summary.site_names)
    for name, record in tuned.prior_test.items():
        assert record.df == 2 and len(record.bias_shift) == 3
        assert record.adopted == (record.p_value < PRIOR_TEST_LEVEL)
        if not record.adopted:
            assert tuned.per_site[name] == federated.per_site[name]
    assert (tmp_path / "run" / "rounds.png").stat().st_size > 0


def test_a_hospital_of_one_class_gets_a_large_finite_shift(tmp_path: Path) -> None:
    # Prepare: a hospital whose rows are all class 1 (Switzerland's training rows in some seeds):
    # the likelihood grows without bound as the bias moves, so the refit must stop finite
    cfg = RunConfig(seed=0, target="target", hidden="16")
    trains, _ = hospitals("breast-cancer", tmp_path, cfg)
    model = pooled_model(trains, cfg, num_outputs=2)
    pooled = _concat(list(trains.values()))
    rows = np.flatnonzero(pooled.y == 1)
    hospital = replace(pooled, x=pooled.x[rows], y=pooled.y[rows])
    # Execute
    tuned, test = prior_test(model, hospital)
    # Assert
    assert np.all(np.isfinite(test.bias_shift)) and np.isfinite(test.statistic)
    assert test.bias_shift[1] - test.bias_shift[0] > 0
    assert all(np.all(np.isfinite(v)) for v in tensors(tuned).values())
    assert test.adopted and test.p_value < 1e-3
    with torch.no_grad():
        assert (tuned(torch.as_tensor(hospital.x)).argmax(1) == 1).all()
