"""Privacy pieces without Flower: specs, the DP-SGD budget stop, hospital DP, secure sums."""

from __future__ import annotations

import numpy as np
import pytest
import torch
from fedsplit.aggregation import aggregate_updates
from fedsplit.aggregation.hospital_dp import HospitalDPFedAvg, HospitalDPParams, plan_sigma, spent
from fedsplit.client.models import ModelSpec, build_model
from fedsplit.client.privacy import fit_private, plan_noise
from fedsplit.client.privacy.ledger import LedgerAccount, compose_epsilon
from fedsplit.protocol import secure_vector as sv
from fedsplit.protocol.config import RunConfig
from fedsplit.protocol.errors import ConfigError, UpdateError
from fedsplit.protocol.privacy import DPSpec, PrivacyBudgetError, SecureSpec, check_run
from fedsplit.protocol.update import Update
from fedsplit.server.compose import check_composition

from tests.privacy.secure_harness import secure_sum


def test_dp_spec_parses_and_refuses() -> None:
    spec = DPSpec.parse("epsilon=1,delta=1e-3", rounds=10)
    assert spec == DPSpec("patient", 1.0, 1e-3, 1.0, 10)
    assert DPSpec.parse(spec.to_spec()) == spec
    assert DPSpec.parse("none") is None
    for bad in ("epsilon=1", "epsilon=0,delta=1e-3", "epsilon=1,delta=2", "epsilon=1,delta=1e-3,x=1",
                "level=site,epsilon=1,delta=1e-3", "epsilon=one,delta=1e-3"):
        with pytest.raises(ConfigError, match="Received"):
            DPSpec.parse(bad, rounds=3)


@pytest.mark.parametrize("strategy", ["median", "trimmed-mean", "krum", "multi-krum"])
def test_robust_rules_refuse_secure_aggregation(strategy: str) -> None:
    with pytest.raises(ConfigError, match=r"masked sum.*fedavg"):
        check_composition(RunConfig(strategy=strategy, secure_aggregation="on"))
    check_composition(RunConfig(strategy="fedavg", secure_aggregation="on"))
    check_composition(RunConfig(strategy="geometric-median", secure_aggregation="on"))
    check_run(dp="", secure="on")


def test_budget_stop_after_planned_rounds(tmp_path) -> None:
    plan = plan_noise(DPSpec.parse("epsilon=1,delta=1e-3", rounds=5), rows=200, batch_size=32,
                      steps_per_round=10)
    (tmp_path / "h.csv").write_text("x,y\n1,0\n")
    account = LedgerAccount(tmp_path / "state", "h", tmp_path / "h.csv", "run-1", None)
    spent_all = [account.charge(plan, r) for r in range(1, 6)]  # the hospital's own ledger
    assert spent_all == sorted(spent_all) and spent_all[-1] <= 1.0
    one = (plan.noise_multiplier, plan.sample_rate, plan.steps_per_round)
    assert spent_all[-1] == pytest.approx(compose_epsilon([one] * 5, plan.delta))
    with pytest.raises(PrivacyBudgetError, match=r"refuses to train.*above the run's epsilon of 1"):
        account.charge(plan, 6)


def test_dp_sgd_trains_and_stays_finite() -> None:
    torch.manual_seed(0)
    model = build_model(ModelSpec("mlp", "classification", (4,), 2), seed=0)
    x = np.random.default_rng(0).normal(size=(256, 4)).astype(np.float32)
    y = torch.as_tensor((x[:, 0] > 0).astype(np.int64))
    plan = plan_noise(DPSpec.parse("epsilon=8,delta=1e-3", rounds=1), 256, 32, 40)
    before = [p.detach().clone() for p in model.parameters()]
    loss = fit_private(model, x, y, plan, lr=0.01, seed=0)  # the recipe (mlp): cross-entropy
    assert np.isfinite(loss)
    assert any(not torch.equal(a, b) for a, b in zip(before, model.parameters(), strict=True))


def test_hospital_dp_clips_weights_and_noises() -> None:
    ref = {"a.weight": np.zeros(4, np.float32), "norm.mean": np.ones(4, np.float32)}
    ups = [Update(arrays={"a.weight": np.full(4, v, np.float32), "norm.mean": np.full(4, 9, np.float32)},
                  num_examples=n, site=f"s{i}") for i, (v, n) in enumerate([(2.0, 10), (0.1, 30)])]
    exact = HospitalDPFedAvg(HospitalDPParams(clip=1.0, sigma=0.0))
    exact.set_reference(ref)
    out = aggregate_updates(exact, ups).arrays
    # site 0's change (norm 4) is clipped to norm 1: 0.5 per coordinate
    assert np.allclose(out["a.weight"], 0.25 * 0.5 + 0.75 * 0.1)
    assert np.array_equal(out["norm.mean"], ref["norm.mean"])  # buffers keep the global value
    noisy = HospitalDPFedAvg(HospitalDPParams(clip=1.0, sigma=plan_sigma(1.0, 1e-3, 5)), seed=1)
    noisy.set_reference(ref)
    result = aggregate_updates(noisy, ups)
    assert result.report.details["noise_std"] == pytest.approx(noisy.params.sigma * 0.75)
    assert spent(noisy.params.sigma, 1e-3, 5) <= 1.0 < spent(noisy.params.sigma, 1e-3, 6)


def test_secure_sum_equals_plain_sum_with_dropouts() -> None:
    rng = np.random.default_rng(0)
    for n, drops in ((3, ()), (6, (2,)), (12, (3, 7))):
        base = (1 << 63) + 100  # Flower node ids are unsigned 64-bit
        vectors = {base + i: rng.integers(0, 1 << 30, 40).astype(np.int64) for i in range(n)}
        total, run = secure_sum(SecureSpec(), vectors, drop_before_collect=[base + d for d in drops])
        assert np.array_equal(total, sum(v for k, v in vectors.items() if k - base not in drops))
        assert run.u1 != run.u2 or not drops


def test_too_many_dropouts_fail_rather_than_mislead() -> None:
    vectors = {i: np.arange(5, dtype=np.int64) for i in range(1, 5)}
    with pytest.raises(Exception, match=r"reconstruction threshold|at least"):
        secure_sum(SecureSpec(), vectors, drop_before_collect=[1, 2, 3])


def test_secure_mean_within_documented_quantisation_bound() -> None:
    rng = np.random.default_rng(1)
    spec = SecureSpec(bound=0.5, levels=1 << 16)
    deltas = [{"w": rng.uniform(-0.5, 0.5, (7, 3)), "b": rng.uniform(-0.5, 0.5, 3)} for _ in range(5)]
    counts = [3, 1500, 70, 12000, 9]  # no 1000-patient ceiling
    vectors = {10 + k: sv.encode(d, c, spec.bound, spec.levels)
               for k, (d, c) in enumerate(zip(deltas, counts, strict=True))}
    total, _ = secure_sum(spec, vectors)
    mean, weight = sv.decode(total, deltas[0], spec.bound, spec.levels)
    assert weight == sum(counts)
    step = 2 * spec.bound / spec.levels
    for name in ("w", "b"):
        exact = sum(c * d[name] for c, d in zip(counts, deltas, strict=True)) / sum(counts)
        assert np.max(np.abs(mean[name] - exact)) < step


def test_out_of_range_update_is_refused_at_the_hospital() -> None:
    with pytest.raises(UpdateError, match=r"outside the secure aggregation range.*not sent"):
        sv.encode({"w": np.array([0.1, 1.5])}, 10, 1.0, 1 << 10)


def test_batchnorm_running_statistics_are_encoded_relative_to_their_size() -> None:
    """A running variance that moves by 5 (beyond the bound of 1) travels under secure
    aggregation: its change is encoded divided by max(16, |g|), known to both ends, and the
    decoded weighted mean multiplied back is the exact mean (to a quantisation step); weights
    keep the plain bound, and a 0-d tensor stays 0-d."""
    import numpy as np
    from fedsplit.protocol import secure_vector as sv

    start = {"bn.running_var": np.array([0.5, 40.0]), "bn.num": np.array(0.0),
             "fc.weight": np.array([0.1, -0.2])}
    scale = sv.relative_scale(start)
    assert list(scale) == ["bn.running_var"]
    np.testing.assert_array_equal(scale["bn.running_var"], [16.0, 40.0])
    changes = [({"bn.running_var": np.array([5.0, -30.0]), "bn.num": np.array(0.0),
                 "fc.weight": np.array([0.5, 0.0])}, 3),
               ({"bn.running_var": np.array([1.0, 10.0]), "bn.num": np.array(0.0),
                 "fc.weight": np.array([-0.5, 0.25])}, 1)]
    total = None
    for delta, count in changes:
        scaled = {k: np.asarray(d / scale.get(k, 1.0)) for k, d in delta.items()}
        assert scaled["bn.num"].shape == ()
        vector = sv.encode(scaled, count, 1.0, 1 << 20)
        total = vector if total is None else total + vector
    mean, weight = sv.decode(total, start, 1.0, 1 << 20)
    assert weight == 4
    got = mean["bn.running_var"] * scale["bn.running_var"]
    np.testing.assert_allclose(got, [(3 * 5.0 + 1.0) / 4, (3 * -30.0 + 10.0) / 4], atol=1e-3)
    np.testing.assert_allclose(mean["fc.weight"], [0.25, 0.0625], atol=1e-5)
    with pytest.raises(Exception, match=r"fc\.weight"):  # weights: the declared bound, unscaled
        sv.encode({"fc.weight": np.array([1.5])}, 1, 1.0, 1 << 20)
