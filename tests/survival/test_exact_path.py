"""The exact path of `simulate --task survival` (`protocol.survival_exact`): the hospitals'
stage vectors (`client.survival.summary.exact_vector`) summed and stepped by the coordinator's
Newton solver reach lifelines' stratified optimum; the fit written into the recipe's linear
model scores patients as the coefficients do; the centralized baseline is lifelines' pooled fit;
and the rule that picks the path."""

from __future__ import annotations

from types import SimpleNamespace

import numpy as np
import pandas as pd
import pytest
from fedsplit.client.data import encode_table
from fedsplit.client.models import build_model, recipe_of
from fedsplit.client.recipes import ModelInputs
from fedsplit.client.survival.recipe import Cox
from fedsplit.client.survival.summary import exact_vector
from fedsplit.orchestration.survival_baselines import exact_baseline, load_arrays
from fedsplit.protocol import survival as sv
from fedsplit.protocol import survival_exact as se
from fedsplit.protocol.config import RunConfig
from fedsplit.protocol.errors import ConfigError
from fedsplit.protocol.schema import Schema, column_report, merge_reports
from fedsplit.server.survival import newton as nt
from fedsplit.server.survival.app import upper_to_full
from lifelines import CoxPHFitter

PRECISE = {"precision": 1e-12, "r_precision": 1e-14}


def hospitals(seed: int = 0, sizes: tuple[int, ...] = (70, 90, 60)) -> dict[str, pd.DataFrame]:
    """Hospitals with two numeric covariates, a text one (three categories), tied integer
    times and censoring; hospital k shifts the baseline hazard."""
    rng = np.random.default_rng(seed)
    out = {}
    for k, n in enumerate(sizes):
        x = rng.normal(0.0, 1.0, (n, 2))
        ward = rng.choice(["a", "b", "c"], n)
        risk = x @ np.array([0.7, -0.5]) + np.where(ward == "c", 0.6, 0.0) + 0.4 * k
        t = np.ceil(rng.exponential(20 * np.exp(-risk)))
        e = (rng.random(n) < 0.7).astype(int)
        out[f"h{k}"] = pd.DataFrame({"age": x[:, 0] * 10 + 60, "dose": x[:, 1], "ward": ward,
                                     "T": t, "E": e})
    return out


def sites(frames: dict[str, pd.DataFrame], cfg: RunConfig) -> tuple[str, list[SimpleNamespace]]:
    """(schema JSON, each hospital as the agent holds it: 5 validation rows, the rest train)."""
    settings = cfg.table_settings
    schema = merge_reports([column_report(n, f, settings) for n, f in frames.items()], settings,
                           task="survival").schema
    out = [SimpleNamespace(name=n, train=encode_table(schema, f.iloc[5:], source=n),
                           val=encode_table(schema, f.iloc[:5], source=n))
           for n, f in frames.items()]
    return schema.to_json(), out


def total(stage: str, record: dict, hospitals: list[SimpleNamespace]) -> np.ndarray:
    return np.sum([exact_vector(stage, {"stage": stage, **record}, h) for h in hospitals], axis=0)


def fit(schema: str, hospitals: list[SimpleNamespace], penalizer: float
        ) -> tuple[list[str], nt.Standardization, nt.NewtonResult]:
    """The coordinator's steps (`server.survival.exact.fit_exact`) on summed vectors."""
    names, _, _ = sv.cox_columns(Schema.from_json(schema))
    p = len(names)
    m = total("moments", {"schema": schema}, hospitals)
    std = nt.standardization(names, m[2:2 + p], m[2 + p:2 + 2 * p], m[2 + 2 * p:])
    base = {"schema": schema, "mean": std.mean.tolist(), "std": std.std.tolist()}

    def evaluate(beta: np.ndarray) -> tuple[float, np.ndarray, np.ndarray]:
        v = total("newton", {**base, "beta": beta.tolist()}, hospitals)
        return float(v[0]), v[1:1 + p], upper_to_full(v[1 + p:], p)

    return names, std, nt.newton(evaluate, names, int(m[0]), penalizer)


def dummies(frames: dict[str, pd.DataFrame]) -> pd.DataFrame:
    pooled = pd.concat([f.assign(site=n) for n, f in frames.items()], ignore_index=True)
    return pd.get_dummies(pooled, columns=["ward"], drop_first=True, dtype=float)


@pytest.mark.parametrize("penalizer", [0.0, 0.05])
def test_summed_stages_reach_lifelines_stratified_optimum(penalizer: float) -> None:
    frames = hospitals()
    cfg = RunConfig.from_flower({"target": "T", "event": "E", "task": "survival"})
    schema, held = sites(frames, cfg)
    names, std, result = fit(schema, held, penalizer)
    assert len(names) == 4  # age, dose and ward's two non-reference categories
    coef = result.beta / std.std
    ref = CoxPHFitter(penalizer=penalizer).fit(dummies(frames), "T", "E", strata=["site"],
                                               fit_options=PRECISE)
    np.testing.assert_allclose(coef, ref.params_.to_numpy(), rtol=1e-6)
    # the recipe's linear model holding the fit scores patients as the coefficients do
    recipe = Cox({"hidden": [], "penalizer": penalizer})
    model = build_model(recipe.model_spec(ModelInputs("survival", (held[0].train.x.shape[1],), 1)),
                        seed=0, recipe=recipe)
    _, keep, _ = sv.cox_columns(held[0].train.schema)
    state = {k: v.numpy() for k, v in model.state_dict().items()}
    load_arrays(model, se.linear_cox_arrays(state, keep, std.mean, std.std, result.beta))
    x = held[1].val.x
    risk = recipe_of(model).predict(model, x)["risk"]
    expected = (x[:, keep] - std.mean) / std.std @ result.beta
    np.testing.assert_allclose(risk, expected, rtol=1e-5, atol=1e-5)


def test_pair_counts_are_lifelines_concordance_per_hospital() -> None:
    from lifelines.utils import concordance_index

    frames = hospitals(seed=3)
    cfg = RunConfig.from_flower({"target": "T", "event": "E", "task": "survival"})
    schema, held = sites(frames, cfg)
    p = 4
    beta = np.array([0.3, -0.2, 0.1, 0.5])
    record = {"schema": schema, "mean": [0.0] * p, "std": [1.0] * p, "beta": beta.tolist()}
    for h, (_, f) in zip(held, frames.items(), strict=True):
        c, tied, pairs, rows = exact_vector("concordance", {"stage": "concordance", **record}, h)
        x = dummies({"h": f})[["age", "dose", "ward_b", "ward_c"]].to_numpy()
        expected = concordance_index(f["T"], -(x @ beta), f["E"])
        assert (c + tied / 2) / pairs == pytest.approx(expected, rel=1e-12)
        assert rows == len(f)


def test_exact_centralized_baseline_is_lifelines_pooled_fit() -> None:
    frames = hospitals(seed=1)
    cfg = RunConfig.from_flower({"target": "T", "event": "E", "task": "survival",
                                 "penalizer": 0.05, "hidden": "none"})
    schema, held = sites(frames, cfg)
    from fedsplit.orchestration.experiment import _concat, _fresh_model

    train, val = _concat([h.train for h in held]), _concat([h.val for h in held])
    model, picked = exact_baseline(_fresh_model(train, 1, cfg), train, val, schema,
                                   lambda: pytest.fail("the exact fit fell back"))
    ref = CoxPHFitter(penalizer=0.05).fit(dummies(frames).drop(columns="site"), "T", "E",
                                          fit_options=PRECISE)
    _, keep, _ = sv.cox_columns(held[0].train.schema)
    weight = model.state_dict()["1.weight"].numpy().reshape(-1)
    scale = model.state_dict()["0.std"].numpy()
    np.testing.assert_allclose(weight[keep] / scale[keep], ref.params_.to_numpy(), rtol=1e-5)
    assert picked.round == 1 and 0 <= picked.scores[0] <= 1


def model_id(**params: object) -> str:
    recipe = Cox({"hidden": [], "penalizer": 0.0, **params})
    return recipe.model_spec(ModelInputs("survival", (3,), 1)).to_id()


def test_which_path_runs() -> None:
    plain = {"strategy": "fedavg", "server_opt": "none", "dp": "", "attack": "none",
             "attackers": 0}
    assert se.newton_solver(model_id(), **plain)
    assert not se.newton_solver(model_id(), **{**plain, "server_opt": "adam"})
    assert not se.newton_solver(model_id(), **{**plain, "strategy": "median"})
    assert not se.newton_solver(model_id(), **{**plain, "dp": "epsilon=1"})
    assert not se.newton_solver(model_id(hidden=[8]), **plain)
    assert not se.newton_solver(model_id(solver="sgd"), **plain)
    assert se.newton_solver(model_id(solver="newton"), **{**plain, "server_opt": "adam"})
    with pytest.raises(ConfigError, match="solver=newton"):
        se.newton_solver(model_id(solver="newton"), **{**plain, "dp": "epsilon=1"})
    with pytest.raises(ConfigError, match="solver is one of"):
        Cox({"solver": "lbfgs"})


def test_round_is_selected_by_the_summed_pairs_not_the_mean_of_c_indices() -> None:
    """Hospital a: 20 rows, all events (190 pairs); b: 100 rows, one early event (99 pairs).
    Round 1 orders b perfectly and a backwards, round 2 the reverse. The federation's
    row-weighted mean of C-indices prefers round 1 (b has more rows); the C over the summed
    pairs (what `select` uses) prefers round 2, which orders more pairs correctly."""
    from fedsplit.client.survival.cox import concordance_counts
    from fedsplit.protocol.record.horizontal import Phase, RoundEntry
    from fedsplit.server.merge import weighted_mean
    from fedsplit.server.selection import select

    t_a, e_a = np.arange(1.0, 21.0), np.ones(20, bool)
    t_b, e_b = np.arange(1.0, 101.0), np.arange(100) == 0
    rounds, expected = [], []
    for number, sign in ((1, 1.0), (2, -1.0)):
        sites, summed = [], np.zeros(3)
        for t, e, risk in ((t_a, e_a, sign * t_a), (t_b, e_b, -sign * t_b)):
            counts = np.array(concordance_counts(t, e, risk), float)
            summed += counts
            c, tied, pairs = counts
            sites.append((len(t), {"c_index": (c + tied / 2) / pairs,
                                   **sv.pair_rates(c, tied, pairs, len(t))}))
        expected.append((summed[0] + summed[1] / 2) / summed[2])
        rounds.append(RoundEntry(round=number, model=f"models/round-{number:03d}.h5",
                                 evaluate=Phase(metrics=weighted_mean(sites))))
    chosen = select(rounds, "best-val", model_id())
    np.testing.assert_allclose([s.score for s in chosen.val_metric], expected, rtol=1e-12)
    assert chosen.rounds_kept == 2
    mean_c = [r.evaluate.metrics["c_index"] for r in rounds]
    assert mean_c[0] > mean_c[1]  # the mean of C-indices would have kept round 1
