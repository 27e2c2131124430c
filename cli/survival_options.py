"""What ``fedsplit km`` and ``fedsplit cox`` share: where the hospitals' rows come from (a
bundled survival dataset or one ``--site`` table per hospital) and the run itself, whose
document (``km.json`` / ``cox.json``) comes back read through its model
(`protocol.record.survival`). The table options (time, event, missing values) are the ones every
command takes (`cli.options`)."""

from __future__ import annotations

from pathlib import Path
from typing import TYPE_CHECKING, Annotated, TypeVar

import typer
from rich.console import Console

if TYPE_CHECKING:
    from fedsplit.protocol.record.survival import CoxDocument, KMDocument
    from fedsplit.protocol.survival import SurvivalRun

SurvivalDataset = Annotated[str | None, typer.Option(
    help="Bundled survival dataset: tcga-brca (FLamby's 6 regions, training rows).")]
SurvivalSites = Annotated[list[str] | None, typer.Option(
    "--site", help="A hospital's CSV/Parquet table, as PATH, NAME=PATH or NAME=TRAIN:TEST (the "
                   "TRAIN file is used; repeat per site).")]

D = TypeVar("D", "KMDocument", "CoxDocument")


def run_analysis(run: SurvivalRun, document: type[D], *, dataset: str | None,
                 site: list[str] | None, out: Path, doing: str, console: Console) -> D:
    """Run the analysis in Flower's simulation engine while ``console`` says what it is
    ``doing``; its document, read through ``document``."""
    from fedsplit.orchestration.survival.run import run_survival

    with console.status(doing):
        return run_survival(run, document, dataset=dataset, site_files=site or [], out=out)
