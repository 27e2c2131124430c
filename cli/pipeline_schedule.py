"""``fedsplit pipeline-schedule``: print (and draw) the GPipe tick table of a pipelined site."""

from __future__ import annotations

from pathlib import Path
from typing import TYPE_CHECKING, Annotated

import typer
from rich import box
from rich.console import Console
from rich.table import Table

from protocol.errors import ConfigError

if TYPE_CHECKING:  # importing client.parallel loads torch; only the command needs it
    from client.parallel.schedule import GPipeTable

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


def draw_png(table: GPipeTable, path: Path) -> None:
    """Draw the tick table with matplotlib (Agg backend, no display needed)."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt
    from matplotlib.patches import Rectangle

    ticks = len(table.phases)
    fig, ax = plt.subplots(figsize=(max(6.0, 0.6 * ticks + 1.5), 0.6 * table.stages + 1.6))
    shade = {"fill": "#fff3c4", "steady": "#d9f2d9", "drain": "#f3d9f2"}
    for t, phase in enumerate(table.phases):
        ax.add_patch(Rectangle((t, -0.5), 1, 0.4, color=shade[phase.split()[-1]]))
    for s, row in enumerate(table.cells):
        for t, cell in enumerate(row):
            if not cell:
                continue
            color = "#4c8bd6" if cell.startswith("F") else "#e07b39"
            ax.add_patch(Rectangle((t + 0.05, s + 0.05), 0.9, 0.9, color=color))
            ax.text(t + 0.5, s + 0.5, cell, ha="center", va="center", color="white", fontsize=9)
    ax.set_xlim(0, ticks)
    ax.set_ylim(table.stages, -0.5)
    ax.set_xticks([t + 0.5 for t in range(ticks)], [str(t) for t in range(ticks)])
    ax.set_yticks([s + 0.5 for s in range(table.stages)], [f"stage {s}" for s in range(table.stages)])
    ax.set_xlabel("tick (phase band on top: yellow fill, green steady, pink drain)")
    ax.set_title(f"GPipe {table.stages} x {table.microbatches}: forward {table.forward_ticks} ticks "
                 f"instead of {table.sequential_ticks}, bubble {table.bubble:.0%}")
    fig.tight_layout()
    try:
        fig.savefig(path, dpi=120)
    except OSError as e:
        raise ConfigError(f"Could not write the picture to {path} ({e}); pick a writable path. "
                          f"Received: {path}") from e
    finally:
        plt.close(fig)


def pipeline_schedule(
    stages: Annotated[int, typer.Option("--stages", help="Pipeline stages S (1-64).")] = 3,
    microbatches: Annotated[
        int, typer.Option("--microbatches", help="Micro-batches M per batch (1-64).")
    ] = 3,
    png: Annotated[Path | None, typer.Option("--png", help="Also draw the table to this PNG.")] = None,
) -> None:
    """Print the GPipe tick table of S stages x M micro-batches: fill, steady state, drain."""
    from client.parallel.schedule import gpipe_table

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
        draw_png(table, png)
        console.print(f"wrote {png}")
