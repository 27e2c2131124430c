"""The survival summary after training: the Breslow baseline from per-hospital sums equals
lifelines' on the pooled rows, its secure-sum path, the minimum-count rule, and `fedsplit
predict --times` with its refusals."""

from __future__ import annotations

import numpy as np
import pandas as pd
import pytest
from fedsplit.client.survival.summary import baseline_vector, km_vector
from fedsplit.protocol import survival as sv
from fedsplit.protocol import survival_summary as ss
from fedsplit.protocol.config import RunConfig
from fedsplit.protocol.errors import ConfigError
from fedsplit.protocol.privacy import SecureSpec
from fedsplit.protocol.run_settings import SecureSettings
from fedsplit.protocol.survival import SurvivalRun
from fedsplit.server.survival import km as kmm
from fedsplit.server.survival.summary import publish_baseline
from lifelines import CoxPHFitter

from tests.privacy.secure_harness import secure_sum

COLUMNS = ["x0", "x1", "x2"]


def hospitals(seed: int = 0, sizes: tuple[int, ...] = (60, 80, 50)) -> list[pd.DataFrame]:
    """Random hospitals with integer times (many ties) and about 60% events."""
    rng = np.random.default_rng(seed)
    out = []
    for k, n in enumerate(sizes):
        x = rng.normal(k * 0.2, 1.0, (n, 3))
        risk = x @ np.array([0.6, -0.4, 0.2])
        t = np.ceil(rng.exponential(30 * np.exp(-risk)) / 3)  # integer times: heavy ties
        e = (rng.random(n) < 0.6).astype(int)
        out.append(pd.DataFrame({**{c: x[:, j] for j, c in enumerate(COLUMNS)}, "T": t + 1,
                                 "E": e}))
    return out


def federated_sums(frames: list[pd.DataFrame], beta: np.ndarray
                   ) -> tuple[np.ndarray, np.ndarray, np.ndarray, dict[int, np.ndarray]]:
    """(grid, summed km counts, summed baseline sums, per-hospital baseline vectors)."""
    grid = np.unique(np.concatenate([f["T"][f["E"] == 1].to_numpy(float) for f in frames]))
    km = sum(km_vector(f["T"].to_numpy(float), f["E"].to_numpy() == 1, grid) for f in frames)
    per = {k + 1: baseline_vector(f["T"].to_numpy(float), f["E"].to_numpy() == 1,
                                  f[COLUMNS].to_numpy() @ beta, grid)
           for k, f in enumerate(frames)}
    return grid, km, sum(per.values()), per


def test_breslow_baseline_from_hospital_sums_equals_lifelines() -> None:
    frames = hospitals()
    pooled = pd.concat(frames, ignore_index=True)
    ref = CoxPHFitter(penalizer=0.1).fit(pooled, "T", "E")
    beta = ref.params_[COLUMNS].to_numpy()
    grid, km, sums, _ = federated_sums(frames, beta)
    n = len(grid)
    # the hospitals' sums add up to the pooled rows' own
    pooled_vec = baseline_vector(pooled["T"].to_numpy(float), pooled["E"].to_numpy() == 1,
                                 pooled[COLUMNS].to_numpy() @ beta, grid)
    np.testing.assert_allclose(sums, pooled_vec, rtol=1e-13)
    times, hazard = publish_baseline(grid, km[1:1 + n], km[1 + n:], sums[:n], sums[n:], 1)
    np.testing.assert_array_equal(times, grid)
    base = ss.Baseline("0" * 64, tuple(times), tuple(hazard), 1, len(pooled), int(km[1 + n:].sum()))
    # lifelines centres the covariates: compare S(t | x) of patients, which does not depend on it
    patients = pooled.iloc[::17]
    expected = ref.predict_survival_function(patients)  # at every duration
    at = expected.index.to_numpy()
    at = at[at <= times[-1]]
    mine = base.survival(patients[COLUMNS].to_numpy() @ beta, at)
    np.testing.assert_allclose(mine, expected.loc[at].to_numpy().T, rtol=1e-10)
    # and H0 itself, moved from lifelines' covariate means to x = 0
    shift = np.exp(-(pooled[COLUMNS].mean().to_numpy() @ beta))
    lifelines_h0 = ref.baseline_cumulative_hazard_.iloc[:, 0].loc[times].to_numpy() * shift
    np.testing.assert_allclose(hazard, lifelines_h0, rtol=1e-10)
    assert np.all(base.hazard_at([0.5]) == 0.0)  # before the first event time


def test_secure_sum_of_the_baseline_vectors_equals_the_plain_sum() -> None:
    frames = hospitals(seed=1)
    beta = np.array([0.5, -0.3, 0.1])
    _, _, plain, per = federated_sums(frames, beta)
    bits = ss.STAGE_BITS["baseline"]
    encoded = {node: sv.encode_fixed(v, len(per), bits) for node, v in per.items()}
    total, _ = secure_sum(SecureSpec(), encoded, workers=1)
    np.testing.assert_allclose(sv.decode_fixed(total, bits), plain, rtol=0, atol=1e-8)


def test_min_count_publishes_the_baseline_where_the_curve_is_published() -> None:
    frames = hospitals(seed=2)
    beta = np.array([0.2, 0.2, -0.2])
    grid, km, sums, _ = federated_sums(frames, beta)
    n = len(grid)
    at_risk, events = km[1:1 + n], km[1 + n:]
    exact_t, exact_h = publish_baseline(grid, at_risk, events, sums[:n], sums[n:], 1)
    times, hazard = publish_baseline(grid, at_risk, events, sums[:n], sums[n:], 5)
    curve = kmm.apply_min_count(grid, at_risk, events, 5)
    np.testing.assert_array_equal(times, curve.times)
    assert 0 < len(times) < len(exact_t)
    np.testing.assert_allclose(hazard, exact_h[np.searchsorted(exact_t, times)], rtol=1e-14)
    with pytest.raises(ConfigError, match="Breslow sums"):
        ss.breslow_increments(np.array([1.0]), np.array([0.0]))
    with pytest.raises(Exception, match="differ between the Kaplan-Meier and baseline"):
        publish_baseline(grid, at_risk, events, sums[:n] + 1, sums[n:], 5)


def test_min_count_is_read_as_run_config_reads_it_and_times_are_checked() -> None:
    # one definition of min-count (protocol.run_settings.SecureSettings): the km / cox app's
    # config and the horizontal run's read it the same way
    assert SecureSettings in SurvivalRun.__mro__ and SecureSettings in RunConfig.__mro__
    run = SurvivalRun(mode="km", time="t", event="e", out_dir="out")
    flower = run.to_flower()
    assert SurvivalRun.from_flower({**flower, "min-count": 3}).min_count == 3
    assert RunConfig.from_flower({"min-count": 3}).min_count == 3
    for bad in (0, "x", 2.5):
        with pytest.raises(ConfigError, match="min-count"):
            SurvivalRun.from_flower({**flower, "min-count": bad})
        with pytest.raises(ConfigError, match="min-count"):
            RunConfig.from_flower({"min-count": bad})
    with pytest.raises(ConfigError, match="min-count"):
        SurvivalRun(mode="km", time="t", event="e", out_dir="out", min_count=0)
    assert ss.parse_times("365, 730.5") == [365.0, 730.5]
    for bad in ("0", "-3", "abc", "365,", "nan", "inf", "365,365"):
        with pytest.raises(ConfigError, match="--times"):
            ss.parse_times(bad)
    assert ss.survival_column(365.0) == "survival_at_365"
