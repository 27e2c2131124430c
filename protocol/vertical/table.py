"""Reading the ID column of a vertical party's table (shared by sites and the label holder)."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import numpy as np
from fedsplit.protocol.errors import ConfigError

TABLE_SUFFIXES = (".csv", ".parquet", ".pq")


def read_frame(path: str | Path) -> Any:
    """A CSV or Parquet file as a DataFrame, with errors that name the file."""
    import pandas as pd

    path = Path(path)
    if path.suffix.lower() not in TABLE_SUFFIXES:
        raise ConfigError(f"Vertical files must be .csv or .parquet. Received: {path.name}")
    if not path.is_file():
        raise ConfigError(f"Data file {path} does not exist. Received: {path}")
    try:
        return pd.read_csv(path) if path.suffix.lower() == ".csv" else pd.read_parquet(path)
    except Exception as e:  # pandas raises many types for unreadable files
        raise ConfigError(f"Could not read {path} ({e}). Received: {path}") from e


def normalise_ids(values: Any) -> list[str]:
    """IDs as strings; whole floats (pandas reads int IDs with gaps as float) lose the ``.0``."""
    import pandas as pd

    series = pd.Series(values)
    if series.dtype.kind == "f" and bool(np.all(np.mod(series.dropna(), 1) == 0)):
        series = series.astype("Int64")
    return [str(v) for v in series]


def id_column_values(frame: Any, id_column: str, source: Path | str) -> list[str]:
    """The ID column of ``frame`` as strings, with errors that say what to fix."""
    if id_column not in frame.columns:
        raise ConfigError(
            f"{source} has no ID column {id_column!r}; pass the column that identifies patients "
            f"with --id-column. Columns: {', '.join(map(str, frame.columns))}. Received: {id_column!r}"
        )
    missing = int(frame[id_column].isna().sum())
    if missing:
        raise ConfigError(
            f"{source}: {missing} row(s) have no ID in {id_column!r}; rows without an ID cannot be "
            f"aligned, drop them first. Received: {missing} missing IDs"
        )
    return normalise_ids(frame[id_column])
