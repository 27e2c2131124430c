"""Errors shared by every fedsplit package.

Tree (catch at any level)::

    FedsplitError                      exit code 1
    ├── WeightFileError                exit code 2   a weight file is missing, malformed or unsafe
    ├── UpdateError                    exit code 2   an update's arrays or sample count are invalid
    └── ConfigError                    exit code 2   a run configuration value is invalid

`aggregation.errors` adds the aggregation branch. Every message says what was expected,
what to do about it, and ends with ``Received: <value>``.
"""

from __future__ import annotations


class FedsplitError(Exception):
    """Base class of every error fedsplit raises on purpose.

    ``reason`` is a short machine-readable code (``link``, ``non_finite``, ``num_examples``, ...)
    for metrics and API clients; the message is for people.
    """

    exit_code: int = 1
    reason: str | None = None

    def __init__(self, *args: object, reason: str | None = None) -> None:
        super().__init__(*args)
        if reason is not None:
            self.reason = reason


class WeightFileError(FedsplitError, ValueError):
    """A weight file is not a valid, safe fedsplit weight file."""

    exit_code = 2
    reason = "invalid"


class UpdateError(FedsplitError, ValueError):
    """An update (named arrays plus sample count) is invalid."""

    exit_code = 2
    reason = "invalid"


class ConfigError(FedsplitError, ValueError):
    """A run configuration value is invalid."""

    exit_code = 2
