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
"""

from __future__ import annotations

import copy
from collections.abc import Mapping, Sequence
from typing import Any, Literal

import numpy as np
from torch import nn

from client.data import Dataset
from client.models import SiteModel
from client.train import fit_steps, score
from protocol.config import RunConfig
from protocol.errors import ConfigError

#: ``--personalize alone``: each hospital's hospital-alone step budget
ALONE = "alone"

Budget = int | Literal["alone"]

#: ``--personalize-scope``: which weights a hospital fine-tunes
SCOPES = ("all", "bias")


def parse_budget(value: str | int) -> Budget:
    """``--personalize``: 0 (off), a number of mini-batches, or ``alone``; else `ConfigError`."""
    text = str(value).strip().lower()
    if text == ALONE:
        return ALONE
    try:
        steps = int(text)
    except ValueError:
        steps = -1
    if steps < 0 or isinstance(value, bool) or (isinstance(value, float) and not value.is_integer()):
        raise ConfigError(f"--personalize is 0 (off), a number of fine-tuning mini-batches per "
                          f"hospital (e.g. 100), or 'alone' (each hospital's hospital-alone step "
                          f"budget). Received: {value!r}")
    return steps


def parse_scope(value: str) -> str:
    """``--personalize-scope``: ``all`` or ``bias``; else `ConfigError`."""
    text = str(value).strip().lower()
    if text not in SCOPES:
        raise ConfigError(f"--personalize-scope is one of {', '.join(SCOPES)}: 'all' fine-tunes "
                          f"every weight of the global model, 'bias' only its final layer's bias. "
                          f"Received: {value!r}")
    return text


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
    scope = parse_scope(scope)
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


def pooled_metrics(per_site: Mapping[str, Mapping[str, float]],
                   tests: Sequence[tuple[str, Dataset]], task: str) -> dict[str, float]:
    """The metrics over all test rows, each predicted by its own hospital's model.

    Exact from the per-hospital metrics: loss and accuracy are row means (weighted by test
    rows); rmse pools the squared errors; r2 divides them by the pooled targets' variance.
    """
    sizes = np.array([len(t) for _, t in tests], dtype=np.float64)
    names = [name for name, _ in tests]

    def weighted(key: str) -> float:
        return float(np.dot(sizes, [per_site[n][key] for n in names]) / sizes.sum())

    out = {"loss": weighted("loss")}
    if task == "classification":
        out["accuracy"] = weighted("accuracy")
        return out
    ss_res = float(np.dot(sizes, [per_site[n]["rmse"] ** 2 for n in names]))
    truth = np.concatenate([np.asarray(t.y, dtype=np.float64) for _, t in tests])
    ss_tot = float(((truth - truth.mean()) ** 2).sum())
    out["r2"] = 1.0 - ss_res / ss_tot if ss_tot > 0 else 0.0
    out["rmse"] = float(np.sqrt(ss_res / len(truth)))
    return out


def personalize(model: SiteModel, trains: Mapping[str, Dataset],
                tests: Sequence[tuple[str, Dataset]], cfg: RunConfig,
                steps: int | Mapping[str, int], scope: str = "all") -> dict[str, Any]:
    """Fine-tune ``model`` at every hospital of ``tests`` on its ``trains`` rows; score each on
    its own test patients. ``steps``: the same mini-batches everywhere, or ``{name: steps}``;
    ``scope``: ``all`` or ``bias``.

    Returns the summary entry (``scope``, ``steps_per_site``, ``metrics``, ``per_site``,
    ``mean_per_site``, ``fine_tune_examples``: ``{name: rows fine-tuned on}``); the caller adds
    ``steps``, the budget as asked."""
    scope = parse_scope(scope)
    if scope == "bias":
        final_bias(model)  # refused before any hospital trains
    budget = steps if isinstance(steps, Mapping) else {name: steps for name, _ in tests}
    missing = [name for name, _ in tests if name not in trains or name not in budget]
    if missing:
        raise ConfigError(f"Every hospital scored needs its own training rows and a step budget "
                          f"to fine-tune with. Received: none for {missing}")
    per_site = {}
    for i, (name, test) in enumerate(tests):
        tuned = fine_tune(model, trains[name], cfg, budget[name],
                          seed=cfg.seed * 100_003 + 50_021 + i, scope=scope)
        per_site[name] = score(tuned, test.x, test.y)
    keys = sorted({k for m in per_site.values() for k in m})
    return {"scope": scope,
            "steps_per_site": {name: budget[name] for name, _ in tests},
            "metrics": pooled_metrics(per_site, tests, model.spec.task),
            "per_site": per_site,
            "mean_per_site": {k: float(np.mean([m[k] for m in per_site.values()])) for k in keys},
            "fine_tune_examples": {name: len(trains[name]) for name, _ in tests}}
