"""The exact path of `fedsplit simulate --task survival`: when the linear Cox model is fitted by
federated Newton-Raphson (the solver of `fedsplit cox`) instead of rounds of local steps, and
how the fit becomes the recipe's model (docs/survival.md, "Which path runs").

The Cox recipe's parameter ``solver`` (`SOLVERS`) decides, with the run config:

- ``newton``: the exact stratified fit (each hospital its own stratum, lifelines' convention:
  pooled standardization, ridge ``n P ||b||^2 / 2`` on standardized coefficients, Efron ties).
  The coefficients equal `fedsplit cox`'s on the same rows. Only for the linear model
  (``hidden`` empty), and refused under ``dp`` or ``attack``: Newton's sums are exact, neither
  noised nor robust to a hostile hospital.
- ``sgd``: rounds of local optimizer steps, averaged by the run's strategy (any model).
- ``auto`` (the default): ``newton`` for the linear model under plain FedAvg (no server
  optimizer, no DP, no simulated attack); ``sgd`` otherwise, so a run that asks for FedAdam,
  a robust rule, DP or an attack gets what it asked for.

`linear_cox_arrays` writes a Newton fit into the linear recipe model's arrays
(``Standardize`` buffers ``mean``/``std``, then ``Linear(p, 1)``'s ``weight`` and ``bias``):
the covariates the fit used get its pooled mean, standard deviation and standardized
coefficient; a text column's reference category (no coefficient) gets weight 0.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from typing import Any

import numpy as np
from fedsplit.protocol.errors import ConfigError
from fedsplit.protocol.recipe import describe_model

#: the Cox recipe's ``solver`` parameter
SOLVERS = ("auto", "newton", "sgd")
COX_RECIPE_NAME = "cox"
#: the kept model of a Newton fit is its optimum, not a round picked on validation rows
NEWTON_STRATEGY = "newton-cox"


def cox_params(model_id: str | None) -> dict[str, Any] | None:
    """The Cox recipe's parameters from a model id; None for any other model."""
    found = describe_model(model_id)
    if found is None or found.recipe.name != COX_RECIPE_NAME:
        return None
    return dict(found.recipe.params)


def newton_solver(model_id: str | None, *, strategy: str, server_opt: str, dp: str,
                  attack: str, attackers: int) -> bool:
    """Whether the run fits its model by the exact Newton solver (module docstring)."""
    params = cox_params(model_id)
    if params is None:
        return False
    solver = str(params.get("solver", "auto"))
    linear = not list(params.get("hidden") or [])
    hostile = attackers > 0 and attack not in ("", "none")
    if solver == "newton":
        if not linear:
            raise ConfigError(f"solver=newton fits the linear Cox model exactly; an MLP risk "
                              f"model (hidden {params.get('hidden')}) trains by local steps: "
                              f"use solver=sgd or auto. Received: hidden={params.get('hidden')}")
        if dp or hostile:
            raise ConfigError(f"solver=newton sums exact gradients and Hessians: it adds no DP "
                              f"noise and cannot exclude a hostile hospital. Use solver=sgd (or "
                              f"auto) with --dp or --attack. Received: dp={dp!r}, "
                              f"attack={attack!r}, attackers={attackers}")
        return True
    return (solver == "auto" and linear and not dp and not hostile and strategy == "fedavg"
            and server_opt in ("", "none"))


def linear_cox_arrays(template: Mapping[str, np.ndarray], keep: Sequence[int],
                      mean: np.ndarray, std: np.ndarray, beta: np.ndarray) -> dict[str, np.ndarray]:
    """The linear Cox model's arrays holding a Newton fit (module docstring). ``template``: the
    model's arrays in state-dict order (mean, std, weight, bias), whose names and dtypes are
    kept; ``keep``: the fitted covariates' positions among the model's inputs."""
    names = list(template)
    roles = [n.rsplit(".", 1)[-1] for n in names]
    if roles != ["mean", "std", "weight", "bias"]:
        raise ConfigError(f"The exact Cox fit writes into the linear Cox model (Standardize, "
                          f"then Linear(p, 1)); this model's arrays are another layout. Use "
                          f"solver=sgd for other models. Received: {names}")
    arrays = {n: np.array(template[n], copy=True) for n in names}
    m, s, w, b = (arrays[n] for n in names)
    if w.shape != (1, m.size) or s.shape != m.shape or b.shape != (1,):
        raise ConfigError(f"The linear Cox model's arrays do not fit together. Received: shapes "
                          f"{[arrays[n].shape for n in names]}")
    keep = np.asarray(keep, dtype=np.int64)
    if not (len(keep) == len(mean) == len(std) == len(beta)):
        raise ConfigError(f"A Newton fit has one mean, std and coefficient per covariate. "
                          f"Received: {len(keep)} positions, {len(mean)}/{len(std)}/{len(beta)}")
    m[...], s[...], w[...], b[...] = 0.0, 1.0, 0.0, 0.0
    m.reshape(-1)[keep] = mean
    s.reshape(-1)[keep] = std
    w.reshape(-1)[keep] = beta
    return arrays
