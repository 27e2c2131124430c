"""The baselines of a survival run whose federated model is the exact Cox fit
(`protocol.survival_exact`): the centralized model and each hospital alone are fitted exactly
too, by the same Newton solver (`server.survival.newton`) on the same Efron sums
(`client.survival.cox`), so the comparison is between optima, not between an optimum and a
number of optimizer steps.

- centralized: the pooled rows as one stratum: lifelines' unstratified ``CoxPHFitter`` with
  the run's penalizer on the pooled rows (the pooled Cox fit);
- each hospital alone: its own rows;

each on all the rows (training and validation), as the federation's fit.
- the federation (`server.survival.exact`): each hospital its own stratum, as `fedsplit cox`.

A fit that has no unique optimum (a hospital alone whose columns are collinear without a
penalty, or a covariate that separates its few events) falls back to the recipe's training
(``fallback``), and says so in the log.

A module beside `orchestration.experiment`, not in ``orchestration.survival`` (which imports
`orchestration.experiment`: an import circle, tests/test_layers.py).
"""

from __future__ import annotations

import logging
from collections.abc import Callable
from typing import Any

import numpy as np
from fedsplit.client.data import Dataset
from fedsplit.client.models import SiteModel, recipe_of
from fedsplit.client.survival.cox import efron_parts
from fedsplit.client.survival.summary import cox_covariates, moments_vector, survival_rows
from fedsplit.protocol import survival as sv
from fedsplit.protocol import survival_exact as se
from fedsplit.protocol.design import derived_features
from fedsplit.protocol.errors import ConfigError, FederationError
from fedsplit.protocol.record.horizontal import RunRecord
from fedsplit.protocol.schema import Schema
from fedsplit.protocol.selection import BestRound
from fedsplit.server.survival import newton as nt

log = logging.getLogger(__name__)


def fitted_exactly(history: RunRecord) -> bool:
    """Whether the run's federated model is the exact Cox fit (its rounds are Newton rounds)."""
    return any(r.aggregation is not None and r.aggregation.strategy == se.NEWTON_STRATEGY
               for r in history.rounds)


def newton_fit(x: np.ndarray, time: np.ndarray, event: np.ndarray, names: list[str],
               penalizer: float, derived: dict[str, str] | None = None
               ) -> tuple[nt.Design, nt.NewtonResult]:
    """The exact Cox fit of one stratum (pooled standardization, lifelines' ridge, Efron ties),
    on the design the federation's fit uses (`server.survival.newton.design`: ``derived``
    covariates constant or collinear in these rows are left out)."""
    moments = moments_vector(x, event)
    p = x.shape[1]
    plan = nt.design(names, derived or {}, moments[2:2 + p], moments[2 + p:2 + 2 * p],
                     moments[2 + 2 * p:])
    z = np.nan_to_num((x - plan.mean) / plan.std, nan=0.0)

    def evaluate(beta: np.ndarray) -> tuple[float, np.ndarray, np.ndarray]:
        parts = efron_parts(z, time, event, beta)
        return parts.loglik, parts.gradient, parts.hessian

    return plan, nt.fit(plan, evaluate, penalizer)


def exact_baseline(model: SiteModel, train: Dataset, val: Dataset, schema_json: str,
                   fallback: Callable[[], tuple[SiteModel, BestRound]]
                   ) -> tuple[SiteModel, BestRound]:
    """``model`` (a fresh linear Cox recipe model) holding the exact fit on ``train`` and
    ``val`` (all the rows, as the federation's exact fit: no round is picked); the selection
    records the one candidate's C-index on those rows."""
    schema = Schema.from_json(schema_json)
    names, keep, _ = sv.cox_columns(schema)
    penalizer = float(getattr(recipe_of(model).params, "penalizer", 0.0))
    x, y = np.concatenate([train.x, val.x]), np.concatenate([train.y, val.y])
    time, event = survival_rows(y, "baseline training rows")
    try:
        plan, result = newton_fit(cox_covariates(x, schema_json), time, event, names, penalizer,
                                  derived_features(schema))
    except (ConfigError, FederationError) as e:
        log.warning("exact Cox baseline on %d rows has no unique fit (%s); trained by local "
                    "steps instead", len(train), e)
        return fallback()
    state = {k: v.numpy() for k, v in model.state_dict().items()}
    if plan.warnings:
        log.info("exact Cox baseline on %d rows: %s", len(x), " ".join(plan.warnings))
    arrays = se.linear_cox_arrays(state, keep, plan.mean, plan.std, plan.full(result.beta))
    load_arrays(model, arrays)
    picker = BestRound("last")
    picker.offer(recipe_of(model).metrics(model, x, y, _cpu())["c_index"])
    return model, picker


def load_arrays(model: SiteModel, arrays: dict[str, Any]) -> None:
    """Load named numpy arrays into the model (dtypes kept)."""
    from fedsplit.protocol.update import arrays_to_state_dict

    model.load_state_dict(arrays_to_state_dict(arrays, like=model.state_dict()))


def _cpu() -> Any:
    import torch

    return torch.device("cpu")
