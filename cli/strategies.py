"""``fedsplit strategies``: list aggregation strategies and their parameters."""

from __future__ import annotations

from rich.console import Console
from rich.table import Table

from fedsplit import aggregation


def strategies() -> None:
    """List the aggregation strategies and every parameter they take."""
    table = Table(title="Aggregation strategies", show_lines=True)
    table.add_column("strategy", style="bold")
    table.add_column("what it does")
    table.add_column("parameters (--param key=value)")
    for info in aggregation.describe_strategies():
        params = "\n".join(
            f"{p.name} ({p.type}, default {p.default!r}): {p.description}" for p in info.params
        ) or "none"
        table.add_row(info.name, info.summary, params)
    Console().print(table)
