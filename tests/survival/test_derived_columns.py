"""Derived columns never stop a run (issue 41, item 1; `protocol.design`).

fedsplit derives one-hot levels and missing-value indicators (also set by categories withheld
as rare) from the hospitals' columns. One of them that is constant at every hospital, or
collinear with the other covariates, is left out of the design with one warning naming its
source column; a user's own constant or collinear column still stops a Cox fit, naming it.

Checked on real survival tables shipped with lifelines (no download), split into centres (by
their own centre column where they have one: lung's institution, dd's continent), with and
without a held-out quarter per centre: the hospitals' summed stages (the coordinator's exact
fit, `server.survival.exact`) reach lifelines' stratified optimum on the design kept. Item 1's
case (five centres, a five-level text column without missing values, two numeric columns, 75%
of each centre's patients for training) reaches the pooled lifelines fit's mean per-centre
C-index within 0.01 on three seeds, in-process here and through `fedsplit simulate` (slow).
"""

from __future__ import annotations

import json
from types import SimpleNamespace

import numpy as np
import pandas as pd
import pytest
from fedsplit.client.data import encode_table
from fedsplit.client.survival.summary import cox_covariates, exact_vector
from fedsplit.protocol import design
from fedsplit.protocol import survival as sv
from fedsplit.protocol.schema import TableSettings, column_report, merge_reports
from fedsplit.protocol.stats import moments
from fedsplit.server.survival import newton as nt
from fedsplit.server.survival.app import upper_to_full
from lifelines import CoxPHFitter, datasets
from lifelines.utils import concordance_index

PRECISE = {"precision": 1e-12, "r_precision": 1e-14}
CENTRES = ("c561", "c562", "c563", "c564", "c565")


# --- real tables, split into centres ---------------------------------------------------------
def _split(frame: pd.DataFrame, centre: np.ndarray, names: list[str], seed: int,
           held_out: bool) -> tuple[dict[str, pd.DataFrame], dict[str, pd.DataFrame]]:
    """Per centre: its training rows (75% when ``held_out``, else all) and its test rows."""
    train, test = {}, {}
    for k, name in enumerate(names):
        rows = frame[centre == name].sample(frac=1.0, random_state=seed + k)
        rows = rows.reset_index(drop=True)
        cut = round(0.75 * len(rows)) if held_out else len(rows)
        train[name], test[name] = rows.iloc[:cut], rows.iloc[cut:]
    return train, test


def gbsg2(seed: int, held_out: bool = True):
    """Item 1's table: five centres (random), time, event, a five-level text column ``disease``
    without missing values (tumour grade and nodes; 'g3-high' is rare: withheld at some
    centres, named at others), two numeric columns."""
    d = datasets.load_gbsg2()
    disease = np.where(d.tgrade == "I", "grade1", np.where(
        d.tgrade == "II", np.where(d.pnodes <= 3, "g2-low", "g2-high"),
        np.where(d.pnodes <= 9, "g3-low", "g3-high")))
    frame = pd.DataFrame({"time": d.time, "event": d.cens, "disease": disease, "age": d.age,
                          "tsize": d.tsize})
    centre = np.asarray(CENTRES)[np.random.default_rng(seed).integers(0, 5, len(frame))]
    return _split(frame, centre, list(CENTRES), seed, held_out), TableSettings("time",
                                                                               event="event")


def rossi(seed: int, held_out: bool = True):
    """Recidivism, four random centres; prior convictions as a text column whose top level
    ('11+', 10 patients) is rare everywhere, so its rows read as unrecognised."""
    d = datasets.load_rossi()
    frame = d.drop(columns="prio").assign(prio=pd.cut(
        d.prio, [-1, 0, 2, 5, 10, 99], labels=["none", "1-2", "3-5", "6-10", "11+"]).astype(str))
    names = ["north", "south", "east", "west"]
    centre = np.asarray(names)[np.random.default_rng(seed).integers(0, 4, len(frame))]
    return _split(frame, centre, names, seed, held_out), TableSettings("week", event="arrest")


def lung(seed: int, held_out: bool = True):
    """NCCTG lung cancer split by its institutions (four groups), with its real missing values;
    sex and ECOG score as text (ECOG 3: one patient, withheld everywhere)."""
    d = datasets.load_lung().dropna(subset=["inst"])
    frame = d.drop(columns="inst").assign(
        sex=np.where(d.sex == 1, "male", "female"),
        **{"ph.ecog": ["" if np.isnan(v) else f"ecog{int(v)}" for v in d["ph.ecog"]]})
    centre = np.select([d.inst <= 1, d.inst <= 7, d.inst <= 13], ["i1", "i2-7", "i10-13"],
                       "i15-33")
    return (_split(frame, centre, ["i1", "i2-7", "i10-13", "i15-33"], seed, held_out),
            TableSettings("time", event="status"))


def dd(seed: int, held_out: bool = True):
    """Democracy and dictatorship: leaders' spells by continent (five centres); regime (six
    levels, several rare in Oceania) and democracy (a function of regime) as text; politycode
    has missing values."""
    d = datasets.load_dd()
    frame = d[["democracy", "regime", "un_region_name", "politycode", "start_year",
               "duration", "observed"]]
    names = sorted(d.un_continent_name.unique())
    return (_split(frame, d.un_continent_name.to_numpy(), names, seed, held_out),
            TableSettings("duration", event="observed"))


TABLES = {"gbsg2": gbsg2, "rossi": rossi, "lung": lung, "dd": dd}


# --- the federation in-process: the coordinator's steps on the hospitals' summed stages --------
def federate(train: dict[str, pd.DataFrame], settings: TableSettings, penalizer: float = 0.0):
    """Schema merge, the set-up's drop of constant derived features (`prune_schema` on the pooled
    moments, as `server.setup.prune_design`), then `server.survival.exact.fit_exact`'s steps."""
    reports = [column_report(n, f, settings) for n, f in train.items()]
    merged = merge_reports(reports, settings, task="survival").schema
    x = np.concatenate([encode_table(merged, f, source=n).x for n, f in train.items()])
    pruned = design.prune_schema(merged, *moments(x))
    schema = pruned.schema
    hospitals = []
    for n, f in train.items():
        data = encode_table(schema, f, source=n)
        empty = SimpleNamespace(x=data.x[:0], y=data.y[:0])
        hospitals.append(SimpleNamespace(name=n, train=data, val=empty))
    text = schema.to_json()
    names, _, _ = sv.cox_columns(schema)
    p = len(names)

    def total(stage: str, record: dict) -> np.ndarray:
        return np.sum([exact_vector(stage, {"stage": stage, "schema": text, **record}, h)
                       for h in hospitals], axis=0)

    m = total("moments", {})
    plan = nt.design(names, design.derived_features(schema), m[2:2 + p], m[2 + p:2 + 2 * p],
                     m[2 + 2 * p:])
    base = {"mean": plan.mean.tolist(), "std": plan.std.tolist()}

    def evaluate(beta: np.ndarray) -> tuple[float, np.ndarray, np.ndarray]:
        v = total("newton", {**base, "beta": beta.tolist()})
        return float(v[0]), v[1:1 + p], upper_to_full(v[1 + p:], p)

    result = nt.fit(plan, evaluate, penalizer)
    return SimpleNamespace(schema=schema, pruned=pruned, plan=plan, result=result,
                           warnings=[*pruned.warnings, *plan.warnings])


def risk(fed, frame: pd.DataFrame) -> np.ndarray:
    """The federated model's log relative hazard of raw rows."""
    x = cox_covariates(encode_table(fed.schema, frame, source="test").x, fed.schema.to_json())
    z = np.nan_to_num((x - fed.plan.mean) / fed.plan.std, nan=0.0)
    return z @ fed.plan.full(fed.result.beta)


def pooled_design(fed, frames: dict[str, pd.DataFrame], settings: TableSettings) -> pd.DataFrame:
    """The kept covariates of every centre's rows for lifelines (a missing number at the pooled
    mean: the federation's standardized 0), with time, event and centre."""
    parts = []
    for n, f in frames.items():
        x = cox_covariates(encode_table(fed.schema, f, source=n).x, fed.schema.to_json())
        x = np.where(np.isnan(x), fed.plan.mean, x)[:, fed.plan.used]
        part = pd.DataFrame(x, columns=fed.plan.used_names)
        part["T"] = pd.to_numeric(f[settings.target]).to_numpy(float)
        part["E"] = pd.to_numeric(f[settings.event]).to_numpy(int)
        parts.append(part.assign(centre=n))
    return pd.concat(parts, ignore_index=True)


# --- the rule -----------------------------------------------------------------------------------
def test_item_1_disease_missing_is_dropped_with_one_warning() -> None:
    (train, _), settings = gbsg2(0)
    fed = federate(train, settings)
    assert fed.pruned.dropped == {"disease:missing": design.NEVER_SET}
    assert fed.warnings == [
        "column 'disease': left out input(s) fedsplit derives from it, as they carry nothing: "
        "'disease:missing' (0 in every row at every hospital: no value of 'disease' is missing "
        "or unrecognised). The run goes on without them (nothing to fix)"]
    assert fed.plan.used_names == ["disease=g2-low", "disease=g3-high", "disease=g3-low",
                                   "disease=grade1", "age", "tsize"]


@pytest.mark.parametrize("held_out", [True, False], ids=["75%-train", "all-train"])
@pytest.mark.parametrize("table", sorted(TABLES))
def test_real_tables_fit_and_equal_lifelines_on_the_kept_design(table: str,
                                                                held_out: bool) -> None:
    (train, _), settings = TABLES[table](0, held_out)
    fed = federate(train, settings)
    before = design.derived_features(fed.pruned.schema if not fed.pruned.dropped else
                                     merge_reports([column_report(n, f, settings)
                                                    for n, f in train.items()], settings,
                                                   task="survival").schema)
    derived = design.derived_features(fed.schema)
    # only what fedsplit derived is left out, with one line per source column and stage
    assert set(fed.pruned.dropped) | set(fed.plan.dropped) <= set(before)
    assert len(fed.pruned.warnings) == len({before[n] for n in fed.pruned.dropped})
    assert len(fed.plan.warnings) == len({derived[n] for n in fed.plan.dropped})
    assert all(line.startswith("column '") and "\n" not in line for line in fed.warnings)
    assert set(fed.plan.used_names) >= {n for n in fed.plan.names if n not in derived}
    # lifelines (half steps: its damped full steps break down on lung's one patient of
    # unrecorded ECOG) on the kept design reaches the same maximum
    ref = CoxPHFitter().fit(pooled_design(fed, train, settings), "T", "E", strata=["centre"],
                            fit_options={**PRECISE, "step_size": 0.5, "max_steps": 500})
    assert fed.result.loglik == pytest.approx(ref.log_likelihood_, abs=1e-8)
    coef = fed.result.beta / fed.plan.standardization().std
    # that patient's indicator has no finite optimum (the likelihood rises to a plateau): its
    # coefficient is wherever the steps stopped; every other one is the maximum's
    finite = np.abs(fed.result.beta) < 4
    assert (~finite).sum() == (table == "lung" and held_out)
    np.testing.assert_allclose(coef[finite], ref.params_[fed.plan.used_names].to_numpy()[finite],
                               rtol=1e-5)


def test_what_each_table_drops() -> None:
    """The derived columns left out, and why, on the real tables (75% training rows, seed 0)."""
    got = {}
    for table in ("rossi", "lung", "dd"):
        (train, _), settings = TABLES[table](0)
        fed = federate(train, settings)
        got[table] = {**fed.pruned.dropped, **fed.plan.dropped}
    assert got["rossi"] == {}  # '11+' is withheld everywhere: prio:missing marks its rows
    assert got["lung"] == {}  # real gaps: every indicator varies
    # dd: a rare regime withheld in Oceania is named elsewhere, so regime:missing is never set;
    # 'democracy' is a function of 'regime' (one regime level adds no direction), and each
    # continent's regions sum to 1 within it (one level per continent is its stratum's)
    assert got["dd"] == {"regime:missing": design.NEVER_SET,
                         **dict.fromkeys(["regime=Presidential Dem", "un_region_name=South America",
                                          "un_region_name=Western Africa",
                                          "un_region_name=Western Asia",
                                          "un_region_name=Western Europe"], design.COLLINEAR)}


def test_a_users_own_constant_or_collinear_column_still_stops_the_fit() -> None:
    (train, _), settings = gbsg2(0)
    with pytest.raises(nt.CollinearError, match=r"'dose' take one value in every row.*"
                                                r"--ignore-column"):
        federate({n: f.assign(dose=2.5) for n, f in train.items()}, settings)
    with pytest.raises(nt.CollinearError, match=r"collinear.*: 'tsize', 'size2'\. .*--penalizer"):
        federate({n: f.assign(size2=2 * f.tsize + 1) for n, f in train.items()}, settings)


def test_derived_features_collinear_or_constant_within_each_hospital() -> None:
    """Two indicators of the same gaps: the second is left out; an indicator set at every row
    of one hospital and nowhere else is constant within each stratum: left out too."""
    rng = np.random.default_rng(0)
    train = {}
    for n in ("a", "b", "c"):
        size = 60
        x = rng.normal(size=size)
        gap = rng.random(size) < 0.2
        lab = np.where(gap, np.nan, rng.normal(size=size))
        frame = pd.DataFrame({"x": x, "lab": lab,
                              "lab2": np.where(gap, np.nan, rng.normal(size=size)),
                              "t": rng.exponential(10, size).round(1) + 0.1,
                              "e": (rng.random(size) < 0.7).astype(int)})
        if n == "c":
            frame["x"] = np.nan  # hospital c never records x
        train[n] = frame
    fed = federate(train, TableSettings("t", event="e"))
    assert fed.plan.dropped == {"lab2:missing": design.COLLINEAR, "x:missing": design.COLLINEAR}
    assert [w.split(":")[0] for w in fed.warnings] == ["column 'x'", "column 'lab2'"]


def test_prune_schema_levels_and_indicators() -> None:
    """A level no row holds leaves the vocabulary, an indicator every row sets is switched off
    (its column carries nothing then), a varying one stays; the kept features' moments are the
    old ones at ``keep``."""
    frames = {"a": pd.DataFrame({"w": ["x"] * 6 + ["y"] * 6, "v": ["p"] * 12,
                                 "t": np.arange(1.0, 13.0), "e": [1, 0] * 6}),
              "b": pd.DataFrame({"w": ["x"] * 5 + ["z"] * 6 + [""], "v": ["p"] * 12,
                                 "t": np.arange(1.0, 13.0), "e": [0, 1] * 6})}
    settings = TableSettings("t", event="e")
    schema = merge_reports([column_report(n, f, settings) for n, f in frames.items()], settings,
                           task="survival").schema
    assert schema.feature_names == ["w=x", "w=y", "w=z", "w:missing", "v=p"]
    x = np.concatenate([encode_table(schema, f, source=n).x for n, f in frames.items()])
    x[:, 1] = 0.0  # as if no row held 'y'
    count, total, sumsq = moments(x)
    pruned = design.prune_schema(schema, count, total, sumsq)
    assert pruned.dropped == {"w=y": design.NEVER_HELD, "v=p": design.ALWAYS_HELD}
    assert pruned.schema.feature_names == ["w=x", "w=z", "w:missing"]
    assert pruned.keep == [0, 2, 3]
    assert len(pruned.warnings) == 2
    same = design.prune_schema(schema, np.full(5, 10.0), np.full(5, 5.0), np.full(5, 5.0))
    assert same.schema is schema and same.warnings == []


def test_the_set_up_drops_for_every_task_kind() -> None:
    """`server.setup.prune_design`: the hospitals' statistics sliced to the features kept, so
    every hospital builds the model for the pruned schema, whatever the task kind; a schema
    with nothing constant is kept as it is."""
    from fedsplit.protocol.horizontal_wire import SiteStats
    from fedsplit.server.setup import prune_design

    (train, _), settings = gbsg2(0)
    schema = merge_reports([column_report(n, f, settings) for n, f in train.items()], settings,
                           task="survival").schema
    stats = []
    for n, f in train.items():
        x = encode_table(schema, f, source=n).x
        c, s, q = moments(x)
        stats.append(SiteStats(n, "mlp", "survival", (x.shape[1],), schema.feature_names, len(x),
                               c, s, q, 0, 0.0, 0.0))
    pruned, sliced, warnings = prune_design(schema, stats)
    assert "disease:missing" not in pruned.feature_names and len(warnings) == 1
    assert all(s.features == pruned.feature_names and s.input_shape == (7,) and len(s.sum) == 7
               for s in sliced)
    from dataclasses import replace

    plain = replace(schema, task="classification", event="", target="event")
    stats = [replace(s, task="classification") for s in stats]
    pruned, sliced, warnings = prune_design(plain, stats)
    assert "disease:missing" not in pruned.feature_names and len(warnings) == 1
    assert pruned.task == "classification"
    assert all(s.input_shape == (7,) for s in sliced)
    assert prune_design(pruned, sliced) == (pruned, sliced, [])


# --- item 1: parity with the pooled lifelines fit ------------------------------------------------
def pooled_lifelines_c(train: dict[str, pd.DataFrame], test: dict[str, pd.DataFrame]
                       ) -> dict[str, float]:
    """Per centre, the C-index on its test patients of lifelines' Cox fit on the pooled
    training rows (the user's own design: disease's dummies, age, tsize)."""
    levels = sorted(pd.concat(train.values()).disease.unique())

    def frame(f: pd.DataFrame) -> pd.DataFrame:
        out = f[["age", "tsize", "time", "event"]].astype(float)
        return out.assign(**{f"d_{v}": (f.disease == v).astype(float) for v in levels[1:]})

    cph = CoxPHFitter().fit(pd.concat([frame(f) for f in train.values()]), "time", "event")
    return {n: concordance_index(f.time, -cph.predict_partial_hazard(frame(f)), f.event)
            for n, f in test.items()}


@pytest.mark.parametrize("seed", [0, 1, 2])
def test_item_1_federated_c_index_is_the_pooled_fits(seed: int) -> None:
    (train, test), settings = gbsg2(seed)
    fed = federate(train, settings)
    federated = {n: concordance_index(f.time, -risk(fed, f), f.event) for n, f in test.items()}
    pooled = pooled_lifelines_c(train, test)
    assert abs(np.mean(list(federated.values())) - np.mean(list(pooled.values()))) < 0.01


@pytest.mark.slow
def test_item_1_through_simulate(tmp_path, capsys) -> None:
    """`fedsplit simulate --task survival` on item 1's table trains (it stopped on
    'disease:missing'), warns once, and its mean per-centre C-index is the pooled fit's."""
    from fedsplit.cli.app import app
    from fedsplit.cli.errors import run_guarded
    from fedsplit.protocol.schema import Schema
    from fedsplit.protocol.weights import read_schema

    (train, test), _ = gbsg2(0)
    args = []
    for n in CENTRES:
        train[n].to_csv(tmp_path / f"{n}_train.csv", index=False)
        test[n].to_csv(tmp_path / f"{n}_test.csv", index=False)
        args += ["--site", f"{n}={tmp_path / f'{n}_train.csv'}:{tmp_path / f'{n}_test.csv'}"]
    out = tmp_path / "run"
    code = run_guarded(app, ["simulate", "--task", "survival", "--time", "time", "--event",
                             "event", *args, "--out", str(out)])
    printed = capsys.readouterr().out
    assert code == 0, printed[-2000:]
    assert "disease:missing" in printed and "CollinearError" not in printed
    summary = json.loads((out / "summary.json").read_text())
    lines = [w for w in summary["schema"]["warnings"] if "disease:missing" in w]
    assert len(lines) == 1 and lines[0].startswith("column 'disease': left out")
    kept = Schema.from_json(read_schema(out / "federation" / "global.h5"))
    assert "disease:missing" not in kept.feature_names and summary["schema"]["features"] == 7
    federated = np.mean([summary["federated"]["per_site"][n]["c_index"] for n in CENTRES])
    assert abs(federated - np.mean(list(pooled_lifelines_c(train, test).values()))) < 0.01
