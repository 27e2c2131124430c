"""``fedsplit site egress``: what left this hospital, run by run, and whether the log is intact."""

from __future__ import annotations

from collections import defaultdict
from pathlib import Path
from typing import TYPE_CHECKING, Annotated

import typer

if TYPE_CHECKING:
    from fedsplit.protocol.egress_log import EgressRecord


def _size(n: int) -> str:
    for unit in ("B", "kB", "MB", "GB"):
        if n < 1000 or unit == "GB":
            return f"{n} {unit}" if unit == "B" else f"{n:.1f} {unit}"
        n /= 1000  # type: ignore[assignment]
    return f"{n} B"  # pragma: no cover


def _names(record: EgressRecord) -> str:
    """The class labels and categories a record named, briefly."""
    parts = []
    if labels := record.labels:
        parts.append(f"labels {', '.join(labels[:6])}{', ...' if len(labels) > 6 else ''}")
    if categories := record.categories:
        parts.append(f"{sum(len(v) for v in categories.values())} categories")
    if withheld := record.withheld:
        parts.append(f"{sum(withheld.values())} withheld")
    return "; ".join(parts)


def _counts(record: EgressRecord) -> str:
    words = {"num-examples": "examples", "rows": "rows"}
    parts = []
    for key, value in sorted(record.counts.items(), key=lambda kv: ("." in kv[0], kv[0])):
        where, _, name = key.rpartition(".")
        text = f"{value} {words[name]}" if name in words else f"{name}={value}"
        parts.append(f"{text} ({where})" if where else text)
    return ", ".join(parts)


def _when(record: EgressRecord) -> str:
    return record.at[5:19].replace("T", " ")


def _row(record: EgressRecord) -> list[str]:
    return [_when(record), "" if record.round is None else str(record.round),
            str(record.message or ""), str(record.outcome),
            f"{len(record.tensors)} ({_size(record.bytes)})" if record.tensors else "",
            _counts(record), _names(record),
            "" if record.epsilon is None else f"{record.epsilon:.3g}"]


def egress(
    state_dir: Annotated[Path, typer.Option(help="The hospital's state folder (node config "
                                                 "state-dir; `fedsplit site run --state-dir`).")],
    run: Annotated[int | None, typer.Option(help="Only this Flower run id.")] = None,
    verify: Annotated[bool, typer.Option("--verify", help="Check the log's chain, MACs and head "
                                                          "instead: exit 1 naming the first "
                                                          "changed, removed, reordered or "
                                                          "truncated line.")] = False,
) -> None:
    """Print what left this hospital (its egress log), or verify the log.

    One table per run (time, round, message, outcome, tensors and their bytes, counts, labels
    and categories named, epsilon) and the totals; with ``--verify``, check that the log is the one
    the hospital's agent wrote (exit 1 naming the first bad line)."""
    from fedsplit.protocol import egress_log
    from fedsplit.protocol.errors import ConfigError
    from rich.console import Console
    from rich.table import Table

    if verify:
        verdict = egress_log.verify(state_dir)
        if verdict.ok:
            typer.echo(f"egress log intact: {verdict.records} record(s); head {verdict.head}")
            return
        typer.echo(f"egress log BROKEN: {verdict.problem}. {verdict.records} record(s) before "
                   f"it verified; last good hash {verdict.head}", err=True)
        raise typer.Exit(1)
    if not (state_dir / egress_log.LOG_NAME).exists():
        raise ConfigError(f"There is no egress log in {state_dir}: point --state-dir at the "
                          f"hospital's state folder (node config state-dir). Received: "
                          f"{state_dir}")
    runs: dict[int, list[EgressRecord]] = defaultdict(list)
    for record in egress_log.read_records(state_dir):
        if run is None or record.run == run:
            runs[record.run or 0].append(record)
    console = Console(highlight=False)
    if not console.is_terminal:  # a file or a pipe: room for every column
        console = Console(highlight=False, width=140)
    total_sent = total_bytes = total_refused = 0
    for run_id, records in sorted(runs.items()):
        coordinators = sorted({r.coordinator or "" for r in records} - {""})
        table = Table(title=f"run {run_id} (hospital {records[0].site}"
                            f"{', coordinator ' + ', '.join(coordinators) if coordinators else ''})",
                      title_justify="left")
        for column in ("time (UTC)", "round", "message", "outcome", "tensors", "counts",
                       "named", "epsilon"):
            table.add_column(column, overflow="fold",
                             no_wrap=column in ("time (UTC)", "round", "message", "outcome"))
        for record in records:
            table.add_row(*_row(record))
        notes = [f"  {r.outcome} {_when(r)} {r.message}: {r.reason}" for r in records
                 if r.outcome != "sent"]
        sent = [r for r in records if r.outcome == "sent"]
        size = sum(r.bytes for r in sent)
        refused = sum(r.outcome == "refused" for r in records)
        epsilons = [r.epsilon for r in sent if r.epsilon is not None]
        console.print(table)
        for note in notes:
            console.print(note, soft_wrap=True)
        console.print(f"run {run_id}: {len(sent)} repl{'y' if len(sent) == 1 else 'ies'} sent, "
                      f"{sum(len(r.tensors) for r in sent)} tensors, {_size(size)}; "
                      f"{refused} refused"
                      + (f"; epsilon spent up to {max(epsilons):.3g}" if epsilons else ""),
                      soft_wrap=True)
        total_sent, total_bytes, total_refused = (total_sent + len(sent), total_bytes + size,
                                                  total_refused + refused)
    if not runs:
        typer.echo(f"no record{' of run ' + str(run) if run is not None else ''} in the egress "
                   f"log of {state_dir}")
        return
    console.print(f"total: {len(runs)} run(s), {total_sent} replies sent, {_size(total_bytes)}, "
                  f"{total_refused} refused (check the log: fedsplit site egress --state-dir "
                  f"{state_dir} --verify)", soft_wrap=True)
