"""Aggregation errors (the `protocol.errors.FedsplitError` tree's aggregation branch).

    FedsplitError
    └── AggregationError                exit code 5 (defined in protocol.errors: the exit-code table)
        ├── IncompatibleUpdatesError    updates disagree on names, shapes or dtypes
        ├── NotEnoughUpdatesError       too few usable updates for the strategy
        ├── UnknownStrategyError        no strategy registered under that name
        └── StrategyParamsError         a strategy parameter is missing, unknown or out of range
"""

from __future__ import annotations

from fedsplit.protocol.errors import AggregationError

__all__ = [
    "AggregationError",
    "IncompatibleUpdatesError",
    "NotEnoughUpdatesError",
    "StrategyParamsError",
    "UnknownStrategyError",
]


class IncompatibleUpdatesError(AggregationError, ValueError):
    """Updates do not share parameter names, shapes and dtypes."""


class NotEnoughUpdatesError(AggregationError, ValueError):
    """Too few usable updates for the strategy."""


class UnknownStrategyError(AggregationError, KeyError):
    """No strategy is registered under the requested name."""

    def __str__(self) -> str:  # KeyError would quote the message
        return str(self.args[0])


class StrategyParamsError(AggregationError, ValueError):
    """A strategy parameter is invalid."""
