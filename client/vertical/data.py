"""A vertical site's own table: ID column plus its feature columns, and their preprocessing.

Numeric columns: missing values become the median of the training rows, then each column is
standardised with the training rows' mean and standard deviation. Categorical columns: missing
values become the training rows' mode, then one-hot over the training rows' most frequent
categories (rarer or unseen ones share an ``other`` slot). Every statistic comes from the rows
the label holder marked as training rows, never from held-out rows.
"""

from __future__ import annotations

from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Any

import numpy as np
from fedsplit.protocol.errors import ConfigError
from fedsplit.protocol.vertical.table import id_column_values, read_frame

MAX_CATEGORIES = 20  # one-hot slots per categorical column (plus "other")


@dataclass
class SiteTable:
    """IDs (as strings) and the feature columns, in file order."""

    ids: list[str]
    frame: Any  # pandas.DataFrame of feature columns only
    source: str

    def __len__(self) -> int:
        return len(self.ids)


def read_site_table(path: str | Path, id_column: str) -> SiteTable:
    """Read a site's CSV/Parquet file: the ID column and every other column as a feature."""
    path = Path(path)
    frame = read_frame(path)
    ids = id_column_values(frame, id_column, path)
    features = frame.drop(columns=[id_column])
    if features.shape[1] == 0:
        raise ConfigError(f"{path} has only the ID column; a site needs at least one feature column. "
                          f"Received: columns {list(frame.columns)}")
    return SiteTable(ids=ids, frame=features.reset_index(drop=True), source=str(path))


def _ranked(values: Any) -> list[str]:
    """Distinct values, most frequent first, ties in value order."""
    counts = values.value_counts()
    return [str(v) for v, _ in sorted(counts.items(), key=lambda kv: (-int(kv[1]), str(kv[0])))]


@dataclass
class Preprocessor:
    """Imputation, scaling and one-hot vocabularies fitted on training rows only."""

    numeric: list[str]
    medians: list[float]
    means: list[float]
    stds: list[float]
    categorical: list[str]
    modes: list[str]
    vocab: list[list[str]]

    @classmethod
    def fit(cls, frame: Any) -> Preprocessor:
        """Fit on ``frame`` (the training rows of one site's features)."""
        numeric = [str(c) for c in frame.columns if frame[c].dtype.kind in "iuf"]
        categorical = [str(c) for c in frame.columns if str(c) not in numeric]
        medians, means, stds = [], [], []
        for col in numeric:
            values = frame[col].astype(float)
            med = float(values.median()) if values.notna().any() else 0.0
            filled = values.fillna(med)
            medians.append(med)
            means.append(float(filled.mean()))
            std = float(filled.std(ddof=0))
            stds.append(std if std > 1e-12 else 1.0)
        modes, vocab = [], []
        for col in categorical:
            # ties broken by value, so the result never depends on the order of the rows
            counts = _ranked(frame[col].dropna().astype(str))
            modes.append(counts[0] if counts else "")
            filled = frame[col].astype(object).where(frame[col].notna(), modes[-1]).astype(str)
            vocab.append(sorted(_ranked(filled)[:MAX_CATEGORIES]))
        return cls(numeric, medians, means, stds, categorical, modes, vocab)

    @property
    def feature_names(self) -> list[str]:
        """Names of the encoded columns."""
        names = list(self.numeric)
        for col, values in zip(self.categorical, self.vocab, strict=True):
            names += [f"{col}={v}" for v in values] + [f"{col}=<other>"]
        return names

    def transform(self, frame: Any) -> np.ndarray:
        """Encode ``frame`` (any rows of the same site) with the fitted statistics."""
        missing = [c for c in self.numeric + self.categorical if c not in frame.columns]
        if missing:
            raise ConfigError(f"The table lacks columns the site was trained with: "
                              f"{', '.join(missing)}. Received: {list(frame.columns)}")
        blocks = []
        for col, med, mean, std in zip(self.numeric, self.medians, self.means, self.stds, strict=True):
            values = frame[col].astype(float).fillna(med).to_numpy()
            blocks.append(((values - mean) / std)[:, None])
        for col, mode, values in zip(self.categorical, self.modes, self.vocab, strict=True):
            filled = frame[col].astype(object).where(frame[col].notna(), mode).astype(str).to_numpy()
            onehot = np.zeros((len(frame), len(values) + 1))
            index = {v: i for i, v in enumerate(values)}
            for r, v in enumerate(filled):
                onehot[r, index.get(v, len(values))] = 1.0
            blocks.append(onehot)
        return np.concatenate(blocks, axis=1).astype(np.float32)

    def to_dict(self) -> dict[str, Any]:
        """JSON-friendly form (saved beside the site's branch)."""
        return asdict(self)

    @classmethod
    def from_dict(cls, data: dict[str, Any]) -> Preprocessor:
        """Inverse of `to_dict`."""
        return cls(**data)
