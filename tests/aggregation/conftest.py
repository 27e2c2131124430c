"""Fixtures for the aggregation tests: random updates with controllable layout and values."""

from __future__ import annotations

from types import SimpleNamespace

import numpy as np
import pytest
from fedsplit.protocol import Update

SHAPES = [(3, 4), (5,), (), (2, 3, 2)]


def random_weights(
    rng: np.random.Generator, n: int, dtype: type, *, ties: bool = False, shapes=SHAPES
) -> list[list[np.ndarray]]:
    """n updates, one array per shape; ``ties`` draws small integers so values repeat."""
    out = []
    for k in range(n):
        scale = 1.0 + (k % 3)
        arrays = []
        for s in shapes:
            a = rng.integers(-2, 3, size=s) if ties else rng.standard_normal(s) * scale
            arrays.append(np.asarray(a, dtype=dtype))
        out.append(arrays)
    return out


def as_updates(weights: list[list[np.ndarray]], counts: list[int]) -> list[Update]:
    """Wrap per-update array lists as `Update`s named p0, p1, ... and sites s0, s1, ..."""
    return [
        Update({f"p{i}": a for i, a in enumerate(ws)}, num_examples=int(c), site=f"s{k}")
        for k, (ws, c) in enumerate(zip(weights, counts, strict=True))
    ]


def make_updates(n: int, dtype: type = np.float32, seed: int = 0, shapes=SHAPES) -> list[Update]:
    """n random updates (counts 1..99) with the given layout."""
    rng = np.random.default_rng(seed)
    ws = random_weights(rng, n, dtype, shapes=shapes)
    counts = [int(c) for c in rng.integers(1, 100, size=n)]
    return as_updates(ws, counts)


@pytest.fixture
def h() -> SimpleNamespace:
    """The helpers above (test modules cannot import conftest under importlib mode)."""
    return SimpleNamespace(
        SHAPES=SHAPES,
        random_weights=random_weights,
        as_updates=as_updates,
        make_updates=make_updates,
    )
