"""FLamby's Fed-TCGA-BRCA, bundled (no download): 1,088 breast-cancer patients of TCGA in 6
regions with FLamby's static train/test split (866 / 222 patients).

The files in ``data/tcga_brca/`` are byte copies of FLamby's (source, terms and FLamby's
published results: ``data/tcga_brca/SOURCE.md``). `load_tcga_brca` gives, per region, the
training and test rows as raw tables (every cell as text, as `client.data.read_table` reads a
hospital's CSV): column ``pid`` (TCGA barcode, the ID column), FLamby's 39 features, ``E``
(1 = death observed, 0 = censored) and ``T`` (days).

Regions are FLamby's (its ``fold2`` index K, by tissue source site): 0 northeast, 1 south,
2 west, 3 midwest, 4 europe, 5 canada. The 8 patients of brca.csv from sites FLamby files
under "Other" are outside its split and left out, as FLamby does.

One documented change: 12 patients (regions 4 and 5) are censored at day 0, which fedsplit
refuses as a time (`protocol.survival`: times are positive). They are recorded at day 0.5:
censored before every other time (the next is day 1), they order exactly as at day 0, so every
Cox likelihood, Kaplan-Meier curve and concordance is the same, and FLamby's counts are kept.
"""

from __future__ import annotations

from functools import lru_cache
from pathlib import Path
from typing import Any

from fedsplit.protocol.errors import ConfigError

DATASET = "tcga-brca"
TIME, EVENT, ID = "T", "E", "pid"
REGIONS = ("northeast", "south", "west", "midwest", "europe", "canada")
ZERO_TIME = "0.5"  # the day recorded for FLamby's 12 patients censored at day 0
FOLDER = Path(__file__).resolve().parent / "data" / "tcga_brca"


@lru_cache(maxsize=1)
def _tables() -> tuple[Any, Any]:
    import pandas as pd

    try:
        rows = pd.read_csv(FOLDER / "brca.csv", dtype=str, keep_default_na=False)
        split = pd.read_csv(FOLDER / "train_test_split.csv", dtype=str, keep_default_na=False)
    except OSError as e:
        raise ConfigError(f"The bundled Fed-TCGA-BRCA files are missing from {FOLDER}; reinstall "
                          f"fedsplit. Received: {e}") from e
    return rows, split


def load_tcga_brca() -> dict[str, tuple[Any, Any]]:
    """Region name -> (training rows, test rows) as raw tables (cells as text), FLamby's split."""
    rows, split = _tables()
    rows = rows.copy()
    zero = rows[TIME].astype(float) <= 0
    rows.loc[zero, TIME] = ZERO_TIME
    merged = rows.merge(split[[ID, "fold2"]], on=ID, how="inner", validate="one_to_one")
    out = {}
    for k, region in enumerate(REGIONS):
        parts = []
        for fold in ("train", "test"):
            part = merged[merged["fold2"] == f"{fold}_{k}"].drop(columns=["fold2"])
            parts.append(part.reset_index(drop=True))
        out[region] = (parts[0], parts[1])
    return out
