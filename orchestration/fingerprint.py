"""What each simulated site's data file holds: rows, columns and a content hash.

The runners put one fingerprint per site into the run config (``data-fingerprint``); a coordinator
asked to resume an unfinished run compares it with the saved one
(`server.history.find_resume_point`), so a re-run with another partition, seed or site file
starts over or is refused instead of continuing the old model on new data.
"""

from __future__ import annotations

import hashlib
import io
from collections.abc import Mapping
from pathlib import Path
from typing import Any

import numpy as np
from fedsplit.protocol.errors import ConfigError


def fingerprint_bytes(name: str, content: bytes) -> dict[str, Any]:
    """``{rows, columns, sha256}`` of a site data file called ``name`` holding ``content``.

    CSV/Parquet: rows and columns of the table (target included), sha256 of the file's bytes.
    NPZ: rows and values per row of ``x``, sha256 of every array's name, dtype, shape and values
    (the zip container's bytes depend on the writer: compression, entry times).
    """
    import pandas as pd

    suffix = Path(name).suffix.lower()
    try:
        if suffix == ".npz":
            digest = hashlib.sha256()
            with np.load(io.BytesIO(content), allow_pickle=False) as npz:
                for key in sorted(npz.files):
                    array = npz[key]
                    digest.update(f"{key}|{array.dtype.str}|{array.shape}|".encode())
                    digest.update(np.require(array, requirements="C").tobytes())
                x = npz["x"]
            return {"rows": int(x.shape[0]), "columns": int(np.prod(x.shape[1:], dtype=np.int64)),
                    "sha256": digest.hexdigest()}
        if suffix == ".csv":
            frame = pd.read_csv(io.BytesIO(content))
        elif suffix in (".parquet", ".pq"):
            frame = pd.read_parquet(io.BytesIO(content))
        else:
            raise ConfigError(f"Site data files are .csv, .parquet or .npz. Received: {name}")
    except (ValueError, KeyError, OSError) as e:
        raise ConfigError(f"Could not read site data file {name} to fingerprint it ({e}). "
                          f"Received: {name}") from e
    return {"rows": int(frame.shape[0]), "columns": int(frame.shape[1]),
            "sha256": hashlib.sha256(content).hexdigest()}


def fingerprint_file(path: Path) -> dict[str, Any]:
    """`fingerprint_bytes` of the file at ``path``."""
    return fingerprint_bytes(path.name, Path(path).read_bytes())


def data_fingerprint(files: Mapping[str, Path]) -> dict[str, dict[str, Any]]:
    """Site name -> fingerprint of its file: the run config's ``data-fingerprint`` (as JSON
    text) or a simulation roster's (`protocol.roster.write_roster`)."""
    return {site: fingerprint_file(path) for site, path in files.items()}
