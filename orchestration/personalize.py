"""Personalization: each hospital fine-tunes the final federated model on its own training rows.

FedAvg + local fine-tuning ("FT", the baseline of the personalized-FL benchmarks): after the last
round, every hospital copies the global model and trains it for ``steps`` mini-batches of Adam
(the run's ``lr`` and ``batch_size``, a fresh optimizer) on its own training rows only: the
rows its agent trains on, i.e. its file minus its test patients and minus its own held-out
evaluation rows. Nothing is selected: the model after exactly ``steps`` steps is the hospital's
model (no test patient, and no other hospital's row, is ever looked at). Each hospital's model
is scored on its own test patients (``per_site``), their mean (``mean_per_site``) and the pooled
test rows, where each row is predicted by its own hospital's model (``metrics``).

The budget (``--personalize``) is a number of mini-batches, the same at every hospital, or
``alone``: each hospital fine-tunes for exactly the steps its hospital-alone baseline trains
(``rounds x`` its steps per round, `orchestration.experiment.baseline_steps`). With ``alone``
the comparison with the hospital alone is one of starting points only: the same local
compute, from the federated model instead of from scratch.

The scope (``--personalize-scope``) says which weights the hospital fine-tunes: ``all`` (every
weight, the default) or ``bias``: only the final layer's bias, every other tensor frozen at the
global model's value (a personalized head in the FedPer / FedRep family, reduced to its bias:
a per-hospital prior correction for hospitals that differ mostly in their label mix). The final
layer is the model's last ``Linear`` (the output layer of the MLP, logistic regression
included, and of the CNN); a model whose last layer with weights is not a ``Linear`` with a bias
is refused. With BatchNorm the running statistics, like every other tensor, stay the global
model's (the batches of the fine-tuning are normalised by their own statistics, as in training).

``--personalize prior`` is a tested prior correction, not a step budget: each hospital refits
only the final layer's bias to its own training rows by maximum likelihood (every other weight
the global model's: a convex problem over the logits, solved exactly by L-BFGS), then keeps the
refitted bias only when a likelihood-ratio test rejects the global bias at level
`PRIOR_TEST_LEVEL` (0.05). The statistic is 2 (log-likelihood refitted - global) on the
hospital's training rows, chi-squared with C - 1 degrees of freedom for C classes (a softmax
bias has C - 1 free directions) and, for a regression, n ln(MSE global / MSE refitted) with one
per output (Gaussian errors). A hospital whose label mix is the federation's keeps the global
model untouched; one whose mix differs (Switzerland: 93% positive) moves its decision threshold,
by the shift its own rows support. Nothing leaves the hospital: the test and the refit use its
own rows, and the summary records each hospital's statistic, p-value, decision and shift.
"""

from __future__ import annotations

import copy
from collections.abc import Mapping, Sequence
from typing import Literal

import numpy as np
import torch
from fedsplit.client.data import Dataset
from fedsplit.client.models import SiteModel
from fedsplit.client.train import fit_steps, loss_function, score, training_targets
from fedsplit.protocol.config import RunConfig
from fedsplit.protocol.errors import ConfigError
from fedsplit.protocol.record.summary import Personalized, PriorTest
from fedsplit.protocol.tasks import task_kind
from torch import nn

#: ``--personalize alone``: each hospital's hospital-alone step budget
ALONE = "alone"

#: ``--personalize prior``: each hospital refits its final bias when a likelihood-ratio test says so
PRIOR = "prior"

#: the likelihood-ratio test's level: a hospital adopts its refitted bias when p < this
PRIOR_TEST_LEVEL = 0.05

#: L-BFGS iterations of the bias refit (a convex problem of C unknowns; it converges in a few)
PRIOR_MAX_ITER = 100

Budget = int | Literal["alone", "prior"]

#: ``--personalize-scope``: which weights a hospital fine-tunes (``auto``: ``all`` for a step
#: budget, ``bias`` for ``prior``)
SCOPES = ("auto", "all", "bias")


def parse_budget(value: str | int) -> Budget:
    """``--personalize``: 0 (off), a number of mini-batches, ``alone`` or ``prior``; else
    `ConfigError`."""
    text = str(value).strip().lower()
    if text in (ALONE, PRIOR):
        return text  # type: ignore[return-value]
    try:
        steps = int(text)
    except ValueError:
        steps = -1
    if steps < 0 or isinstance(value, bool) or (isinstance(value, float) and not value.is_integer()):
        raise ConfigError(f"--personalize is 0 (off), a number of fine-tuning mini-batches per "
                          f"hospital (e.g. 100), 'alone' (each hospital's hospital-alone step "
                          f"budget) or 'prior' (each hospital refits its final bias when a "
                          f"likelihood-ratio test says its label mix differs). "
                          f"Received: {value!r}")
    return steps


def parse_scope(value: str) -> str:
    """``--personalize-scope``: ``auto``, ``all`` or ``bias``; else `ConfigError`."""
    text = str(value).strip().lower()
    if text not in SCOPES:
        raise ConfigError(f"--personalize-scope is one of {', '.join(SCOPES)}: 'all' fine-tunes "
                          f"every weight of the global model, 'bias' only its final layer's bias, "
                          f"'auto' (default) 'all' for a step budget and 'bias' for 'prior'. "
                          f"Received: {value!r}")
    return text


def resolve_scope(budget: Budget, scope: str) -> str:
    """The scope a ``budget`` runs with: ``auto`` resolved; ``prior`` with ``all`` refused."""
    scope = parse_scope(scope)
    if budget == PRIOR:
        if scope == "all":
            raise ConfigError("--personalize prior refits only the final layer's bias (every "
                              "other weight stays the global model's): use --personalize-scope "
                              "bias or auto, or a step budget (--personalize alone) to fine-tune "
                              "every weight. Received: --personalize prior --personalize-scope all")
        return "bias"
    return "all" if scope == "auto" else scope


def final_bias(model: nn.Module) -> str:
    """The state-dict name of the final layer's bias: the last ``Linear``'s, when that ``Linear``
    is the last layer with weights; `ConfigError` for a model without one."""
    layers = [(name, m) for name, m in model.named_modules()
              if any(True for _ in m.parameters(recurse=False))]
    if layers:
        name, last = layers[-1]
        if isinstance(last, nn.Linear) and last.bias is not None:
            return f"{name}.bias" if name else "bias"
    found = f"{type(layers[-1][1]).__name__} {layers[-1][0]!r}" if layers else "no layer"
    raise ConfigError(f"--personalize-scope bias fine-tunes the bias of the model's final Linear "
                      f"layer: the MLP (logistic regression included) and the CNN have one. Use "
                      f"--personalize-scope all for this model. Received: last layer {found}")


def fine_tune(model: SiteModel, train: Dataset, cfg: RunConfig, steps: int, seed: int,
              scope: str = "all") -> SiteModel:
    """A copy of ``model`` trained ``steps`` mini-batches on ``train`` (``model`` is unchanged);
    ``scope="bias"``: only the final layer's bias moves, every other tensor is ``model``'s."""
    scope = resolve_scope(steps, scope)
    if steps < 1:
        raise ConfigError(f"Fine-tuning takes at least one mini-batch; --personalize 0 turns it "
                          f"off. Received: {steps}")
    tuned = copy.deepcopy(model)
    if scope == "all":
        fit_steps(tuned, train.x, train.y, steps=steps, lr=cfg.lr, batch_size=cfg.batch_size,
                  seed=seed)
        return tuned
    bias = final_bias(tuned)
    for name, param in tuned.named_parameters():  # Adam skips the frozen ones (no gradient)
        param.requires_grad_(name == bias)
    fit_steps(tuned, train.x, train.y, steps=steps, lr=cfg.lr, batch_size=cfg.batch_size, seed=seed)
    for param in tuned.parameters():
        param.requires_grad_(True)
    # buffers (BatchNorm's running statistics) move in training mode: keep the global ones
    state = {k: v.clone() for k, v in model.state_dict().items()}
    state[bias] = tuned.state_dict()[bias].clone()
    tuned.load_state_dict(state)
    return tuned


def prior_test(model: SiteModel, train: Dataset) -> tuple[SiteModel, PriorTest]:
    """``--personalize prior`` at one hospital: the final bias refitted to ``train`` by maximum
    likelihood, kept when the likelihood-ratio test rejects the global bias (p <
    `PRIOR_TEST_LEVEL`).

    Returns the hospital's model (a copy of ``model``; its bias refitted or not) and the test's
    record (`PriorTest`): ``statistic``, ``df``, ``p_value``, ``adopted`` and ``bias_shift``
    (the refitted minus the global bias, per output, whether adopted or not)."""
    from scipy.stats import chi2

    if len(train) == 0:
        raise ConfigError("--personalize prior refits the final bias on the hospital's own "
                          "training rows; this hospital has none. Received: 0 rows")
    name = final_bias(model)
    tuned = copy.deepcopy(model).eval()
    x = torch.as_tensor(np.asarray(train.x), dtype=torch.float32)
    with torch.no_grad():
        logits = tuned(x).double()
    target = training_targets(tuned, train.y)
    if target.is_floating_point():
        target = target.double()
    loss_fn = loss_function(tuned)
    shift = torch.zeros(logits.shape[1], dtype=torch.float64, requires_grad=True)
    opt = torch.optim.LBFGS([shift], lr=1.0, max_iter=PRIOR_MAX_ITER, tolerance_grad=1e-10,
                            tolerance_change=1e-14, line_search_fn="strong_wolfe")

    def closure() -> torch.Tensor:
        opt.zero_grad()
        loss = loss_fn(logits + shift, target)
        loss.backward()
        return loss

    opt.step(closure)
    with torch.no_grad():
        before = float(loss_fn(logits, target))
        after = min(float(loss_fn(logits + shift, target)), before)  # never above the start
    n = len(train)
    if task_kind(model.spec.task).classes:
        df = logits.shape[1] - 1
        statistic = 2.0 * n * (before - after)
    else:
        df = logits.shape[1]
        statistic = n * float(np.log(before / after)) if after > 0 else float("inf")
    p_value = float(chi2.sf(statistic, df)) if df > 0 else 1.0
    adopted = bool(p_value < PRIOR_TEST_LEVEL)
    if adopted:
        state = tuned.state_dict()
        state[name] = (state[name].double() + shift.detach()).to(state[name].dtype)
        tuned.load_state_dict(state)
        with torch.no_grad():  # the bias must move the outputs one for one (no layer after it)
            moved = tuned(x).double() - logits
        if not torch.allclose(moved, shift.detach().expand_as(moved), atol=1e-4, rtol=1e-4):
            raise ConfigError(f"--personalize prior shifts the outputs through the final bias "
                              f"{name!r}, but this model transforms them after that layer; use "
                              f"a step budget (--personalize alone). Received: {type(model).__name__}")
    return tuned, PriorTest(statistic=statistic, df=df, p_value=p_value, adopted=adopted,
                            bias_shift=[float(v) for v in shift.detach()])


def pooled_metrics(per_site: Mapping[str, Mapping[str, float]],
                   tests: Sequence[tuple[str, Dataset]], task: str) -> dict[str, float]:
    """The metrics over all test rows, each predicted by its own hospital's model.

    Exact from the per-hospital metrics: loss and the task kind's metrics are row means
    (accuracy: weighted by test rows), except rmse, which pools the squared errors, and r2,
    which divides them by the pooled targets' variance.
    """
    sizes = np.array([len(t) for _, t in tests], dtype=np.float64)
    names = [name for name, _ in tests]

    def weighted(key: str) -> float:
        return float(np.dot(sizes, [per_site[n][key] for n in names]) / sizes.sum())

    metrics = task_kind(task).metrics
    out = {"loss": weighted("loss"), **{key: weighted(key) for key in metrics
                                        if key not in ("r2", "rmse")}}
    if "rmse" not in metrics:
        return out
    ss_res = float(np.dot(sizes, [per_site[n]["rmse"] ** 2 for n in names]))
    truth = np.concatenate([np.asarray(t.y, dtype=np.float64) for _, t in tests])
    ss_tot = float(((truth - truth.mean()) ** 2).sum())
    if "r2" in metrics:
        out["r2"] = 1.0 - ss_res / ss_tot if ss_tot > 0 else 0.0
    out["rmse"] = float(np.sqrt(ss_res / len(truth)))
    return out


def personalize(model: SiteModel, trains: Mapping[str, Dataset],
                tests: Sequence[tuple[str, Dataset]], cfg: RunConfig,
                steps: int | Mapping[str, int] | Literal["prior"],
                scope: str = "auto") -> Personalized:
    """Personalize ``model`` at every hospital of ``tests`` on its ``trains`` rows; score each on
    its own test patients. ``steps``: the same mini-batches everywhere, ``{name: steps}``, or
    ``"prior"`` (`prior_test`); ``scope``: ``auto``, ``all`` or ``bias``.

    Returns the summary entry (`Personalized`, with ``scope``, ``metrics``, ``per_site``,
    ``mean_per_site``, ``fine_tune_examples``: ``{name: rows fine-tuned on}``, and
    ``steps_per_site`` for a step budget or ``prior_test`` (``{name: its test's record}``) for
    ``prior``); the caller sets ``steps``, the budget as asked, and ``num_examples``."""
    prior = steps == PRIOR
    scope = resolve_scope(PRIOR if prior else 1, scope)
    if scope == "bias":
        final_bias(model)  # refused before any hospital trains
    budget = (steps if isinstance(steps, Mapping)
              else {name: steps for name, _ in tests})
    missing = [name for name, _ in tests if name not in trains or name not in budget]
    if missing:
        raise ConfigError(f"Every hospital scored needs its own training rows and a "
                          f"personalization budget. Received: none for {missing}")
    per_site, tested = {}, {}
    for i, (name, test) in enumerate(tests):
        if prior:
            tuned, tested[name] = prior_test(model, trains[name])
        else:
            tuned = fine_tune(model, trains[name], cfg, budget[name],
                              seed=cfg.seed * 100_003 + 50_021 + i, scope=scope)
        per_site[name] = score(tuned, test.x, test.y)
    keys = sorted({k for m in per_site.values() for k in m})
    entry = Personalized(
        scope=scope,
        metrics=pooled_metrics(per_site, tests, model.spec.task),
        per_site=per_site,
        mean_per_site={k: float(np.mean([m[k] for m in per_site.values()])) for k in keys},
        fine_tune_examples={name: len(trains[name]) for name, _ in tests})
    # only the budget's own record is set, so only it is written to summary.json
    if prior:
        entry.prior_test = tested
    else:
        entry.steps_per_site = {name: budget[name] for name, _ in tests}
    return entry
