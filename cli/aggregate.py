"""``fedsplit aggregate``: merge weight files with a registered strategy.

Every input is checked first (layout, count, cohort cap, finite values); a failing file is
excluded with its reason, not fatal. The per-site report is printed and saved as JSON beside
the output model (``<output>.report.json`` unless ``--report-json`` says otherwise). The work
is `aggregation.files.aggregate_files`, the same flow the admin API aggregates a round with.
"""

from __future__ import annotations

import json
import os
import re
from pathlib import Path
from typing import Annotated

import typer
from fedsplit.aggregation._blocks import DEFAULT_MEMORY_BUDGET
from fedsplit.aggregation.base import AggregationReport
from fedsplit.aggregation.files import aggregate_files
from fedsplit.aggregation.guard import CAP_POLICIES
from fedsplit.cli.app import skip_teardown
from fedsplit.protocol import ConfigError
from rich.console import Console
from rich.table import Table

from fedsplit import aggregation

_UNITS = {"": 1, "B": 1, "K": 1024, "KB": 1024, "KIB": 1024, "M": 1024**2, "MB": 1024**2,
          "MIB": 1024**2, "G": 1024**3, "GB": 1024**3, "GIB": 1024**3}


def parse_bytes(text: str) -> int:
    """Parse ``512MB``, ``1.5G``, ``2048`` (bytes) into bytes; units are binary (MB = MiB)."""
    match = re.fullmatch(r"\s*(\d+(?:\.\d+)?)\s*([A-Za-z]*)\s*", str(text))
    unit = match.group(2).upper() if match else ""
    if not match or unit not in _UNITS or float(match.group(1)) <= 0:
        raise ConfigError(
            f"A memory size is a positive number with an optional unit B, KB, MB or GB "
            f"(binary: 1 MB = 1024 KB), e.g. 512MB. Received: {text!r}"
        )
    return max(1, int(float(match.group(1)) * _UNITS[unit]))


def parse_caps(pairs: list[str], caps_file: Path | None) -> dict[str, int]:
    """Merge ``--cohort-caps FILE`` (JSON object site -> rows) and ``--cohort-cap SITE=N``."""
    caps: dict[str, int] = {}
    if caps_file is not None:
        try:
            loaded = json.loads(caps_file.read_text())
        except (OSError, ValueError) as e:
            raise ConfigError(
                f"--cohort-caps must be a readable JSON object mapping site to its registered "
                f"number of rows, e.g. {{\"h1\": 1200}} ({e}). Received: {caps_file}"
            ) from e
        if not isinstance(loaded, dict):
            raise ConfigError(
                f"--cohort-caps must hold a JSON object (site -> rows). Received: "
                f"{type(loaded).__name__}"
            )
        caps.update({str(k): v for k, v in loaded.items()})
    for pair in pairs:
        site, sep, value = pair.partition("=")
        if not sep or not site.strip() or not value.strip().isdigit():
            raise ConfigError(
                f"--cohort-cap takes SITE=ROWS with ROWS a whole number, e.g. "
                f"--cohort-cap h1=1200. Received: {pair!r}"
            )
        caps[site.strip()] = int(value)
    return caps


def _percent(x: float | None) -> str:
    return "" if x is None else f"{100 * x:.1f}%"


def print_report(report: AggregationReport, console: Console | None = None) -> None:
    """Print the per-site report: count used, weight, status, trimmed share, score, distance."""
    used = [s for s in report.sites if not s.excluded]
    table = Table(title=f"{report.strategy} {report.params or ''} over {len(used)} of "
                        f"{len(report.sites)} update(s)")
    table.add_column("site")
    table.add_column("num_examples", justify="right")
    table.add_column("weight", justify="right")
    show_trim = any(s.trimmed_fraction is not None for s in report.sites)
    show_krum = any(s.selected is not None for s in report.sites)
    if show_trim:
        table.add_column("trimmed", justify="right")
    if show_krum:
        table.add_column("selected")
        table.add_column("krum score", justify="right")
    table.add_column("L2 to aggregate", justify="right")
    table.add_column("note")
    for s in report.sites:
        count = str(s.num_examples)
        if s.claimed_examples is not None:
            count = f"{s.num_examples} (claimed {s.claimed_examples})"
        row = [s.site, count, f"{s.weight:.4f}"]
        if show_trim:
            trimmed = _percent(s.trimmed_fraction)
            row.append(f"{trimmed} most" if s.trimmed_most else trimmed)
        if show_krum:
            row.append("" if s.selected is None else ("yes" if s.selected else "no"))
            row.append("" if s.score is None else f"{s.score:.4g}")
        row.append("" if s.l2_to_aggregate is None else f"{s.l2_to_aggregate:.4g}")
        notes = ["excluded (see below)"] if s.excluded else []
        notes += [f for f in s.flags if not s.excluded]
        row.append("; ".join(notes))
        table.add_row(*row, style="red" if s.excluded else None)
    total_row = ["[bold]total[/]", f"[bold]{report.num_examples}[/]", "1.0000"]
    total_row += [""] * (len(table.columns) - len(total_row))
    table.add_row(*total_row)
    console = console or Console()
    console.print(table)
    for s in report.sites:
        if s.excluded:
            console.print(f"[red]excluded[/] {s.site}: {s.reason}", soft_wrap=True)
    if report.working_bytes is not None:
        console.print(f"working memory {report.working_bytes / 2**20:.1f} MiB of a "
                      f"{(report.memory_budget or 0) / 2**20:.0f} MiB budget")


def aggregate(
    inputs: Annotated[list[Path], typer.Argument(help="Weight files (.h5) to merge.")],
    output: Annotated[Path, typer.Option("-o", "--output", help="Where to write the merged .h5.")],
    strategy: Annotated[str, typer.Option(help="Strategy name (see `fedsplit strategies`).")] = "fedavg",
    param: Annotated[
        list[str] | None, typer.Option("--param", help="Strategy parameter key=value (repeatable).")
    ] = None,
    report_json: Annotated[
        Path | None,
        typer.Option(help="Where to save the report as JSON. Default: <output>.report.json "
                          "beside the output model."),
    ] = None,
    memory_budget: Annotated[
        str, typer.Option(help="Working memory the strategy may use beyond its output, e.g. "
                               "512MB or 2GB (binary units). Robust rules read blocks of all "
                               "inputs to stay under it.")
    ] = "512MB",
    cohort_cap: Annotated[
        list[str] | None,
        typer.Option("--cohort-cap", help="SITE=ROWS: the site's registered cohort size; a "
                                          "larger claimed count is clipped or refused "
                                          "(repeatable)."),
    ] = None,
    cohort_caps: Annotated[
        Path | None, typer.Option(help="JSON file mapping site -> registered cohort size.")
    ] = None,
    cap_policy: Annotated[
        str, typer.Option(help="Count above its cap: 'clip' it to the cap, or 'refuse' (exclude) "
                               "the update. Flagged in the report either way.")
    ] = "clip",
    reference: Annotated[
        Path | None,
        typer.Option(help="The round's model (.h5): inputs must match its names, shapes and "
                          "dtypes. Default: the layout shared by more than half the inputs."),
    ] = None,
    device: Annotated[
        str,
        typer.Option(help="Where the aggregation runs: 'auto' (the GPU when the machine has "
                          "one, else the CPU), 'cpu', 'cuda' or 'cuda:N'. The memory budget "
                          "holds on the GPU too."),
    ] = "auto",
) -> None:
    """Aggregate weight files; the output's num_examples is the sum of the used inputs'."""
    settings = aggregation.BackendSettings.from_environ(os.environ, device=device)  # once, first
    strat = aggregation.get_strategy(strategy, aggregation.parse_param_pairs(param or []))
    budget = parse_bytes(memory_budget)
    caps = parse_caps(cohort_cap or [], cohort_caps)
    if cap_policy not in CAP_POLICIES:
        raise ConfigError(
            f"--cap-policy is 'clip' (lower an over-cap count to the cap) or 'refuse' (exclude "
            f"the update). Received: {cap_policy!r}"
        )
    done = aggregate_files(
        strat, inputs, output, report_path=report_json, reference=reference,
        cohort_caps=caps, cap_policy=cap_policy, memory_budget=budget, settings=settings,
    )
    result, target = done.result, done.report_path
    print_report(result.report)
    Console().print(f"wrote {output} (num_examples={result.num_examples}) and report {target}")
    skip_teardown()  # the model and report are written and closed, the report printed


__all__ = ["DEFAULT_MEMORY_BUDGET", "aggregate", "parse_bytes", "parse_caps", "print_report"]
