"""Survival data contract: the time and event columns of a hospital's table, and the numbers the
survival paths move (docs/survival.md).

The time and event columns are read by `protocol.survival_rows` (`read_survival`,
`check_hospitals`: refused with counts per hospital and the fix, never dropped); its names are
importable from here too.

Secure sums (`encode_fixed` / `decode_fixed`): the Cox path's gradients, Hessians and
log-likelihoods are real numbers that must sum exactly enough to reproduce a pooled fit to
1e-5; they travel under SecAgg+ as fixed-point integers ``round(v * 2^FRACTION_BITS)`` modulo
``2^62`` (Kaplan-Meier counts are integers and travel as they are). The rounding moves a value by
at most ``2^-33`` (about 1e-10); the sum is exact while its magnitude stays below
``2^61 / 2^FRACTION_BITS`` (2^29, checked at each hospital against its share).
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any

import numpy as np
from fedsplit.protocol.config import parse_min_count
from fedsplit.protocol.errors import ConfigError
from fedsplit.protocol.survival_rows import (  # noqa: F401 (re-exported: the reading names)
    EVENT_FALSE,
    EVENT_TRUE,
    MISSING,
    SURVIVAL,
    SurvivalDataError,
    SurvivalProblems,
    check_columns,
    check_hospitals,
    inspect_survival,
    read_survival,
)

#: Fixed-point fraction bits of a real value in a secure sum (see the module docstring).
FRACTION_BITS = 32
MODULUS = 1 << 62
_LOW = np.int64(MODULUS - 1)


# --- fixed-point secure sums ----------------------------------------------------------------
def fixed_limit(parties: int, bits: int = FRACTION_BITS) -> float:
    """The largest |value| one of ``parties`` hospitals may send so that the sum cannot wrap."""
    return float(2.0 ** (61 - bits)) / max(parties, 1)


def encode_fixed(values: np.ndarray, parties: int, bits: int = FRACTION_BITS) -> np.ndarray:
    """``round(values * 2^bits)`` as int64 in ``[0, 2^62)`` (two's complement modulo 2^62)."""
    values = np.asarray(values, dtype=np.float64).reshape(-1)
    limit = fixed_limit(parties, bits)
    if not np.all(np.isfinite(values)) or (values.size and float(np.abs(values).max()) > limit):
        top = float(np.abs(values).max()) if values.size else 0.0
        raise ConfigError(f"A value to sum securely is not finite or exceeds {limit:.4g} (the "
                          f"fixed-point range for {parties} hospitals). Standardized covariates "
                          f"keep it small; check for extreme values. Received: max |value| {top:.4g}")
    scaled = np.rint(values * float(1 << bits)).astype(np.int64)
    return scaled & _LOW


def decode_fixed(total: np.ndarray, bits: int = FRACTION_BITS) -> np.ndarray:
    """The signed sum of `encode_fixed` vectors (summed modulo 2^62), as float64."""
    total = np.asarray(total, dtype=np.int64) & _LOW
    signed = np.where(total >= (1 << 61), total - np.int64(MODULUS), total)
    return signed.astype(np.float64) / float(1 << bits)


# --- the survival Flower app's run config and messages --------------------------------------
#: Message type of every survival exchange (after the schema exchange, ``query.schema``).
QUERY = "query.survival"
RECORD = "survival"  # config record of an instruction: its stage and inputs
SUMS = "sums"  # array record of a plain reply: one float64 vector ("vector")
SITE = "site"  # config record of a reply: the hospital's name
#: stages -> the instruction keys each carries (besides "stage")
STAGES: dict[str, frozenset[str]] = {
    "moments": frozenset({"schema"}),
    "newton": frozenset({"schema", "mean", "std", "beta"}),
    "concordance": frozenset({"schema", "mean", "std", "beta"}),
    "km-times": frozenset(),
    "km-counts": frozenset({"grid"}),
}
#: fixed-point fraction bits of each stage's secure sum (0: integer counts)
STAGE_BITS = {"moments": 16, "newton": FRACTION_BITS, "concordance": 0, "km-counts": 0}
MODES = ("cox", "km")


def check_instruction(record: Mapping[str, Any],
                      stages: Mapping[str, frozenset[str]] | None = None,
                      what: str = "survival") -> str:
    """The stage of an instruction's config record (``stages``: stage -> its keys besides
    ``stage``; default the survival paths' `STAGES`); refuses unknown stages and keys."""
    stages = STAGES if stages is None else stages
    stage = str(record.get("stage", ""))
    if stage not in stages:
        raise ConfigError(f"Unknown {what} stage; expected one of {sorted(stages)}. "
                          f"Received: {stage!r}")
    keys = set(record) - {"stage"}
    if keys != stages[stage]:
        raise ConfigError(f"A {what} {stage} instruction holds exactly {sorted(stages[stage])}. "
                          f"Received: {sorted(keys)}")
    return stage


@dataclass(frozen=True)
class SurvivalRun:
    """The survival app's run config (`to_flower` / `from_flower`: Flower's run config)."""

    mode: str
    time: str
    event: str
    out_dir: str
    data_dir: str = ""
    id_column: str = ""
    ignore_columns: tuple[str, ...] = ()
    na_values: tuple[str, ...] = ()
    penalizer: float = 0.0
    secure_aggregation: str = ""
    min_count: int = 5
    site_names: tuple[str, ...] = ()
    min_nodes: int = 2
    round_timeout: float = 300.0
    max_rounds: int = 15

    def __post_init__(self) -> None:
        if self.mode not in MODES:
            raise ConfigError(f"Survival mode is one of {MODES}. Received: {self.mode!r}")
        if not self.penalizer >= 0 or not np.isfinite(self.penalizer):
            raise ConfigError(f"--penalizer is a finite number >= 0 (lifelines' convention). "
                              f"Received: {self.penalizer}")
        parse_min_count(self.min_count)  # read as RunConfig.min_count is: a whole number >= 1
        if not 1 <= self.max_rounds <= 50:
            raise ConfigError(f"Newton rounds lie in [1, 50]. Received: {self.max_rounds}")
        from fedsplit.protocol.privacy import SecureSpec

        SecureSpec.parse(self.secure_aggregation)  # a bad spec is refused before anything runs

    def to_flower(self) -> dict[str, Any]:
        """Flower run config (lists as JSON text)."""
        import json

        return {"mode": self.mode, "time": self.time, "event": self.event,
                "out-dir": self.out_dir, "data-dir": self.data_dir, "id-column": self.id_column,
                "ignore-columns": json.dumps(list(self.ignore_columns)),
                "na-values": json.dumps(list(self.na_values)), "penalizer": float(self.penalizer),
                "secure-aggregation": self.secure_aggregation, "min-count": int(self.min_count),
                "site-names": json.dumps(list(self.site_names)), "min-nodes": int(self.min_nodes),
                "round-timeout": float(self.round_timeout), "max-rounds": int(self.max_rounds)}

    @classmethod
    def from_flower(cls, config: Mapping[str, Any]) -> SurvivalRun:
        """Read it back from Flower's run config."""
        import json

        try:
            return cls(mode=str(config["mode"]), time=str(config["time"]),
                       event=str(config["event"]), out_dir=str(config["out-dir"]),
                       data_dir=str(config["data-dir"]), id_column=str(config["id-column"]),
                       ignore_columns=tuple(json.loads(str(config["ignore-columns"]))),
                       na_values=tuple(json.loads(str(config["na-values"]))),
                       penalizer=float(config["penalizer"]),
                       secure_aggregation=str(config["secure-aggregation"]),
                       min_count=parse_min_count(config["min-count"]),
                       site_names=tuple(json.loads(str(config["site-names"]))),
                       min_nodes=int(config["min-nodes"]),
                       round_timeout=float(config["round-timeout"]),
                       max_rounds=int(config["max-rounds"]))
        except (KeyError, ValueError, TypeError) as e:
            raise ConfigError(f"Not a fedsplit survival run config: {e}. Received: "
                              f"{sorted(config)}") from e


#: The survival recipe's evaluation also reports its concordance pair counts per evaluated row,
#: so that the federation's count-weighted mean of them is the pooled counts over N rows and
#: their ratio Harrell's C over the hospitals' summed pairs (each hospital's own pairs; no
#: pair across hospitals): the round-selection score, steadier than a mean of per-hospital
#: C-indices that each rest on a few validation events.
CONCORDANT_RATE = "c_concordant_rate"  # (concordant + tied / 2) / rows
PAIRS_RATE = "c_pairs_rate"  # comparable pairs / rows


def pair_rates(concordant: float, tied: float, pairs: float, rows: int) -> dict[str, float]:
    """The two per-row pair-count metrics of one hospital's evaluation."""
    rows = max(int(rows), 1)
    return {CONCORDANT_RATE: (concordant + 0.5 * tied) / rows, PAIRS_RATE: pairs / rows}


def pooled_concordance(metrics: Mapping[str, Any]) -> float | None:
    """Harrell's C over the hospitals' summed pairs, from the weighted mean of `pair_rates`;
    None when they are absent, or no pair is comparable (e.g. no event)."""
    conc, pairs = metrics.get(CONCORDANT_RATE), metrics.get(PAIRS_RATE)
    if not isinstance(conc, int | float) or not isinstance(pairs, int | float) or pairs <= 0:
        return None
    return float(conc) / float(pairs)


def table_settings(run: SurvivalRun) -> Any:
    """How a hospital reads its table for the schema exchange: the time column is the target,
    the event column is set aside (never a covariate)."""
    from fedsplit.protocol.schema import TableSettings

    return TableSettings(target=run.time, id_column=run.id_column,
                         ignore_columns=(run.event, *run.ignore_columns), na_values=run.na_values)


def cox_columns(schema: Any) -> tuple[list[str], list[int], dict[str, str]]:
    """(covariate names, their positions among the schema's encoded features, reference
    category per text column). A text column's first category is its reference and has no
    coefficient: with all of its one-hot columns a Cox model would be collinear."""
    names, keep, references = [], [], {}
    at = 0
    for col in schema.columns:
        encoded = col.encoded_names()
        drop = 0 if col.kind == "categorical" and col.categories else None
        if drop is not None:
            references[col.name] = col.categories[0]
        for j, name in enumerate(encoded):
            if j != drop:
                names.append(name)
                keep.append(at + j)
        at += len(encoded)
    return names, keep, references
