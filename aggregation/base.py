"""The strategy interface every aggregation rule implements, and its result types.

A rule is one class with one hook, `AggregationStrategy.aggregate`, registered with
`aggregation.registry.register`; how to write one is in docs/aggregation.md, "Writing a
strategy" (worked example: `aggregation/geometric_median.py`). Its report is the run record's
own type, `protocol.aggregation_report.AggregationReport` with one `SiteReport` per
update (re-exported here), so what a rule builds is what history.json, the report files, the
admin API and the web view read.
"""

from __future__ import annotations

from abc import ABC, abstractmethod
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any, ClassVar

import numpy as np
from fedsplit.aggregation._blocks import DEFAULT_MEMORY_BUDGET
from fedsplit.aggregation.settings import DEFAULT_SETTINGS, BackendSettings
from fedsplit.protocol.aggregation_report import AggregationReport, SiteReport
from fedsplit.protocol.update import Update, UpdateSource
from pydantic import BaseModel, ConfigDict

__all__ = ["AggregateResult", "AggregationReport", "AggregationStrategy", "SiteReport",
           "StrategyParams"]


class StrategyParams(BaseModel):
    """Base of every strategy's parameter model: unknown keys are refused."""

    model_config = ConfigDict(extra="forbid", frozen=True)


@dataclass
class AggregateResult:
    """The aggregated parameters, the total sample count and the report."""

    arrays: dict[str, np.ndarray]
    num_examples: int
    report: AggregationReport

    def to_update(self, **fields: Any) -> Update:
        """Return the aggregate as an `Update` (e.g. to write a weight file)."""
        return Update(arrays=self.arrays, num_examples=self.num_examples, **fields)


class AggregationStrategy(ABC):
    """A rule that merges several sites' updates into one model.

    Subclasses set `name`, `summary` and `Params` (a `StrategyParams` model whose field
    descriptions are the parameter documentation shown by ``fedsplit strategies``), implement
    the one hook `aggregate`, and override `min_updates` when they need more than one update.
    Construct them through `aggregation.registry.get_strategy`; run them through
    `aggregation.aggregate_updates`, which guards the inputs first.
    """

    name: ClassVar[str]
    summary: ClassVar[str]
    Params: ClassVar[type[StrategyParams]] = StrategyParams
    #: True when `aggregate` reads every value of every update through the block passes
    #: (`aggregation._blocks.BlockReader`, the `aggregation.backend` operations) and
    #: has no side effects: `aggregation.run` then leaves the finite-value check to those
    #: passes (one read of the inputs instead of two) and redoes the round with the full input
    #: scan when they meet a non-finite value. Leave False for rules that read values any
    #: other way or keep state between rounds.
    checks_values_in_pass: ClassVar[bool] = False
    #: True when `aggregate` takes ``distances=True`` and then fills in every report's
    #: ``l2_to_aggregate`` in its own pass (FedAvg); `aggregation.run` asks for it
    fuses_distances: ClassVar[bool] = False
    #: What the rule supports, asked by the privacy wrappers (`server.compose`) instead of name
    #: lists. ``linear``: the aggregate is the count-weighted mean of the updates, a linear
    #: function of them, so one secure sum of count-weighted updates gives it (secure
    #: aggregation) and one hospital moves it by at most its count share (hospital-level DP).
    linear: ClassVar[bool] = False
    #: ``iterative_on_sums``: the aggregate is reached by steps that are each one weighted mean
    #: whose weights every hospital computes alone from its own update and a broadcast point,
    #: so each step can be one secure sum (`iterate_on_sums`). A rule with neither compares the
    #: single updates (median, Krum, ...), which secure aggregation hides.
    iterative_on_sums: ClassVar[bool] = False

    def __init__(self, params: StrategyParams | None = None) -> None:
        self.params = params if params is not None else self.Params()

    def iterate_on_sums(self, step: Any, start: dict[str, np.ndarray]
                        ) -> tuple[dict[str, np.ndarray], dict[str, Any]]:
        """Run the rule's iteration from the secure mean ``start``, each step one secure sum
        (``step(point) -> (objective, next point)``); only rules with `iterative_on_sums`."""
        from fedsplit.aggregation.errors import AggregationError

        raise AggregationError(f"Strategy {self.name} does not iterate on secure sums (its "
                               f"iterative_on_sums is False). Received: {self.name}")

    @abstractmethod
    def aggregate(
        self, updates: Sequence[UpdateSource], *, memory_budget: int = DEFAULT_MEMORY_BUDGET,
        settings: BackendSettings = DEFAULT_SETTINGS,
    ) -> AggregateResult:
        """Merge ``updates`` (same names, shapes and dtypes) into one model.

        Working memory beyond the output stays under ``memory_budget`` bytes (rules that need
        more for even one coordinate refuse with `AggregationError`). The report holds one
        `SiteReport` per update, in order. Every pass over the updates is a call of
        `aggregation.backend` with ``settings`` (default: `BackendSettings()`, the library's
        defaults; `aggregate_updates` passes those of the command or service that started).
        """

    def min_updates(self) -> int:
        """Fewest usable updates this rule (with its parameters) can aggregate."""
        return 1

    def min_updates_reason(self) -> str:
        """Why `min_updates` is what it is and how to lower it (one clause; "" when obvious)."""
        return ""

    def __repr__(self) -> str:
        args = ", ".join(f"{k}={v!r}" for k, v in self.params.model_dump().items())
        return f"{type(self).__name__}({args})"
