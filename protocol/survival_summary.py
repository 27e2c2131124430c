"""The survival summary after `fedsplit simulate --task survival` trains a Cox risk model: the
messages of its two sum exchanges and the baseline file `fedsplit predict --times` reads
(docs/survival.md, "After training: the curve and the baseline").

After the last round the coordinator asks every hospital, on the run's own Flower grid
(message type `protocol.survival.QUERY`, one config record `protocol.survival.RECORD` with the
stage and its inputs, as `fedsplit km`):

- ``km-times``: the hospital's distinct event times (in the clear: the grid);
- ``km-counts``: ``[rows, at risk per grid time, events per grid time]`` (summed);
- ``baseline``: with the kept model (array record `MODEL`, its id ``model-id``):
  ``[events per grid time, sum of exp(risk) over the patients at risk per grid time]``
  (summed), ``risk`` the model's log relative hazard of each of its training rows.

Each names the ``rows`` it sums (`SUMMARY_ROWS`): the rows the model was trained on.

When the linear Cox model is fitted exactly (`protocol.survival_exact`), the coordinator first
runs, on the same grid and in place of training rounds, the stages of `fedsplit cox` on all of
each hospital's rows (no round is picked, so none are held out for validation; covariates:
`protocol.survival.cox_columns` of the schema; a missing value counts as the column's mean, as
the model's ``Standardize`` layer does):

- ``moments``: ``[rows, events, per covariate: count of values, sum, sum of squares]``;
- ``newton``: at the broadcast standardized coefficients, ``[log partial likelihood, gradient,
  Hessian's upper triangle]`` of the hospital's stratum (Efron ties);
- ``concordance``: ``[concordant, tied, comparable, rows]``: patient pairs at the coefficients,
  and the number of rows.

Every stage carries the agreed ``schema`` (JSON) with which the hospital encodes its rows, as in
training. Under secure aggregation the summed stages travel as SecAgg+ sums in fixed point
(`STAGE_BITS` fraction bits; `protocol.survival.encode_fixed`).

The baseline file (``global.baseline.json`` beside ``global.h5``, `baseline_path`) holds the
pooled Breslow cumulative hazard ``H0`` at the published times (after the minimum-count rule)
and the sha256 of the model file it belongs to; `Baseline.survival` gives
``S(t | x) = exp(-H0(t) exp(risk(x)))`` with ``H0`` a step function: 0 before the first
published time; a time beyond the last published one is refused (nothing is known there).
"""

from __future__ import annotations

import hashlib
import json
import math
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import numpy as np
from fedsplit.protocol import survival
from fedsplit.protocol.errors import ConfigError

#: stages -> the instruction keys each carries (besides "stage")
STAGES: dict[str, frozenset[str]] = {
    "km-times": frozenset({"schema", "rows"}),
    "km-counts": frozenset({"schema", "grid", "rows"}),
    "baseline": frozenset({"schema", "grid", "model-id", "rows"}),
    # the exact linear Cox fit (`protocol.survival_exact`), on all of a hospital's rows
    "moments": frozenset({"schema"}),
    "newton": frozenset({"schema", "mean", "std", "beta"}),
    "concordance": frozenset({"schema", "mean", "std", "beta"}),
}
#: fixed-point fraction bits of each summed stage under secure aggregation (0: integer counts)
STAGE_BITS = {"km-counts": 0, "baseline": 32, "moments": 16, "newton": 32, "concordance": 0}
#: the rows the summary's stages use (``rows``): the model's training rows, which are the
#: hospital's rows less its validation rows ("train"), or all of them after an exact fit ("all")
SUMMARY_ROWS = ("train", "all")
#: the array record of a ``baseline`` instruction: the kept model's arrays
MODEL = "model"
FORMAT = "fedsplit.baseline"
FORMAT_VERSION = 1
KM_FILE = "km.json"


def check_instruction(record: Mapping[str, Any]) -> str:
    """The stage of a summary instruction's config record; unknown stages and keys are refused."""
    return survival.check_instruction(record, STAGES, "survival summary")


def breslow_increments(events: np.ndarray, risk_sums: np.ndarray) -> np.ndarray:
    """Breslow's hazard jump ``d_i / sum_{j at risk at t_i} exp(risk_j)`` per grid time (0 where
    no event); events where nobody is at risk are refused (inconsistent sums)."""
    d = np.asarray(events, np.float64)
    s = np.asarray(risk_sums, np.float64)
    if d.shape != s.shape or np.any(d < 0) or np.any((d > 0) & ~(s > 0)):
        raise ConfigError("Breslow sums must give a positive sum of exp(risk) wherever an event "
                          f"is counted. Received: {int(np.sum((d > 0) & ~(s > 0)))} time(s) with "
                          f"events but no risk sum")
    with np.errstate(divide="ignore", invalid="ignore"):
        return np.where(d > 0, d / np.where(s > 0, s, 1.0), 0.0)


def file_sha256(path: Path) -> str:
    """sha256 (hex) of a file's bytes: names the model a baseline belongs to."""
    digest = hashlib.sha256()
    with open(path, "rb") as f:
        for block in iter(lambda: f.read(1 << 20), b""):
            digest.update(block)
    return digest.hexdigest()


def baseline_path(model_path: Path) -> Path:
    """Where the baseline of ``model_path`` lives: ``global.h5`` -> ``global.baseline.json``."""
    model_path = Path(model_path)
    return model_path.with_name(model_path.stem + ".baseline.json")


@dataclass(frozen=True)
class Baseline:
    """The pooled Breslow cumulative hazard of one model file (the module docstring)."""

    model_sha256: str
    times: tuple[float, ...]
    cumulative_hazard: tuple[float, ...]
    min_count: int
    rows: int
    events: int
    #: the kept model's file name and id, the hospitals, the estimator in words, the secure
    #: aggregation spec and what each hospital shared (the coordinator's account of the fit)
    model: str | None = None
    model_id: str | None = None
    hospitals: tuple[str, ...] = ()
    estimator: str | None = None
    secure_aggregation: str | None = None
    shared: str | None = None

    def __post_init__(self) -> None:
        t = np.asarray(self.times, np.float64)
        h = np.asarray(self.cumulative_hazard, np.float64)
        if (len(t) != len(h) or not len(t) or not np.all(np.isfinite(t)) or np.any(t <= 0)
                or np.any(np.diff(t) <= 0) or not np.all(np.isfinite(h)) or np.any(h < 0)
                or np.any(np.diff(h) < 0)):
            raise ConfigError("A baseline holds increasing positive times and a non-decreasing "
                              "cumulative hazard >= 0, one value per time. Received: "
                              f"{len(t)} times, {len(h)} values")

    def to_json(self) -> dict[str, Any]:
        """The file's document."""
        account = {"model": self.model, "model_id": self.model_id,
                   "hospitals": list(self.hospitals) or None, "estimator": self.estimator,
                   "secure_aggregation": self.secure_aggregation, "shared": self.shared}
        return {"format": FORMAT, "format_version": FORMAT_VERSION,
                "model_sha256": self.model_sha256, "time": list(self.times),
                "cumulative_hazard": list(self.cumulative_hazard), "min_count": self.min_count,
                "rows": self.rows, "events": self.events,
                **{k: v for k, v in account.items() if v is not None}}

    @classmethod
    def from_json(cls, doc: Mapping[str, Any], where: str) -> Baseline:
        """Read the document back; anything else is refused naming ``where``."""
        if doc.get("format") != FORMAT or doc.get("format_version") != FORMAT_VERSION:
            raise ConfigError(f"{where} is not a fedsplit baseline file (format {FORMAT!r} "
                              f"version {FORMAT_VERSION}). Received: format="
                              f"{doc.get('format')!r}, version={doc.get('format_version')!r}")
        def text(key: str) -> str | None:
            return None if doc.get(key) is None else str(doc[key])

        try:
            return cls(str(doc["model_sha256"]), tuple(float(v) for v in doc["time"]),
                       tuple(float(v) for v in doc["cumulative_hazard"]), int(doc["min_count"]),
                       int(doc["rows"]), int(doc["events"]), model=text("model"),
                       model_id=text("model_id"),
                       hospitals=tuple(str(h) for h in doc.get("hospitals") or ()),
                       estimator=text("estimator"),
                       secure_aggregation=text("secure_aggregation"), shared=text("shared"))
        except (KeyError, TypeError, ValueError) as e:
            raise ConfigError(f"{where} lacks or garbles a baseline field ({e}). Received: keys "
                              f"{sorted(doc)}") from e

    @classmethod
    def load(cls, path: Path) -> Baseline:
        """Read a baseline file."""
        try:
            doc = json.loads(Path(path).read_text())
        except (OSError, ValueError) as e:
            raise ConfigError(f"Cannot read the baseline file {path} ({e}). Received: {path}"
                              ) from e
        if not isinstance(doc, dict):
            raise ConfigError(f"{path} is not a fedsplit baseline file. Received: "
                              f"{type(doc).__name__}")
        return cls.from_json(doc, str(path))

    def check_model(self, model_path: Path, where: str) -> None:
        """Refuse a model file other than the one this baseline was computed for."""
        have = file_sha256(model_path)
        if have != self.model_sha256:
            raise ConfigError(f"{where} was computed for another model file (sha256 "
                              f"{self.model_sha256[:16]}...) than {model_path} (sha256 "
                              f"{have[:16]}...); a baseline belongs to exactly one model. Use "
                              f"the baseline written beside that model by its run. Received: "
                              f"{model_path}")

    def hazard_at(self, times: Sequence[float]) -> np.ndarray:
        """``H0`` at each time (step function: 0 before the first published time); a time past
        the last published one is refused."""
        t = np.asarray(times, np.float64)
        last = self.times[-1]
        beyond = [float(v) for v in t if v > last]
        if beyond:
            raise ConfigError(f"The baseline ends at time {last:g} (its last published point: "
                              f"past it too few patients remain at risk, or no event is known), "
                              f"so survival at {', '.join(f'{v:g}' for v in beyond)} cannot be "
                              f"estimated. Ask for times up to {last:g}. Received: --times "
                              f"{','.join(f'{v:g}' for v in t)}")
        at = np.searchsorted(np.asarray(self.times), t, side="right")
        hazard = np.concatenate([[0.0], np.asarray(self.cumulative_hazard)])
        return hazard[at]

    def survival(self, risk: np.ndarray, times: Sequence[float]) -> np.ndarray:
        """``S(t | x) = exp(-H0(t) exp(risk))``, patients x times."""
        h0 = self.hazard_at(times)
        return np.exp(-np.outer(np.exp(np.asarray(risk, np.float64)), h0))


def parse_times(text: str) -> list[float]:
    """``--times 365,730`` as positive finite numbers, distinct; anything else is refused."""
    parts = [p.strip() for p in str(text).split(",")]
    out: list[float] = []
    for part in parts:
        try:
            value = float(part)
        except ValueError:
            value = math.nan
        if not math.isfinite(value) or value <= 0:
            raise ConfigError(f"--times takes positive numbers (in the training data's time "
                              f"unit), comma-separated, e.g. --times 365,730. Received: {text!r} "
                              f"({part!r} is not a positive number)")
        if value in out:
            raise ConfigError(f"--times lists {part} twice; give each time once. "
                              f"Received: {text!r}")
        out.append(value)
    return out


def survival_column(time: float) -> str:
    """The output column of one time: ``survival_at_365``."""
    return f"survival_at_{time:g}"
