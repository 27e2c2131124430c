"""The hospital's side of the survival summary after training (`server.survival.summary`):
sums of its own training rows, never a row.

The horizontal agent (`client/app.py`, ``query.survival``) hands every summary instruction to
`answer`. The hospital reads its rows as for training (`client.site.load_site`, encoded with the
schema the instruction carries: the same training rows, the same held-out cut; ``rows``
``all`` adds the held-out rows, after an exact fit that used them), then per stage
(`protocol.survival_summary.STAGES`):

- ``km-times``: its distinct event times;
- ``km-counts``: ``[rows, at risk per grid time, events per grid time]`` (`km_vector`);
- ``moments``, ``newton``, ``concordance``: the exact linear Cox fit's sums on all its rows, as
  `fedsplit cox`'s hospital (`exact_vector`; the fit runs instead of training rounds:
  `protocol.survival_exact`);
- ``baseline``: it rebuilds the kept model from the instruction's arrays and model id with its
  own recipe (`client.models.build_model`, strict: the federation's recipe), scores its
  training rows (``risk``: the recipe's log relative hazard) and sends ``[events per grid time,
  sum of exp(risk) over its patients at risk per grid time]`` (`baseline_vector`).

Under secure aggregation (an instruction carrying a ``secagg`` record) the vector is encoded in
fixed point (`protocol.survival.encode_fixed`) and masked; only the masked vector leaves.
"""

from __future__ import annotations

from typing import Any

import numpy as np
from fedsplit.client.models import ModelSpec, build_model, recipe_of
from fedsplit.client.node_config import NodeConfig
from fedsplit.client.secure import secagg
from fedsplit.client.secure.agent import take_secure_record
from fedsplit.client.site import effective_recipe, load_site
from fedsplit.client.survival.cox import concordance_counts, efron_parts, km_counts, triangle
from fedsplit.protocol import privacy as pv
from fedsplit.protocol import survival as sv
from fedsplit.protocol import survival_summary as ss
from fedsplit.protocol.config import RunConfig
from fedsplit.protocol.errors import ConfigError
from fedsplit.protocol.schema import Schema
from fedsplit.protocol.update import arrays_to_state_dict
from flwr.app import Array, ArrayRecord, ConfigRecord, Context, Message, RecordDict


def survival_rows(y: np.ndarray, where: str) -> tuple[np.ndarray, np.ndarray]:
    """(time float64, event bool) of a survival dataset's N x 2 targets."""
    y = np.asarray(y, np.float64)
    if y.ndim != 2 or y.shape[1] != 2:
        raise ConfigError(f"{where}: the survival summary needs (time, event) targets, N x 2. "
                          f"Received: shape {y.shape}")
    return y[:, 0], y[:, 1] > 0.5


def km_vector(time: np.ndarray, event: np.ndarray, grid: np.ndarray) -> np.ndarray:
    """``[rows, at risk per grid time, events per grid time]`` (the ``km-counts`` reply)."""
    at_risk, events = km_counts(time, event, grid)
    return np.concatenate([[len(time)], at_risk, events]).astype(np.float64)


def baseline_vector(time: np.ndarray, event: np.ndarray, risk: np.ndarray, grid: np.ndarray
                    ) -> np.ndarray:
    """``[events per grid time, sum of exp(risk) over the patients with time >= t per grid time]``
    (the ``baseline`` reply; Breslow's sums)."""
    time = np.asarray(time, np.float64)
    weight = np.exp(np.asarray(risk, np.float64))
    if weight.shape != time.shape or not np.all(np.isfinite(weight)):
        raise ConfigError(f"The model's risk must be one finite number per patient. Received: "
                          f"{weight.shape} values for {time.shape} patients, "
                          f"{int(np.sum(~np.isfinite(weight)))} not finite")
    order = np.argsort(time, kind="stable")
    tail = np.concatenate([np.cumsum(weight[order][::-1])[::-1], [0.0]])
    start = np.searchsorted(time[order], np.asarray(grid, np.float64), side="left")
    _, events = km_counts(time, event, grid)
    return np.concatenate([events.astype(np.float64), tail[start]])


def _model(record: dict[str, Any], arrays: ArrayRecord, context: Context, cfg: RunConfig,
           data_kind: str) -> Any:
    """The kept model, rebuilt with this hospital's recipe (it must be the federation's)."""
    spec = ModelSpec.from_id(str(record["model-id"]))
    recipe = effective_recipe(NodeConfig.from_flower(context.node_config), cfg, data_kind)
    model = build_model(spec, recipe=recipe, strict=True)
    model.load_state_dict(arrays_to_state_dict({k: a.numpy() for k, a in arrays.items()},
                                               like=model.state_dict()))
    return model


def cox_covariates(x: np.ndarray, schema_json: str) -> np.ndarray:
    """The Cox model's covariates of encoded rows (`protocol.survival.cox_columns`: a text
    column's reference category left out), float64; missing values stay NaN."""
    _, keep, _ = sv.cox_columns(Schema.from_json(schema_json))
    return np.asarray(x, np.float64).reshape(len(x), -1)[:, keep]


def moments_vector(x: np.ndarray, event: np.ndarray) -> np.ndarray:
    """``[rows, events, per covariate: count of values, sum, sum of squares]`` (NaN skipped)."""
    seen = ~np.isnan(x)
    filled = np.where(seen, x, 0.0)
    return np.concatenate([[len(x), int(np.sum(event))], seen.sum(axis=0), filled.sum(axis=0),
                           (filled**2).sum(axis=0)])


def standardized(x: np.ndarray, record: dict[str, Any]) -> tuple[np.ndarray, np.ndarray]:
    """(standardized covariates with a missing value at 0, as the model's ``Standardize``
    layer; the broadcast coefficients)."""
    mean, std = np.asarray(record["mean"], np.float64), np.asarray(record["std"], np.float64)
    beta = np.asarray(record["beta"], np.float64)
    if not len(beta) == len(mean) == len(std) == x.shape[1]:
        raise ConfigError(f"The exact Cox fit broadcast {len(beta)} coefficients; this hospital "
                          f"has {x.shape[1]} covariates under the agreed schema. Received: "
                          f"{len(beta)}/{len(mean)}/{len(std)}")
    return np.nan_to_num((x - mean) / std, nan=0.0), beta


def site_rows(site: Any, rows: str) -> tuple[np.ndarray, np.ndarray]:
    """(x, y) of a hospital's training rows (``train``: less its validation rows; ``all``)."""
    if rows not in ss.SUMMARY_ROWS:
        raise ConfigError(f"A survival summary instruction names its rows, one of "
                          f"{ss.SUMMARY_ROWS}. Received: {rows!r}")
    if rows == "train":
        return site.train.x, site.train.y
    return (np.concatenate([site.train.x, site.val.x]),
            np.concatenate([site.train.y, site.val.y]))


def exact_vector(stage: str, record: dict[str, Any], site: Any) -> np.ndarray:
    """The exact Cox fit's stages (`protocol.survival_summary`) on all of the hospital's rows:
    moments, Newton parts, pair counts."""
    x, y = site_rows(site, "all")
    time, event = survival_rows(y, f"Hospital {site.name}")
    x = cox_covariates(x, str(record["schema"]))
    if stage == "moments":
        return moments_vector(x, event)
    z, beta = standardized(x, record)
    if stage == "newton":
        parts = efron_parts(z, time, event, beta)
        return np.concatenate([[parts.loglik], parts.gradient, triangle(parts.hessian)])
    return np.asarray([*concordance_counts(time, event, z @ beta), len(time)], dtype=np.float64)


def stage_vector(stage: str, record: dict[str, Any], arrays: ArrayRecord | None,
                 context: Context, cfg: RunConfig) -> tuple[str, np.ndarray]:
    """(this hospital's name, its vector for ``stage``)."""
    site = load_site(NodeConfig.from_flower(context.node_config), context.node_id, cfg,
                     str(record["schema"]))
    if stage in ("moments", "newton", "concordance"):
        return site.name, exact_vector(stage, record, site)
    x, y = site_rows(site, str(record["rows"]))
    time, event = survival_rows(y, f"Hospital {site.name}")
    if stage == "km-times":
        return site.name, np.unique(time[event])
    grid = np.asarray(record["grid"], np.float64)
    if stage == "km-counts":
        return site.name, km_vector(time, event, grid)
    if arrays is None:
        raise ConfigError(f"A baseline instruction carries the model (array record "
                          f"{ss.MODEL!r}). Received: none")
    model = _model(record, arrays, context, cfg, site.train.kind)
    risk = recipe_of(model).predict(model, x).get("risk")
    if risk is None:
        raise ConfigError(f"The baseline needs a survival model, whose predict gives 'risk' (the "
                          f"log relative hazard). Received: model {str(record['model-id'])[:120]}")
    return site.name, baseline_vector(time, event, np.asarray(risk).reshape(-1), grid)


def answer(msg: Message, context: Context) -> Message:
    """One summary stage's reply: the vector in the clear, or masked under secure aggregation."""
    content = msg.content
    collect = take_secure_record(content) if pv.SECAGG in content.config_records else None
    keys = set(content.keys())
    if sv.RECORD not in content.config_records or not keys <= {sv.RECORD, ss.MODEL}:
        raise ConfigError(f"A survival summary instruction holds the config record {sv.RECORD!r} "
                          f"(the baseline also the array record {ss.MODEL!r}, and {pv.SECAGG!r} "
                          f"under secure aggregation). Received: {sorted(keys)}")
    record = dict(content.config_records[sv.RECORD])
    stage = ss.check_instruction(record)
    arrays = content.array_records.get(ss.MODEL)
    if (arrays is not None) != (stage == "baseline"):
        raise ConfigError(f"Only the baseline stage carries the model. Received: stage {stage} "
                          f"{'with' if arrays is not None else 'without'} it")
    cfg = RunConfig.from_flower(context.run_config)
    name, vector = stage_vector(stage, record, arrays, context, cfg)
    site = ConfigRecord({"name": name})
    if collect is None:
        return Message(RecordDict({sv.SUMS: ArrayRecord({"vector": Array(vector)}), sv.SITE: site}),
                       reply_to=msg)
    if stage not in ss.STAGE_BITS:
        raise ConfigError(f"Stage {stage} is not a secure sum (its times are shared in the clear). "
                          f"Received: {stage}")
    parties = max(len(cfg.names), cfg.min_nodes)
    try:
        encoded = sv.encode_fixed(vector, parties, ss.STAGE_BITS[stage])
    except ConfigError as e:
        raise ConfigError(f"Hospital {name}: its {stage} sums do not fit the secure sum's "
                          f"fixed-point range (a patient with an extreme risk score makes "
                          f"exp(risk) huge). {e}") from e
    masked = secagg.masked_vector(context, collect, encoded)
    return Message(RecordDict({pv.MASKED: ArrayRecord({"vector": Array(masked)}), sv.SITE: site}),
                   reply_to=msg)
