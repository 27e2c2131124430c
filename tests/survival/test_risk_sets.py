"""Deep (and any coupled-loss) survival training on whole risk sets (issue 35): a local step of
a loss that is not a sum over rows sees the hospital's whole training rows, or a sample of
``risk_set_rows`` patients, at the agent, in the baselines and in their step budgets."""

from __future__ import annotations

from pathlib import Path
from typing import Any, ClassVar

import numpy as np
import pytest
import torch
from fedsplit.client import app as agent
from fedsplit.client import parallel
from fedsplit.client.models import build_model, recipe_of
from fedsplit.client.recipes import ModelInputs, load_recipe
from fedsplit.client.survival.cox import efron_parts
from fedsplit.client.survival.recipe import Cox
from fedsplit.client.survival.tcga import load_tcga_brca
from fedsplit.client.train import (
    RISK_SET_ROWS,
    fit_steps,
    local_steps_per_round,
    set_statistics,
    step_batch_size,
)
from fedsplit.orchestration.datasets import table_keys
from fedsplit.orchestration.experiment import baseline_steps
from fedsplit.protocol import RunConfig
from fedsplit.protocol.errors import ConfigError
from fedsplit.protocol.schema import TableSettings, column_report, merge_reports
from flwr.app import ArrayRecord, ConfigRecord, Context, Message, RecordDict
from flwr.supercore.task_identity import TaskIdentity

REF = "fedsplit.client.survival.recipe:Cox"


class Sampled(Cox):
    """The Cox recipe with a small risk-set sample, to test the sampling branch quickly."""

    risk_set_rows: ClassVar[int] = 100


def cox_model(recipe: Any, p: int, x: np.ndarray) -> Any:
    model = build_model(recipe.model_spec(ModelInputs("survival", (p,), 1)), seed=0, recipe=recipe)
    set_statistics(model, x.mean(0), x.std(0))
    return model


def survival_rows(n: int, p: int = 3, seed: int = 0) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    rng = np.random.default_rng(seed)
    x = rng.normal(size=(n, p))
    beta = np.array([0.8, -0.5, 0.3])[:p]
    t = rng.exponential(np.exp(-x @ beta)) + 0.01
    c = rng.exponential(1.5, n) + 0.01
    e = (t <= c).astype(float)
    return x, np.c_[np.minimum(t, c), e], beta


def recorded_batches(monkeypatch: pytest.MonkeyPatch, recipe: Any) -> list[np.ndarray]:
    """Every training step's targets, as the recipe's train_step sees them."""
    seen: list[np.ndarray] = []
    step = recipe.train_step

    def spy(model, xb, yb, optimizers, penalty):
        seen.append(yb.numpy().copy())
        return step(model, xb, yb, optimizers, penalty)

    monkeypatch.setattr(recipe, "train_step", spy)
    return seen


def test_step_batch_size_follows_the_loss() -> None:
    cox = load_recipe(REF)
    assert step_batch_size(cox, 150, 32) == 150            # the whole rows: a full-batch step
    assert step_batch_size(cox, 10, 32) == 32              # never below --batch-size
    assert step_batch_size(cox, 10_000, 32) == RISK_SET_ROWS  # large: a sample of risk sets
    assert step_batch_size(cox, 10_000, 8000) == 8000      # an explicit larger batch is kept
    assert step_batch_size(Sampled(), 150, 32) == 100

    class SumOverRows(Cox):
        per_sample_loss: ClassVar[bool] = True

    class Off(Cox):
        risk_set_rows: ClassVar[int] = 0

    class Bad(Cox):
        risk_set_rows: ClassVar[Any] = "all"

    assert step_batch_size(SumOverRows(), 150, 32) == 32
    assert step_batch_size(Off(), 150, 32) == 32
    with pytest.raises(ConfigError, match=r"risk_set_rows .*int >= 0.*Received: Bad"):
        step_batch_size(Bad(), 150, 32)


def test_fit_steps_takes_full_batch_steps_for_a_cox_loss(monkeypatch) -> None:
    x, y, _ = survival_rows(150)
    recipe = load_recipe(REF, {"hidden": [8]})
    model = cox_model(recipe, 3, x)
    seen = recorded_batches(monkeypatch, recipe_of(model))
    fit_steps(model, x, y, steps=10, lr=0.01, batch_size=32, seed=1)
    assert len(seen) == 10
    for batch in seen:  # every step: all 150 patients, each once
        assert batch.shape == (150, 2)
        assert sorted(map(tuple, batch)) == sorted(map(tuple, y.astype(np.float32)))


def test_a_large_hospital_samples_distinct_patients_per_step(monkeypatch) -> None:
    x, y, _ = survival_rows(1000)
    y[:, 0] = np.arange(1000) + 1.0  # distinct times: a patient is recognisable by its time
    recipe = Sampled()
    model = cox_model(recipe, 3, x)
    seen = recorded_batches(monkeypatch, recipe_of(model))
    fit_steps(model, x, y, steps=10, lr=0.01, batch_size=32, seed=1)
    assert len(seen) == 10
    assert all(len(b) == 100 and len(np.unique(b[:, 0])) == 100 for b in seen)
    assert len(np.unique(np.concatenate([b[:, 0] for b in seen]))) == 1000  # one full pass


def test_full_batch_steps_reach_the_partial_likelihood_optimum_mini_batches_do_not() -> None:
    """The linear Cox model trained by fit_steps ends at the Efron optimum (Newton on the same
    rows); 32-row mini-batches (risk sets cut to each batch) end measurably elsewhere."""
    from fedsplit.server.survival import newton as nt

    x, y, _ = survival_rows(400, seed=3)
    z = (x - x.mean(0)) / x.std(0)
    fit = nt.newton(lambda b: (lambda p: (p.loglik, p.gradient, p.hessian))(
        efron_parts(z, y[:, 0], y[:, 1] > 0.5, b)), ["a", "b", "c"], len(x), 0.0)
    optimum = fit.beta

    def trained(recipe: Any) -> np.ndarray:
        torch.manual_seed(0)
        model = cox_model(recipe, 3, x)
        fit_steps(model, x, y, steps=400, lr=0.05, batch_size=32, seed=0)
        linear = next(m for m in model.modules() if isinstance(m, torch.nn.Linear))
        return linear.weight.detach().numpy().reshape(-1).astype(np.float64)

    class MiniBatch(Cox):
        risk_set_rows: ClassVar[int] = 0

    full, mini = trained(load_recipe(REF)), trained(MiniBatch())
    print("optimum", optimum, "full-batch", full, "32-row batches", mini)
    assert np.max(np.abs(full - optimum)) < 0.01, (full, optimum)
    assert np.max(np.abs(mini - optimum)) > 5 * np.max(np.abs(full - optimum)), (mini, optimum)


def test_baselines_get_the_agents_step_budget_on_whole_risk_sets() -> None:
    cfg = RunConfig(num_server_rounds=3, task="survival", target="T", event="E")
    cox = load_recipe(REF)
    rows = [38, 400, 6000]
    central, alone = baseline_steps(rows, cfg, cox)
    agent_steps = [local_steps_per_round(n, local_steps=0, local_epochs=1,
                                         batch_size=step_batch_size(cox, n, 32)) for n in rows]
    assert agent_steps == [10, 10, 10]  # full-batch (and 2 samples of 4096 for 6000) -> the minimum
    assert alone == [3 * s for s in agent_steps] and central == sum(alone)
    assert baseline_steps(rows, cfg)[1] == [30, 3 * 13, 3 * 188]  # a sum over rows: 32-row batches


@pytest.fixture
def task_identity():
    TaskIdentity.run_id, TaskIdentity.node_id, TaskIdentity.task_id = 1, 7, 1
    yield


def test_the_hospital_agent_trains_on_its_whole_risk_sets(tmp_path: Path, monkeypatch,
                                                         task_identity) -> None:
    """The agent's train handler (client.app): a deep Cox model's local steps each see all of
    the hospital's training rows."""
    train, _ = load_tcga_brca()["south"]
    path = tmp_path / "south.csv"
    train.to_csv(path, index=False)
    cfg = RunConfig(**table_keys("tcga-brca", hidden="16"), num_server_rounds=1)
    settings = TableSettings(target="T", id_column="pid", event="E")
    schema = merge_reports([column_report("south", train, settings)], settings,
                           task="survival").schema
    recipe = load_recipe(REF, {"hidden": [16], "penalizer": cfg.penalizer})
    spec = recipe.model_spec(ModelInputs("survival", (len(schema.feature_names),), 1))
    model = build_model(spec, seed=0, recipe=recipe)
    calls: list[dict[str, Any]] = []
    real = parallel.fit_parallel

    def spy(model, x, y, **kw):
        calls.append({"rows": len(x), **kw})
        return real(model, x, y, **kw)

    # the agent imports fit_parallel from its package when it trains (or at import): both spied
    monkeypatch.setattr(parallel, "fit_parallel", spy)
    if hasattr(agent, "fit_parallel"):
        monkeypatch.setattr(agent, "fit_parallel", spy)
    context = Context(run_id=1, node_id=7, node_config={"data-path": str(path)},
                      state=RecordDict(), run_config=cfg.to_flower())
    content = RecordDict({"arrays": ArrayRecord(model.state_dict()), "config": ConfigRecord({
        "model-id": spec.to_id(), "server-round": 1, "schema": schema.to_json()})})
    reply = agent.app(Message(content, dst_node_id=7, message_type="train"), context)
    assert not reply.has_error(), reply.error
    trained_rows = round(len(train) * (1 - cfg.val_fraction))
    (call,) = calls
    assert abs(call["rows"] - trained_rows) <= 1
    assert call["batch_size"] == call["rows"] and call["epochs"] == 10


@pytest.mark.slow
@pytest.mark.parametrize("server_opt", ["adam", "yogi"])
def test_simulate_trains_a_deep_cox_model_with_a_server_optimizer(tmp_path: Path,
                                                                  server_opt: str) -> None:
    """``simulate --task survival --hidden 16 --server-opt adam|yogi`` on three TCGA regions:
    local steps on each hospital's whole training rows (summary ``step_rows``), a server
    optimizer on the pseudo-gradient, and a model that ranks test patients (C > 0.6)."""
    import json

    from fedsplit.cli.app import app
    from typer.testing import CliRunner

    data = load_tcga_brca()
    sites = []
    for region in ("northeast", "south", "west"):
        for part, rows in zip(("train", "test"), data[region], strict=True):
            rows.to_csv(tmp_path / f"{region}_{part}.csv", index=False)
        sites += ["--site", f"{region}={tmp_path / f'{region}_train.csv'}:"
                            f"{tmp_path / f'{region}_test.csv'}"]
    out = tmp_path / "run"
    result = CliRunner().invoke(app, [
        "simulate", *sites, "--time", "T", "--event", "E", "--id-column", "pid",
        "--hidden", "16", "--penalizer", "0.01", "--rounds", "3", "--lr", "0.001",
        "--server-opt", server_opt, "--server-lr", "0.03", "--out", str(out)],
        env={"COLUMNS": "200"})
    assert result.exit_code == 0, result.output
    summary = json.loads((out / "summary.json").read_text())
    assert summary["server_opt"]["name"] == server_opt
    history = json.loads((out / "federation" / "history.json").read_text())
    assert len(history["rounds"]) == 3  # rounds of local steps, not the exact Newton fit
    trained = {name: round(len(data[name][0]) * 0.8) for name in ("northeast", "south", "west")}
    for name, rows in summary["step_rows"].items():  # every step: the hospital's whole rows
        assert abs(rows - trained[name]) <= 1, (name, rows)
    assert summary["steps_per_round"] == {name: 10 for name in trained}
    assert 0.6 < summary["federated"]["mean_per_site"]["c_index"] <= 1.0
