"""``fedsplit predict``: score a raw hospital table (or a recipe's inputs) with a saved global model."""

from __future__ import annotations

from pathlib import Path
from typing import Annotated

import typer
from rich.console import Console

console = Console()


def predict(
    table: Annotated[Path, typer.Argument(help="The patients' table (CSV or Parquet), as exported; "
                                               "with --recipe, also what the recipe reads (e.g. a "
                                               "folder of images).")],
    model: Annotated[Path, typer.Option("--model", help="A global.h5 written by a fedsplit "
                                                        "table federation (it stores its schema).")],
    output: Annotated[Path, typer.Option("-o", "--output", help="Where to write the predictions "
                                                                "(.csv or .parquet).")],
    recipe: Annotated[str, typer.Option(help="The recipe the model was trained with "
                                             "(package.module:Attribute or entry point), "
                                             "installed here; its parameters come from the "
                                             "weight file.")] = "",
) -> None:
    """One row per input row: probability per class and the predicted class (or value)."""
    import torch
    from fedsplit.orchestration.predict import predict_file

    torch.set_num_threads(1)
    result = predict_file(model, table, output, recipe=recipe)
    console.print(f"wrote {len(result)} predictions to {output}")
