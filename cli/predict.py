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
    times: Annotated[str, typer.Option(help="Survival models: also the survival probability at "
                                            "these times (comma-separated, the training data's "
                                            "time unit), e.g. 365,730: columns survival_at_365, "
                                            "...; needs the baseline the run wrote beside the "
                                            "model.")] = "",
    baseline: Annotated[Path | None, typer.Option(help="With --times: the model's baseline file "
                                                       "(default: global.baseline.json beside "
                                                       "the model).")] = None,
) -> None:
    """One row per input row: probability per class and the predicted class (or value); for a
    survival model its risk score (log relative hazard), and with --times the survival
    probability at each time."""
    import torch
    from fedsplit.orchestration.predict import predict_file
    from fedsplit.protocol.errors import ConfigError
    from fedsplit.protocol.survival_summary import parse_times

    if baseline is not None and not times:
        raise ConfigError(f"--baseline is read only with --times. Received: --baseline {baseline}")
    torch.set_num_threads(1)
    result = predict_file(model, table, output, recipe=recipe,
                          times=parse_times(times) if times else (), baseline=baseline)
    console.print(f"wrote {len(result)} predictions to {output}")
