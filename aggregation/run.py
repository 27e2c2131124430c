"""The one entry point every path (Flower, REST, CLI) aggregates through."""

from __future__ import annotations

from collections.abc import Sequence

from aggregation.base import AggregateResult, AggregationStrategy
from aggregation.compat import check_compatible
from protocol.update import UpdateSource


def aggregate_updates(
    strategy: AggregationStrategy, updates: Sequence[UpdateSource]
) -> AggregateResult:
    """Check that ``updates`` fit together, then merge them with ``strategy``."""
    check_compatible([u.header for u in updates])
    return strategy.aggregate(updates)
