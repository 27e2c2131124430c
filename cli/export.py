"""``fedsplit export``: a torch checkpoint (state_dict) to a fedsplit weight file
(`orchestration.export`)."""

from __future__ import annotations

from pathlib import Path
from typing import Annotated

import typer


def export(
    checkpoint: Annotated[Path, typer.Argument(help="torch.save(model.state_dict()) file (.pt).")],
    num_examples: Annotated[int, typer.Option(help="Training rows behind these weights (>= 1).")],
    output: Annotated[Path, typer.Option("-o", "--output", help="Weight file to write (.h5).")],
    site: Annotated[str | None, typer.Option(help="Site name stored in the file.")] = None,
    compress: Annotated[bool, typer.Option(help="gzip the arrays.")] = False,
) -> None:
    """Write a checkpoint's float parameters as a fedsplit weight file for `fedsplit upload`."""
    from fedsplit.orchestration.export import export_checkpoint

    update, skipped = export_checkpoint(checkpoint, output, num_examples=num_examples, site=site,
                                        compress=compress)
    if skipped:
        typer.echo(f"skipped {len(skipped)} non-float entr(y/ies): {', '.join(skipped[:5])}")
    typer.echo(
        f"wrote {output}: {len(update.arrays)} parameters, "
        f"{sum(a.size for a in update.arrays.values())} values, num_examples={num_examples}"
    )
