"""``fedsplit aggregate``: merge weight files with a registered strategy."""

from __future__ import annotations

import contextlib
import json
import os
from pathlib import Path
from typing import Annotated

import typer
from rich.console import Console
from rich.table import Table

import aggregation
from aggregation.base import AggregationReport
from protocol import open_weights, write_weights


def print_report(report: AggregationReport, console: Console | None = None) -> None:
    """Print a per-site table of counts and weights."""
    table = Table(title=f"{report.strategy} over {len(report.sites)} update(s)")
    table.add_column("site")
    table.add_column("num_examples", justify="right")
    table.add_column("weight", justify="right")
    table.add_column("note")
    for s in report.sites:
        note = f"excluded: {s.reason}" if s.excluded else (s.reason or "")
        table.add_row(s.site, str(s.num_examples), f"{s.weight:.4f}", note)
    table.add_row("[bold]total[/]", f"[bold]{report.num_examples}[/]", "1.0000", "")
    (console or Console()).print(table)


def aggregate(
    inputs: Annotated[list[Path], typer.Argument(help="Weight files (.h5) to merge.")],
    output: Annotated[Path, typer.Option("-o", "--output", help="Where to write the merged .h5.")],
    strategy: Annotated[str, typer.Option(help="Strategy name (see `fedsplit strategies`).")] = "fedavg",
    param: Annotated[
        list[str] | None, typer.Option("--param", help="Strategy parameter key=value (repeatable).")
    ] = None,
    report_json: Annotated[
        Path | None, typer.Option(help="Also write the aggregation report here as JSON.")
    ] = None,
) -> None:
    """Aggregate weight files; the output's num_examples is the sum of the inputs'."""
    strat = aggregation.get_strategy(strategy, aggregation.parse_param_pairs(param or []))
    with contextlib.ExitStack() as stack:
        files = []
        for path in inputs:
            files.append(stack.enter_context(open_weights(path, default_site=path.stem)))
        result = aggregation.aggregate_updates(strat, files)
        model_ids = {f.header.model for f in files} - {None}
        model = model_ids.pop() if len(model_ids) == 1 else None
    write_weights(result.to_update(model=model, site="aggregate"), output)
    print_report(result.report)
    if report_json is not None:
        tmp = report_json.with_name(f".{report_json.name}.tmp")
        tmp.write_text(json.dumps(result.report.to_dict(), indent=2))
        os.replace(tmp, report_json)
    Console().print(f"wrote {output} (num_examples={result.num_examples})")
