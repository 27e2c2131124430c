"""Personalization: each hospital fine-tunes the global model on its own training rows."""

from __future__ import annotations

import json
from pathlib import Path

import numpy as np
import pytest
import torch
from fedsplit.cli.app import app
from fedsplit.cli.errors import run_guarded
from fedsplit.client.data import Dataset
from fedsplit.client.models import ModelSpec, SiteModel, build_model
from fedsplit.client.site import split_site
from fedsplit.client.train import score
from fedsplit.orchestration.experiment import (
    Experiment,
    _concat,
    _fresh_model,
    check_schema,
    encode_sites,
    prepare_tables,
    run_experiment,
    train_baseline,
)
from fedsplit.orchestration.personalize import (
    ALONE,
    final_bias,
    fine_tune,
    parse_budget,
    parse_scope,
    personalize,
    pooled_metrics,
)
from fedsplit.protocol.config import RunConfig
from fedsplit.protocol.errors import ConfigError
from torch import nn


def hospitals(dataset: str, tmp_path: Path, cfg: RunConfig) -> tuple[dict[str, Dataset],
                                                                   list[tuple[str, Dataset]]]:
    """Three hospitals of a bundled dataset (label-skewed for classification): the rows each
    agent trains on, and each hospital's own test patients."""
    partition = "dirichlet:1.0" if dataset != "diabetes" else "iid"
    exp = Experiment(cfg=cfg, out=tmp_path, dataset=dataset, num_sites=3, partition=partition)
    tables = prepare_tables(exp)
    checked = check_schema(tables, cfg)
    pairs = encode_sites(tables, checked[0] if checked else None)
    trains = {t.name: split_site(train, cfg.val_fraction, cfg.seed)[0]
              for t, (train, _) in zip(tables, pairs, strict=True)}
    tests = [(t.name, test) for t, (_, test) in zip(tables, pairs, strict=True)]
    return trains, tests


def global_model(trains: dict[str, Dataset], cfg: RunConfig, num_outputs: int) -> SiteModel:
    """A model trained on all hospitals' rows: stands in for the federation's final model."""
    pooled = _concat(list(trains.values()))
    return train_baseline(pooled, pooled, num_outputs, cfg, steps=20)[0]


def weights(model: SiteModel) -> list[np.ndarray]:
    return [p.detach().numpy().copy() for p in model.parameters()]


def test_fine_tune_trains_a_copy_and_leaves_the_global_model(tmp_path: Path) -> None:
    # Prepare
    cfg = RunConfig(seed=0, target="target", hidden="16")
    trains, _ = hospitals("wine", tmp_path, cfg)
    model = global_model(trains, cfg, num_outputs=3)
    before = weights(model)
    # Execute
    tuned = fine_tune(model, trains["site-0"], cfg, steps=10, seed=1)
    # Assert: the global model is untouched, the hospital's copy moved
    assert all(np.array_equal(a, b) for a, b in zip(before, weights(model), strict=True))
    assert any(not np.allclose(a, b) for a, b in zip(before, weights(tuned), strict=True))
    assert tuned.spec == model.spec


def test_every_hospital_scores_its_own_fine_tuned_model_on_its_own_patients(tmp_path: Path) -> None:
    # Prepare: label-skewed hospitals, so a hospital's own rows pull its copy away from the global
    cfg = RunConfig(seed=0, target="target", hidden="16")
    trains, tests = hospitals("breast-cancer", tmp_path, cfg)
    model = global_model(trains, cfg, num_outputs=2)
    # Execute
    entry = personalize(model, trains, tests, cfg, steps=30)
    # Assert: the summary entry's shape
    names = [name for name, _ in tests]
    assert entry.steps_per_site == dict.fromkeys(names, 30)
    assert list(entry.per_site) == names
    assert entry.fine_tune_examples == {name: len(trains[name]) for name in names}
    assert set(entry.metrics) == {"loss", "accuracy"}
    for key in ("loss", "accuracy"):
        assert entry.mean_per_site[key] == pytest.approx(
            np.mean([entry.per_site[n][key] for n in names]))
    sizes = np.array([len(t) for _, t in tests])
    assert entry.metrics["accuracy"] == pytest.approx(
        np.dot(sizes, [entry.per_site[n]["accuracy"] for n in names]) / sizes.sum())
    # each hospital's number is its own model's, not the global model's
    plain = {name: score(model, t.x, t.y) for name, t in tests}
    assert all(entry.per_site[n]["loss"] != pytest.approx(plain[n]["loss"]) for n in names)
    # reproducible from the seed
    assert personalize(model, trains, tests, cfg, steps=30).per_site == entry.per_site


@pytest.mark.parametrize("dataset,num_outputs", [("wine", 3), ("diabetes", 1)])
def test_pooled_metrics_equal_scoring_every_row_with_its_hospitals_model(
        tmp_path: Path, dataset: str, num_outputs: int) -> None:
    # Prepare: two hospitals, each with its own (different) model
    cfg = RunConfig(seed=0, target="target", hidden="16")
    trains, tests = hospitals(dataset, tmp_path, cfg)
    tests = tests[:2]
    models = {name: fine_tune(global_model(trains, cfg, num_outputs), trains[name], cfg, 15, i)
              for i, (name, _) in enumerate(tests)}
    per_site = {name: score(models[name], t.x, t.y) for name, t in tests}
    # Execute
    pooled = pooled_metrics(per_site, tests, "classification" if num_outputs > 1 else "regression")
    # Assert: against predictions made row by row with the row's own hospital's model
    with torch.no_grad():
        if num_outputs > 1:
            hits = np.concatenate([models[n](torch.as_tensor(t.x)).argmax(1).numpy() == t.y
                                   for n, t in tests])
            assert pooled["accuracy"] == pytest.approx(hits.mean())
        else:
            pred = np.concatenate([models[n].predict(torch.as_tensor(t.x)).numpy().ravel()
                                   for n, t in tests])
            truth = np.concatenate([t.y for _, t in tests]).astype(np.float64)
            ss_res = ((truth - pred) ** 2).sum()
            assert pooled["rmse"] == pytest.approx(np.sqrt(ss_res / len(truth)), rel=1e-5)
            assert pooled["r2"] == pytest.approx(
                1 - ss_res / ((truth - truth.mean()) ** 2).sum(), rel=1e-5)
    assert pooled["loss"] == pytest.approx(
        sum(len(t) * per_site[n]["loss"] for n, t in tests) / sum(len(t) for _, t in tests))


def test_fine_tuning_needs_a_step_and_every_hospitals_rows(tmp_path: Path) -> None:
    cfg = RunConfig(seed=0, target="target", hidden="16")
    trains, tests = hospitals("wine", tmp_path, cfg)
    model = _fresh_model(trains["site-0"], 3, cfg)
    with pytest.raises(ConfigError, match="Received: 0"):
        fine_tune(model, trains["site-0"], cfg, steps=0, seed=0)
    with pytest.raises(ConfigError, match="site-2"):
        personalize(model, {k: v for k, v in trains.items() if k != "site-2"}, tests, cfg, 5)


def test_a_budget_per_hospital_fine_tunes_each_for_its_own_steps(tmp_path: Path) -> None:
    # Prepare
    cfg = RunConfig(seed=0, target="target", hidden="16")
    trains, tests = hospitals("wine", tmp_path, cfg)
    model = global_model(trains, cfg, num_outputs=3)
    budget = {"site-0": 5, "site-1": 30, "site-2": 12}
    # Execute
    entry = personalize(model, trains, tests, cfg, steps=budget)
    # Assert: each hospital's number is that of its own budget (site-1: 30 steps, as a uniform
    # 30 gives it), and another budget gives another model
    assert entry.steps_per_site == budget
    uniform = personalize(model, trains, tests, cfg, steps=30)
    assert entry.per_site["site-1"] == uniform.per_site["site-1"]
    assert entry.per_site["site-0"]["loss"] != pytest.approx(uniform.per_site["site-0"]["loss"])
    with pytest.raises(ConfigError, match="site-2"):
        personalize(model, trains, tests, cfg, steps={"site-0": 5, "site-1": 5})


@pytest.mark.parametrize("value,budget", [("0", 0), ("100", 100), (7, 7), ("alone", ALONE),
                                          (" Alone ", ALONE)])
def test_the_budget_option_takes_steps_or_alone(value: str | int, budget: int | str) -> None:
    assert parse_budget(value) == budget


@pytest.mark.parametrize("value", ["-1", "ten", "1.5", "", "alone,5", 2.5, True])
def test_a_bad_budget_names_what_is_allowed(value: object) -> None:
    with pytest.raises(ConfigError, match=r"'alone'.*Received: "):
        parse_budget(value)  # type: ignore[arg-type]


def state(model: SiteModel) -> dict[str, torch.Tensor]:
    return {k: v.detach().clone() for k, v in model.state_dict().items()}


@pytest.mark.parametrize("hidden,norm,bias", [("none", "none", "body.0.bias"),
                                              ("16", "none", "body.2.bias"),
                                              ("16-8", "batch", "body.6.bias")])
def test_bias_scope_moves_only_the_final_layers_bias(
        tmp_path: Path, hidden: str, norm: str, bias: str) -> None:
    # Prepare: logistic regression, an MLP, and an MLP with BatchNorm (its running statistics
    # move in training mode and must stay the global model's too)
    cfg = RunConfig(seed=0, target="target", hidden=hidden, norm=norm)
    trains, _ = hospitals("wine", tmp_path, cfg)
    model = global_model(trains, cfg, num_outputs=3)
    before = state(model)
    # Execute
    tuned = fine_tune(model, trains["site-0"], cfg, steps=40, seed=1, scope="bias")
    # Assert: the final bias moved; every other tensor is bit-identical to the global model's
    after = state(tuned)
    assert final_bias(model) == bias
    assert not torch.equal(after[bias], before[bias])
    assert list(after) == list(before)
    assert all(torch.equal(after[k], before[k]) for k in before if k != bias)
    assert all(torch.equal(v, before[k]) for k, v in state(model).items())  # global untouched
    assert all(p.requires_grad for p in tuned.parameters())  # trainable again, as any model
    # scope 'all' (the default) moves the other weights too
    full = state(fine_tune(model, trains["site-0"], cfg, steps=40, seed=1))
    assert not torch.equal(full[f"{bias[:-5]}.weight"], before[f"{bias[:-5]}.weight"])


def test_bias_scope_through_personalize_records_its_scope(tmp_path: Path) -> None:
    # Prepare
    cfg = RunConfig(seed=0, target="target", hidden="16")
    trains, tests = hospitals("breast-cancer", tmp_path, cfg)
    model = global_model(trains, cfg, num_outputs=2)
    # Execute: bias only, and the default (all)
    entry = personalize(model, trains, tests, cfg, steps=30, scope="bias")
    plain = personalize(model, trains, tests, cfg, steps=30)
    # Assert
    assert entry.scope == "bias" and plain.scope == "all"
    assert all(entry.per_site[n]["loss"] != pytest.approx(plain.per_site[n]["loss"])
               for n, _ in tests)


def test_the_final_bias_is_found_in_the_cnn_and_refused_without_one() -> None:
    cnn = build_model(ModelSpec("cnn", "classification", (1, 8, 8), 10), seed=0)
    assert final_bias(cnn) == "body.6.bias"
    model = build_model(ModelSpec("mlp", "classification", (4,), 2, hidden=(8,)), seed=0)
    model.body[-1] = nn.Linear(8, 2, bias=False)
    with pytest.raises(ConfigError, match=r"MLP .* and the CNN .*Received: last layer Linear "
                                          r"'body.2'"):
        final_bias(model)
    model.body.append(nn.BatchNorm1d(2))
    with pytest.raises(ConfigError, match=r"Received: last layer BatchNorm1d 'body\.3'"):
        final_bias(model)


@pytest.mark.parametrize("value,scope", [("all", "all"), ("bias", "bias"), (" Bias ", "bias"),
                                         ("auto", "auto")])
def test_the_scope_option_takes_all_or_bias(value: str, scope: str) -> None:
    assert parse_scope(value) == scope


@pytest.mark.parametrize("value", ["", "head", "weights", "all,bias"])
def test_a_bad_scope_names_the_choices(tmp_path: Path, value: str) -> None:
    with pytest.raises(ConfigError, match=r"one of auto, all, bias.*Received: "):
        parse_scope(value)
    cfg = RunConfig(seed=0, target="target", hidden="16")
    trains, tests = hospitals("wine", tmp_path, cfg)
    model = _fresh_model(trains["site-0"], 3, cfg)
    with pytest.raises(ConfigError, match=r"one of auto, all, bias"):
        personalize(model, trains, tests, cfg, steps=5, scope=value)
    with pytest.raises(ConfigError, match=r"one of auto, all, bias"):
        fine_tune(model, trains["site-0"], cfg, steps=5, seed=0, scope=value)


def simulate_refuses(tmp_path: Path, capsys: pytest.CaptureFixture[str], *args: str) -> str:
    """`fedsplit simulate ARGS --out DIR` exits with a ConfigError before writing DIR; the error
    it printed."""
    code = run_guarded(app, ["simulate", *args, "--out", str(tmp_path / "run")])
    assert code == ConfigError.exit_code
    assert not (tmp_path / "run").exists()
    return capsys.readouterr().err


def test_simulate_refuses_a_bad_scope_before_training(
        tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    err = simulate_refuses(tmp_path, capsys, "--dataset", "wine", "--personalize", "alone",
                           "--personalize-scope", "head")
    assert "--personalize-scope is one of auto, all, bias" in err


@pytest.mark.slow
def test_summary_records_the_personalization_scope(tmp_path: Path) -> None:
    # Prepare: a short real federation (Flower simulation) of three hospitals
    cfg = RunConfig(num_server_rounds=1, local_steps=3, seed=0, target="target", hidden="none")
    exp = Experiment(cfg=cfg, out=tmp_path / "run", dataset="wine", num_sites=3, personalize=4,
                     personalize_scope="bias")
    # Execute
    run_experiment(exp)
    # Assert
    tuned = json.loads((tmp_path / "run" / "summary.json").read_text())["personalized"]
    assert tuned["scope"] == "bias" and tuned["steps"] == 4
    assert tuned["steps_per_site"] == {"site-0": 4, "site-1": 4, "site-2": 4}
