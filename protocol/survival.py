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
from typing import Any, Literal

import numpy as np
from fedsplit.protocol.errors import ConfigError
from fedsplit.protocol.run_settings import (
    FederationSettings,
    SecureSettings,
    TableReading,
    problems,
)
from fedsplit.protocol.schema import TableSettings
from fedsplit.protocol.survival_rows import (  # noqa: F401 (re-exported: the reading names)
    EVENT_FALSE,
    EVENT_TRUE,
    MISSING,
    SurvivalDataError,
    SurvivalProblems,
    check_columns,
    check_hospitals,
    inspect_survival,
    read_survival,
)
from pydantic import Field, ValidationError

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


class SurvivalRun(SecureSettings, TableReading, FederationSettings):
    """The survival app's run config (`to_flower` / `from_flower`: Flower's run config): the
    shared table-reading, secure-sum and federation groups (`protocol.run_settings`), and the
    survival columns and fit."""

    mode: Literal["cox", "km"] = Field(description="cox (the exact Cox fit) or km (Kaplan-Meier).")
    time: str = Field(description="The follow-up time column.")
    event: str = Field(description="The event column (1/0, TRUE/FALSE, yes/no).")
    penalizer: float = Field(0.0, ge=0, allow_inf_nan=False,
                             description="The Cox model's ridge penalty (lifelines' convention).")
    max_rounds: int = Field(15, ge=1, le=50, alias="max-rounds", description="Newton rounds.")

    def __init__(self, **values: Any) -> None:
        """Validate ``values`` (field names or run-config keys); a bad one is a `ConfigError`
        naming it."""
        try:
            super().__init__(**values)
        except ValidationError as e:
            raise ConfigError(f"Not a fedsplit survival run config: {problems(type(self), e)}. "
                              f"Received: {sorted(values)}") from e

    @classmethod
    def from_flower(cls, config: Mapping[str, Any]) -> SurvivalRun:
        """Read it back from Flower's run config (earlier runs' JSON list columns too)."""
        return cls(**dict(config))

    def to_flower(self) -> dict[str, Any]:
        """Flower run config: the kebab-case keys."""
        return self.model_dump(by_alias=True)

    @property
    def table_settings(self) -> TableSettings:
        """How a hospital reads its table for the schema exchange: the time column is the target,
        the event column is set aside (never a covariate)."""
        return TableSettings(target=self.time, id_column=self.id_column,
                             ignore_columns=(self.event, *self.ignored),
                             na_values=self.missing_markers,
                             min_category_count=self.min_category_count)


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
