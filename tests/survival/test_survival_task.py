"""Survival as a task of ``fedsplit simulate``: the schema carries both target columns, every
row's time and event are checked, the run config and the CLI's options agree, and the bundled
Fed-TCGA-BRCA gives FLamby's regions and split."""

from __future__ import annotations

import json

import numpy as np
import pandas as pd
import pytest
from fedsplit.client.node_config import NodeConfig
from fedsplit.client.recipes import load_recipe
from fedsplit.client.site import effective_recipe, site_recipe
from fedsplit.client.survival.recipe import Cox
from fedsplit.orchestration.datasets import SIMULATE_DATASETS, table_keys
from fedsplit.orchestration.experiment import Experiment, check_schema, prepare_tables
from fedsplit.protocol.config import RunConfig
from fedsplit.protocol.errors import ConfigError
from fedsplit.protocol.schema import (
    Schema,
    SchemaColumn,
    TableSettings,
    column_report,
    encode_frame,
    merge_reports,
    moment_warnings,
)
from fedsplit.protocol.stats import moments

SETTINGS = TableSettings(target="days", id_column="pid", event="died")


def table(n: int, seed: int, *, event_words: tuple[str, str] = ("1", "0")) -> pd.DataFrame:
    rng = np.random.default_rng(seed)
    return pd.DataFrame({
        "pid": [f"p{seed}-{i}" for i in range(n)],
        "age": rng.integers(30, 90, n).astype(str),
        "stage": rng.choice(["I", "II", "III"], n),
        "days": rng.integers(1, 400, n).astype(str),
        "died": np.where(rng.random(n) < 0.4, *event_words),
    })


def merged(frames: dict[str, pd.DataFrame], task: str = "auto") -> Schema:
    return merge_reports([column_report(k, v, SETTINGS) for k, v in frames.items()], SETTINGS,
                         task=task).schema


def test_the_schema_carries_both_target_columns_and_encodes_time_and_event():
    frames = {"north": table(40, 0), "south": table(30, 1, event_words=("yes", "no"))}
    report = column_report("north", frames["north"], SETTINGS)
    assert report.target.kind == "time-event" and report.target.labels is None
    assert {c.name for c in report.columns} == {"age", "stage"}  # time, event, ID set aside
    schema = merged(frames)
    assert (schema.task, schema.target, schema.event) == ("survival", "days", "died")
    assert schema.feature_names == ["age", "stage=I", "stage=II", "stage=III"]
    again = Schema.from_json(schema.to_json())
    assert again == schema and json.loads(schema.to_json())["event"] == "died"
    x, y = encode_frame(schema, frames["south"], where="south")
    assert x.shape == (30, 4) and y.shape == (30, 2) and y.dtype == np.float32
    assert y[:, 0].tolist() == frames["south"]["days"].astype(float).tolist()
    assert y[:, 1].tolist() == (frames["south"]["died"] == "yes").astype(float).tolist()
    # patients to score need neither column
    x_only, none = encode_frame(schema, frames["south"].drop(columns=["days", "died"]),
                                where="new", need_target=False)
    assert none is None and np.array_equal(x_only, x)


def test_other_schemas_read_and_hash_as_before():
    plain = TableSettings(target="died", id_column="pid")
    frame = table(40, 0).drop(columns=["days"])
    schema = merge_reports([column_report("a", frame, plain)], plain).schema
    assert "event" not in json.loads(schema.to_json()) and schema.event == ""
    assert Schema.from_json(schema.to_json()) == schema
    raw = json.loads(schema.to_json())
    with pytest.raises(ConfigError, match="survival schema names its event column"):
        Schema.from_json({**raw, "task": "survival"})
    with pytest.raises(ConfigError, match="survival schema names its event column"):
        Schema.from_json({**raw, "event": "died"})


def test_unusable_rows_are_refused_with_counts_and_the_fix():
    frame = table(40, 0)
    frame.loc[[0, 1], "days"] = ""
    frame.loc[2, "days"] = "-3"
    frame.loc[3, "died"] = "maybe"
    with pytest.raises(ConfigError) as err:
        column_report("north", frame, SETTINGS)
    text = str(err.value)
    assert "2 row(s) have no time" in text and "1 row(s) have a time <= 0" in text
    assert "'maybe'" in text and "1/0, TRUE/FALSE or yes/no" in text
    with pytest.raises(ConfigError, match=r"no event column .died.*--event"):
        column_report("north", table(10, 0).drop(columns=["died"]), SETTINGS)
    # one refusal names every hospital with a problem, before any process starts
    bad_time = table(30, 1)
    bad_time["days"] = "soon"
    none_died = table(30, 2)
    none_died["died"] = "0"
    cfg = RunConfig(task="survival", target="days", event="died", id_column="pid")
    tables = [type("T", (), {"name": n, "train": f, "test": f.iloc[:0], "is_table": True})()
              for n, f in (("north", table(30, 0)), ("south", bad_time), ("west", none_died))]
    with pytest.raises(ConfigError) as err:
        check_schema(tables, cfg)
    assert "south: time column 'days' holds text in 30 row(s)" in str(err.value)
    assert "west: no patient has an event" in str(err.value)
    assert "no row was dropped" in str(err.value)


def test_hospitals_must_run_the_same_task():
    plain = TableSettings(target="days", id_column="pid")
    reports = [column_report("north", table(30, 0), SETTINGS),
               column_report("south", table(30, 1).drop(columns=["died"]), plain)]
    with pytest.raises(ConfigError, match="south reported a 'numeric' target"):
        merge_reports(reports, SETTINGS)
    with pytest.raises(ConfigError, match="--task survival --time COLUMN --event COLUMN"):
        merge_reports(reports[1:], plain, task="survival")


def test_run_config_keys_agree():
    assert RunConfig(target="days", event="died").task == "survival"
    assert RunConfig(target="days", event="died").table_settings.event == "died"
    with pytest.raises(ConfigError, match="needs the event column"):
        RunConfig.from_flower({"task": "survival", "target": "days"})
    with pytest.raises(ConfigError, match="makes the task survival"):
        RunConfig.from_flower({"task": "regression", "target": "days", "event": "died"})
    with pytest.raises(ConfigError, match="must differ"):
        RunConfig.from_flower({"target": "days", "event": "days"})
    with pytest.raises(ConfigError, match="penalizer is the Cox model's ridge penalty"):
        RunConfig.from_flower({"penalizer": 0.1})


def test_simulate_options_make_the_table_keys():
    assert "tcga-brca" in SIMULATE_DATASETS
    assert table_keys("tcga-brca") == {"target": "T", "event": "E", "id_column": "pid",
                                       "task": "survival", "hidden": "none", "penalizer": 0.01}
    assert table_keys("tcga-brca", penalizer=0.0)["penalizer"] == 0.0
    assert table_keys("tcga-brca", hidden="16")["hidden"] == "16"
    assert table_keys(None, time="days", event="died") == {
        "target": "days", "event": "died", "id_column": "", "task": "auto", "hidden": "none",
        "penalizer": 0.0}
    assert table_keys(None)["hidden"] == "64-32"
    with pytest.raises(ConfigError, match="leave --event unset"):
        table_keys("tcga-brca", event="vital")
    with pytest.raises(ConfigError, match="leave --task unset"):
        table_keys("tcga-brca", task="regression")
    with pytest.raises(ConfigError, match="--time needs --event"):
        table_keys(None, time="days")
    with pytest.raises(ConfigError, match="give --time or --target, not both"):
        table_keys(None, time="days", target="other", event="died")


def test_tcga_brca_gives_flambys_regions_and_split(tmp_path):
    cfg = RunConfig(**table_keys("tcga-brca"))
    exp = Experiment(cfg=cfg, out=tmp_path / "run", dataset="tcga-brca")
    tables = prepare_tables(exp)
    assert [t.name for t in tables] == ["northeast", "south", "west", "midwest", "europe",
                                        "canada"]
    assert sum(len(t.train) for t in tables) == 866 and sum(len(t.test) for t in tables) == 222
    schema, _ = check_schema(tables, cfg)
    assert schema.task == "survival" and len(schema.feature_names) == 39
    with pytest.raises(ConfigError, match="drop --sites and --partition"):
        Experiment(cfg=cfg, out=tmp_path / "run", dataset="tcga-brca", num_sites=3)
    with pytest.raises(ConfigError, match="needs the run config's target 'T'"):
        prepare_tables(Experiment(cfg=RunConfig(), out=tmp_path / "r", dataset="tcga-brca"))
    # patient-level DP cannot clip a Cox partial likelihood: refused before Flower starts
    with pytest.raises(ConfigError, match="sum over patients"):
        Experiment(cfg=RunConfig(**table_keys("tcga-brca"), dp="epsilon=5,delta=1e-3"),
                   out=tmp_path / "dp", dataset="tcga-brca")


def test_the_survival_task_trains_the_cox_recipe_with_hidden_and_penalizer():
    cfg = RunConfig(target="days", event="died", hidden="none", penalizer=0.01)
    recipe = site_recipe(NodeConfig(), cfg)
    assert isinstance(recipe, Cox) and recipe.params.hidden == [] and recipe.params.penalizer == 0.01
    assert effective_recipe(NodeConfig(), cfg, "mlp") is recipe
    assert site_recipe(NodeConfig(), RunConfig()) is None
    with pytest.raises(ConfigError, match="the run's: --time, --event"):
        load_recipe("fedsplit.client.survival.recipe:Cox", {"time": "T", "event": "E"})


def test_one_hot_indicators_absent_at_a_small_hospital_are_no_placeholder():
    rng = np.random.default_rng(0)
    onehot = {"big": rng.integers(0, 2, (50, 1)).astype(float), "small": np.zeros((8, 1))}
    schema = Schema((SchemaColumn("stage_iv", "numeric"),), "y", "regression")
    assert moment_warnings(schema, {k: moments(v) for k, v in onehot.items()}) == []
    chol = {"big": rng.normal(200, 30, (50, 1)), "small": np.zeros((8, 1))}
    assert "constant at small" in moment_warnings(
        schema, {k: moments(v) for k, v in chol.items()})[0]


def test_simulate_refuses_unusable_survival_tables_before_flower_starts(tmp_path, capsys):
    """Bad input named per hospital with the fix, exit code 2, nothing started or written."""
    from fedsplit.cli.app import app
    from fedsplit.cli.errors import run_guarded

    frames = {"north": table(40, 0), "south": table(40, 1), "west": table(40, 2),
              "east": table(40, 3)}
    frames["south"]["died"] = "0"  # no event at all
    frames["west"]["days"] = "30"  # every time equal
    frames["east"].loc[[0, 1, 2], "died"] = "alive"  # another word
    frames["north"].loc[[4, 5], "days"] = "unknown"  # text in the time column
    args = []
    for name, frame in frames.items():
        frame.to_csv(tmp_path / f"{name}.csv", index=False)
        args += ["--site", f"{name}={tmp_path / f'{name}.csv'}"]
    out = tmp_path / "run"
    code = run_guarded(app, ["simulate", *args, "--time", "days", "--event", "died",
                             "--id-column", "pid", "--out", str(out)])
    assert code == 2
    text = " ".join(capsys.readouterr().err.split())
    assert text.startswith("SurvivalDataError: Survival data refused"), text
    assert "south: no patient has an event" in text
    assert "west: every time in 'days' is the same" in text
    assert "east: event column 'died' holds ['alive'] in 3 row(s)" in text
    assert "north: time column 'days' holds text in 2 row(s)" in text
    assert "no row was dropped" in text
    assert not (out / "flower").exists()
    for name, frame in frames.items():  # the hospitals' files are untouched
        assert (tmp_path / f"{name}.csv").read_text() == frame.to_csv(index=False)
