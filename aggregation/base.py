"""The strategy interface every aggregation rule implements, and its result types."""

from __future__ import annotations

from abc import ABC, abstractmethod
from collections.abc import Sequence
from dataclasses import asdict, dataclass, field
from typing import Any, ClassVar

import numpy as np
from pydantic import BaseModel, ConfigDict

from protocol.update import Update, UpdateSource


class StrategyParams(BaseModel):
    """Base of every strategy's parameter model: unknown keys are refused."""

    model_config = ConfigDict(extra="forbid", frozen=True)


@dataclass
class SiteReport:
    """How one update took part in an aggregation."""

    site: str
    num_examples: int
    weight: float
    excluded: bool = False
    reason: str | None = None


@dataclass
class AggregationReport:
    """What an aggregation did, per site; saved beside the model as JSON."""

    strategy: str
    params: dict[str, Any]
    num_examples: int
    sites: list[SiteReport] = field(default_factory=list)

    def to_dict(self) -> dict[str, Any]:
        """Return a JSON-friendly dict."""
        return asdict(self)


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
    descriptions are the parameter documentation shown by ``fedsplit strategies``) and
    implement `aggregate`. Construct them through `aggregation.registry.get_strategy`.
    """

    name: ClassVar[str]
    summary: ClassVar[str]
    Params: ClassVar[type[StrategyParams]] = StrategyParams

    def __init__(self, params: StrategyParams | None = None) -> None:
        self.params = params if params is not None else self.Params()

    @abstractmethod
    def aggregate(self, updates: Sequence[UpdateSource]) -> AggregateResult:
        """Merge ``updates`` (same names, shapes and dtypes) into one model."""

    def __repr__(self) -> str:
        args = ", ".join(f"{k}={v!r}" for k, v in self.params.model_dump().items())
        return f"{type(self).__name__}({args})"
