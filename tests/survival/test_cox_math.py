"""The survival math against lifelines, without Flower: each hospital's Efron parts, the
coordinator's Newton fit on their sums, concordance counts, Kaplan-Meier and the min-count rule."""

from __future__ import annotations

import numpy as np
import pandas as pd
import pytest
from fedsplit.client.survival.cox import (
    concordance_counts,
    efron_parts,
    from_triangle,
    km_counts,
    triangle,
)
from fedsplit.client.survival.tcga import load_tcga_brca
from fedsplit.server.survival import km as kmm
from fedsplit.server.survival import newton as nt
from lifelines import CoxPHFitter, KaplanMeierFitter
from lifelines.fitters.coxph_fitter import SemiParametricPHFitter
from lifelines.utils import concordance_index

from tests._helpers.survival import assert_km_is_lifelines

#: lifelines' defaults stop on a relative log-likelihood change of 1e-9, which on TCGA-BRCA
#: leaves a gradient norm of 4e-3 (coefficients off the maximum by up to 1e-4 relative); the
#: reference here runs lifelines to its own maximum
TIGHT = {"precision": 1e-12, "r_precision": 1e-14}


def random_hospitals(seed: int, sizes=(80, 120, 60), p=4):
    rng = np.random.default_rng(seed)
    out = []
    for n in sizes:
        x = rng.normal(size=(n, p))
        x[:, -1] = rng.integers(0, 2, n)
        hazard = np.exp(x @ np.linspace(0.8, -0.5, p))
        t = np.ceil(rng.exponential(10 / hazard)).clip(1, 30)  # integer days: many ties
        e = rng.random(n) < 0.7
        out.append((x, t, e))
    return out


def federated(hospitals, names, penalizer):
    """What the coordinator does with the hospitals' sums (here summed in process)."""
    x_all = np.concatenate([h[0] for h in hospitals])
    st = nt.standardization(names, len(x_all), x_all.sum(0), (x_all**2).sum(0))
    rounds = []

    def evaluate(beta):
        rounds.append(1)
        parts = [efron_parts((x - st.mean) / st.std, t, e, beta) for x, t, e in hospitals]
        return (sum(p.loglik for p in parts), sum(p.gradient for p in parts),
                sum(p.hessian for p in parts))

    result = nt.newton(evaluate, names, st.rows, penalizer)
    assert result.rounds == len(rounds)
    return result, nt.original_scale(result, names, st.std)


def lifelines_fit(hospitals, names, penalizer, **fit_options):
    frame = pd.concat([pd.DataFrame(x, columns=names).assign(T=t, E=e.astype(int), hospital=k)
                       for k, (x, t, e) in enumerate(hospitals)], ignore_index=True)
    return CoxPHFitter(penalizer=penalizer).fit(frame, "T", "E", strata=["hospital"],
                                                fit_options=fit_options or None)


def test_efron_parts_equal_lifelines_at_any_beta():
    (x, t, e), = random_hospitals(3, sizes=(150,))
    beta = np.array([0.3, -0.2, 0.5, 0.1])
    order = np.argsort(t, kind="stable")
    ref = SemiParametricPHFitter.__new__(SemiParametricPHFitter)
    h, g, ll = ref._get_efron_values_single(
        pd.DataFrame(x[order]), pd.Series(t[order]), pd.Series(e[order]),
        pd.Series(np.ones(len(t))), None, beta)
    mine = efron_parts(x, t, e, beta)
    assert len(np.unique(t)) < len(t) / 3  # heavy ties
    assert mine.loglik == pytest.approx(ll, rel=1e-12)
    np.testing.assert_allclose(mine.gradient, g, rtol=1e-10, atol=1e-10)
    np.testing.assert_allclose(mine.hessian, h, rtol=1e-10, atol=1e-10)
    np.testing.assert_array_equal(from_triangle(triangle(mine.hessian), 4), mine.hessian)  # symmetric


@pytest.mark.parametrize("penalizer", [0.0, 0.1])
def test_stratified_fit_equals_lifelines_on_random_data_with_ties(penalizer):
    hospitals = random_hospitals(0)
    names = ["a", "b", "c", "flag"]
    result, table = federated(hospitals, names, penalizer)
    ref = lifelines_fit(hospitals, names, penalizer, **TIGHT)
    assert result.rounds <= 15
    np.testing.assert_allclose(table.coef, ref.params_.values, rtol=1e-5)
    np.testing.assert_allclose(table.se, ref.standard_errors_.values, rtol=1e-4)
    assert result.loglik == pytest.approx(ref.log_likelihood_, rel=1e-9)
    rows = table.rows()
    summary = ref.summary
    for name in names:
        assert rows[name].p == pytest.approx(summary.loc[name, "p"], rel=1e-3, abs=1e-12)
        assert rows[name].hr_lower_95 == pytest.approx(
            summary.loc[name, "exp(coef) lower 95%"], rel=1e-4)
    # lifelines' own defaults agree as closely on this data
    default = lifelines_fit(hospitals, names, penalizer)
    np.testing.assert_allclose(table.coef, default.params_.values, rtol=1e-5)


def test_tcga_brca_fit_equals_lifelines():
    data = load_tcga_brca()
    names = [c for c in data["northeast"][0].columns if c not in ("pid", "T", "E")]
    hospitals = [(tr[names].astype(float).values, tr["T"].astype(float).values,
                  tr["E"].astype(float).values > 0) for tr, _ in data.values()]
    result, table = federated(hospitals, names, 0.01)
    ref = lifelines_fit(hospitals, names, 0.01, **TIGHT)
    assert result.rounds <= 15
    np.testing.assert_allclose(table.coef, ref.params_.values, rtol=1e-5)
    np.testing.assert_allclose(table.se, ref.standard_errors_.values, rtol=1e-4)
    # stratified concordance from summed pair counts = lifelines' concordance_index_
    counts = np.sum([concordance_counts(t, e, x @ table.coef) for x, t, e in hospitals], axis=0)
    assert nt.concordance(*counts) == pytest.approx(ref.concordance_index_, abs=1e-12)
    # unpenalized: FLamby's one-hot columns are collinear -> named, with the penalizer advice
    with pytest.raises(nt.CollinearError, match=r"collinear.*tumor_stage_stage ia.*--penalizer"):
        federated(hospitals, names, 0.0)


def test_constant_column_is_named():
    hospitals = random_hospitals(1)
    hospitals = [(np.c_[x, np.full(len(x), 2.0)], t, e) for x, t, e in hospitals]
    with pytest.raises(nt.CollinearError, match=r"'always'.*one value in every row"):
        federated(hospitals, ["a", "b", "c", "flag", "always"], 0.1)


def test_separation_stops_within_the_round_limit_with_advice():
    rng = np.random.default_rng(2)
    hospitals = []
    for n in (40, 50):
        x = rng.normal(size=(n, 1))
        t = np.argsort(np.argsort(-x[:, 0])) + 1.0  # the covariate orders the events perfectly
        hospitals.append((x, t, np.ones(n, bool)))
    with pytest.raises(nt.ConvergenceFailed, match=r"did not converge in 15 rounds.*--penalizer"):
        federated(hospitals, ["x"], 0.0)


def test_concordance_counts_match_lifelines():
    (x, t, e), = random_hospitals(4, sizes=(90,))
    risk = x @ np.array([0.5, -0.3, 0.2, 0.4])
    assert nt.concordance(*concordance_counts(t, e, risk)) == pytest.approx(
        concordance_index(t, -risk, e), abs=1e-12)


def pooled_km(hospitals, min_count=1):
    grid = np.unique(np.concatenate([t[e] for t, e in hospitals]))
    at_risk = sum(km_counts(t, e, grid)[0] for t, e in hospitals)
    events = sum(km_counts(t, e, grid)[1] for t, e in hospitals)
    return kmm.apply_min_count(grid, at_risk, events, min_count)


def test_km_from_summed_counts_equals_lifelines_at_every_event_time():
    rng = np.random.default_rng(5)
    hospitals = [(np.ceil(rng.exponential(20, n)), rng.random(n) < 0.6) for n in (50, 70, 30)]
    curve = pooled_km(hospitals)
    t_all = np.concatenate([t for t, _ in hospitals])
    e_all = np.concatenate([e for _, e in hospitals])
    assert_km_is_lifelines(t_all, e_all, curve.times, curve.survival, curve.lower, curve.upper)


def test_min_count_rule_groups_small_cells_and_cuts_the_thin_tail():
    times = np.array([1.0, 2, 3, 4, 5, 6, 7])
    at_risk = np.array([40, 38, 30, 20, 9, 4, 2])
    events = np.array([1, 2, 3, 1, 4, 1, 1])
    shown = kmm.apply_min_count(times, at_risk, events, 3)
    # groups close at >= 3 events: {1,2} {3} {4,5}; the tail from at-risk 2 (< 3) is cut
    # and the short last group {6} (4 at risk, 1 event) joins the one before
    assert shown.times.tolist() == [2.0, 3.0, 6.0]
    assert shown.at_risk.tolist() == [40, 30, 20]
    assert shown.events.tolist() == [3, 3, 6]
    # the published points lie on the exact curve
    exact = kmm.km_curve(times[:6], at_risk[:6], events[:6])
    np.testing.assert_allclose(shown.survival, exact.survival[[1, 2, 5]])
    np.testing.assert_allclose(shown.lower, exact.lower[[1, 2, 5]])
    with pytest.raises(Exception, match="at least 1"):
        kmm.apply_min_count(times, at_risk, events, 0)


def test_km_on_tcga_brca_equals_lifelines_and_min_count_thins_it():
    data = load_tcga_brca()
    hospitals = [(tr["T"].astype(float).values, tr["E"].astype(float).values > 0)
                 for tr, _ in data.values()]
    curve = pooled_km(hospitals)
    t_all = np.concatenate([t for t, _ in hospitals])
    e_all = np.concatenate([e for _, e in hospitals])
    ref = KaplanMeierFitter().fit(t_all, e_all)
    np.testing.assert_allclose(curve.survival, ref.survival_function_.loc[curve.times].iloc[:, 0],
                               rtol=1e-12)
    assert len(curve.times) == len(np.unique(t_all[e_all]))
    thinned = pooled_km(hospitals, min_count=5)
    assert 0 < len(thinned.times) < len(curve.times) / 4
    assert thinned.events.min() >= 5 and thinned.at_risk.min() >= 5
    # fewer points, each on the exact curve
    exact = ref.survival_function_.loc[thinned.times].iloc[:, 0].values
    np.testing.assert_allclose(thinned.survival, exact, rtol=1e-12)
