"""``fedsplit pipeline-schedule``: print (and draw) the GPipe tick table of a pipelined site."""

from __future__ import annotations

from pathlib import Path
from typing import TYPE_CHECKING, Annotated

import typer
from rich import box
from rich.console import Console
from rich.table import Table

if TYPE_CHECKING:  # importing client.parallel loads torch; only the command needs it
    from fedsplit.client.parallel.schedule import GPipeTable

_PHASE_STYLE = {"fill": "yellow", "steady": "green", "drain": "magenta"}


def render_tables(table: GPipeTable) -> list[Table]:
    """The forward and the backward half as rich tables: a row per stage, a column per tick."""
    half = table.forward_ticks
    out = []
    for name, ticks in (("forward", range(half)), ("backward", range(half, 2 * half))):
        grid = Table(
            title=f"GPipe {name}, S={table.stages} M={table.microbatches}",
            box=box.SIMPLE_HEAD,
            padding=(0, 1),
        )
        grid.add_column("tick", style="bold", no_wrap=True)
        for t in ticks:
            grid.add_column(str(t), justify="center", no_wrap=True)
        for s, row in enumerate(table.cells):
            grid.add_row(f"stage {s}", *(_cell(row[t]) for t in ticks))
        grid.add_row("phase", *(
            f"[{_PHASE_STYLE[p.split()[-1]]}]{p.split()[-1][0]}[/]"
            for p in table.phases[ticks.start : ticks.stop]
        ))
        out.append(grid)
    return out


def _cell(cell: str) -> str:
    if not cell:
        return "[dim].[/]"
    return f"[cyan]{cell}[/]" if cell.startswith("F") else f"[red]{cell}[/]"


def summary_lines(table: GPipeTable) -> list[str]:
    """Forward ticks against one-at-a-time, and the bubble."""
    s, m = table.stages, table.microbatches
    return [
        f"forward: {table.forward_ticks} ticks (S + M - 1 = {s} + {m} - 1) instead of "
        f"{table.sequential_ticks} one micro-batch at a time (S x M = {s} x {m})",
        f"forward + backward: {len(table.phases)} ticks; idle share (bubble) "
        f"(S - 1) / (S + M - 1) = {table.bubble:.0%}",
    ]


def pipeline_schedule(
    stages: Annotated[int, typer.Option("--stages", help="Pipeline stages S (1-64).")] = 3,
    microbatches: Annotated[
        int, typer.Option("--microbatches", help="Micro-batches M per batch (1-64).")
    ] = 3,
    png: Annotated[Path | None, typer.Option("--png", help="Also draw the table to this PNG.")] = None,
) -> None:
    """Print the GPipe tick table of S stages x M micro-batches: fill, steady state, drain."""
    from fedsplit.client.parallel.schedule import gpipe_table
    from fedsplit.orchestration.plots import draw_gpipe

    table = gpipe_table(stages, microbatches)
    console = Console()
    if not console.is_terminal:  # piped or redirected: print wide tables whole
        console = Console(width=max(console.width, 14 + 6 * table.forward_ticks))
    for grid in render_tables(table):
        console.print(grid)
    console.print("F<m>/B<m>: forward/backward of micro-batch m; '.': idle (the bubble); "
                  "phase f: fill, s: steady state, d: drain")
    for line in summary_lines(table):
        console.print(line)
    if png is not None:
        draw_gpipe(table, png)
        console.print(f"wrote {png}")
