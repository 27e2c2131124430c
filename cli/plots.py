"""Per-round plots shared by ``simulate``, ``compare-strategies`` and ``vertical simulate``."""

from __future__ import annotations

import contextlib
from collections.abc import Iterator
from pathlib import Path
from typing import Any

from protocol.atomic import atomic_path


def metric_key(task: str) -> str:
    """The metric plotted and compared: accuracy (classification) or r2 (regression)."""
    return "accuracy" if task == "classification" else "r2"


@contextlib.contextmanager
def round_axes(path: Path, *, ylabel: str, title: str,
               size: tuple[float, float] = (7, 4.2)) -> Iterator[Any]:
    """Yield matplotlib axes to draw on; then label, lay out and save them to ``path`` atomically."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, ax = plt.subplots(figsize=size)
    try:
        yield ax
        ax.set_xlabel("round")
        ax.set_ylabel(ylabel)
        ax.set_title(title)
        ax.grid(alpha=0.3)
        ax.legend(fontsize=8)
        fig.tight_layout()
        with atomic_path(path) as tmp:
            fig.savefig(tmp, dpi=110, format="png")
    finally:
        plt.close(fig)
