"""Aggregate feature statistics: the only summary of rows a site shares besides weights.

Sites send per-feature (count, sum, sum of squares) of their training rows; the coordinator
combines them into one mean and standard deviation so every site standardises alike.
"""

from __future__ import annotations

from collections.abc import Sequence

import numpy as np

Moments = tuple[np.ndarray, np.ndarray, np.ndarray]


def moments(x: np.ndarray) -> Moments:
    """Return per-column (count, sum, sum of squares) of a 2-D array, ignoring NaN."""
    x = np.asarray(x, dtype=np.float64)
    finite = ~np.isnan(x)
    xz = np.where(finite, x, 0.0)
    return finite.sum(0).astype(np.float64), xz.sum(0), (xz**2).sum(0)


def combine_moments(parts: Sequence[Moments]) -> tuple[np.ndarray, np.ndarray]:
    """Combine sites' moments into the pooled mean and (population) standard deviation."""
    count = np.sum([np.asarray(p[0], dtype=np.float64) for p in parts], axis=0)
    total = np.sum([np.asarray(p[1], dtype=np.float64) for p in parts], axis=0)
    sumsq = np.sum([np.asarray(p[2], dtype=np.float64) for p in parts], axis=0)
    safe = np.maximum(count, 1.0)
    mean = total / safe
    var = np.maximum(sumsq / safe - mean**2, 0.0)
    return mean, np.sqrt(var)
