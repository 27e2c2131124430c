"""What aggregation rules share besides the backend's operations: checked inputs, report rows.

A rule's `aggregate` is usually::

    inputs = inputs_of(self, updates)                     # count, layout, min_updates checked
    mean = backend.weighted_sum(updates, weights, settings=settings, memory_budget=memory_budget)
    dist = backend.squared_distances(updates, mean.arrays, settings=settings,
                                     memory_budget=memory_budget)
    sites = site_reports(inputs.headers, shares, l2_to_aggregate=dist.values)
    return make_result(self, inputs, mean.arrays, sites, memory_budget=memory_budget,
                       working_bytes=max(mean.working_bytes, dist.working_bytes))

The arithmetic over the updates is the backend's (`aggregation.backend`: which implementation
runs, numpy, compiled kernels or the GPU, is chosen there, never by a rule).
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

import numpy as np
from fedsplit.aggregation._interface import OrderPass
from fedsplit.aggregation.base import AggregateResult, AggregationStrategy
from fedsplit.aggregation.compat import check_compatible
from fedsplit.aggregation.errors import AggregationError, NotEnoughUpdatesError
from fedsplit.protocol.aggregation_report import AggregationReport, SiteReport
from fedsplit.protocol.arrays import ArraySpec
from fedsplit.protocol.update import UpdateHeader, UpdateSource

# --------------------------------------------------------------------------------------------
# Inputs


@dataclass(frozen=True)
class Inputs:
    """The updates' headers, their shared layout and their sample counts."""

    headers: list[UpdateHeader]
    specs: tuple[ArraySpec, ...]
    counts: np.ndarray  # int64, one per update

    @property
    def total(self) -> int:
        """Sum of the sample counts."""
        return int(self.counts.sum())


def require_updates(strategy: AggregationStrategy, available: int, context: str = "") -> None:
    """Raise `NotEnoughUpdatesError` when ``available`` is below ``strategy.min_updates()``.

    ``context`` (e.g. which updates the input checks excluded) is added to the message.
    """
    need = strategy.min_updates()
    if available >= need:
        return
    why = strategy.min_updates_reason()
    raise NotEnoughUpdatesError(
        f"Strategy {strategy.name!r} needs at least {need} usable update"
        f"{'s' if need != 1 else ''}{f' ({why})' if why else ''}. Send more sites' updates"
        f"{' or change its parameters' if why else ''}.{f' {context}' if context else ''} "
        f"Received: {available} updates"
    )


def inputs_of(strategy: AggregationStrategy, updates: Sequence[UpdateSource]) -> Inputs:
    """Check there are enough updates and that they share one layout; return their headers."""
    require_updates(strategy, len(updates))
    headers = [u.header for u in updates]
    check_compatible(headers)
    counts = np.array([h.num_examples for h in headers], dtype=np.int64)
    return Inputs(headers=headers, specs=tuple(headers[0].specs), counts=counts)


def shares_of(weights: Sequence[float] | np.ndarray, num_updates: int) -> np.ndarray:
    """Normalise non-negative ``weights`` (one per update) to shares summing to 1 (float64)."""
    w = np.asarray(weights, dtype=np.float64)
    if w.shape != (num_updates,) or not np.all(np.isfinite(w)) or np.any(w < 0) or w.sum() <= 0:
        raise AggregationError(
            f"A weighted mean needs one finite, non-negative weight per update ({num_updates}), "
            f"not all zero. Received: {np.asarray(weights).tolist()}"
        )
    return w / w.sum()



# --------------------------------------------------------------------------------------------
# Report rows


def _plain(value: Any) -> Any:
    """numpy scalars as Python ones, so the report is JSON as it stands."""
    return value.item() if isinstance(value, np.generic) else value


def site_reports(
    headers: Sequence[UpdateHeader], weights: Sequence[float] | np.ndarray, **columns: Any
) -> list[SiteReport]:
    """One `SiteReport` per update: label, count, weight, and the rule's own ``columns``.

    ``weights`` is each update's share of the aggregate; each column (a `SiteReport` field such
    as ``l2_to_aggregate``, ``trimmed_fraction``, ``selected``, ``score`` or ``flags``) holds one
    value per update.
    """
    for name, values in columns.items():
        if len(values) != len(headers):
            raise ValueError(f"column {name!r} has {len(values)} values. Received: {len(headers)}")
    return [
        SiteReport(
            site=h.label,
            num_examples=h.num_examples,
            weight=float(weights[i]),
            **{name: _plain(values[i]) for name, values in columns.items()},
        )
        for i, h in enumerate(headers)
    ]


def make_result(
    strategy: AggregationStrategy,
    inputs: Inputs,
    arrays: dict[str, np.ndarray],
    sites: list[SiteReport],
    *,
    memory_budget: int,
    working_bytes: int | None,
    details: dict[str, Any] | None = None,
) -> AggregateResult:
    """Wrap a rule's aggregate and report rows; ``num_examples`` is the sum of all counts."""
    report = AggregationReport(
        strategy=strategy.name,
        params=strategy.params.model_dump(),
        num_examples=inputs.total,
        sites=sites,
        memory_budget=memory_budget,
        working_bytes=working_bytes,
        details=dict(details or {}),
    )
    return AggregateResult(arrays=arrays, num_examples=inputs.total, report=report)


def order_result(
    strategy: AggregationStrategy,
    inputs: Inputs,
    stat: OrderPass,
    *,
    weighted: bool,
    memory_budget: int,
) -> AggregateResult:
    """The result of an order statistic (median, trimmed mean): each site's share of the
    aggregate (its count share when ``weighted``, else 1/N), how much of it was trimmed
    (and whether it was trimmed most) and its distance to the aggregate."""
    share = stat.dropped
    most = float(share.max())
    n = len(inputs.headers)
    sites = site_reports(
        inputs.headers,
        inputs.counts / inputs.total if weighted else np.full(n, 1.0 / n),
        trimmed_fraction=share,
        trimmed_most=(share == most) & (most > 0),
        l2_to_aggregate=stat.distances,
    )
    return make_result(
        strategy, inputs, stat.arrays, sites,
        memory_budget=memory_budget, working_bytes=stat.working_bytes,
    )
