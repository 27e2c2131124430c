"""A site's data: bundled demo datasets, partitions across sites, and local files.

A hospital's rows never leave this module's caller: the agent reads its file, trains, and
ships weights. The only summaries that leave a site are the per-feature count, sum and sum
of squares used to agree on one standardisation (`feature_stats`).
"""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path
from typing import Any

import numpy as np

from protocol.errors import ConfigError
from protocol.stats import Moments, moments

TABLE_SUFFIXES = (".csv", ".parquet", ".pq")
IMAGE_SUFFIXES = (".npz",)
DATASETS = ("breast-cancer", "digits", "wine", "diabetes")


@dataclass
class Dataset:
    """Features, targets and what kind of model they need."""

    x: np.ndarray
    y: np.ndarray
    task: str  # "classification" | "regression"
    kind: str  # "mlp" | "cnn"
    feature_names: list[str]

    def __len__(self) -> int:
        return len(self.y)

    def subset(self, idx: np.ndarray) -> Dataset:
        """Return the rows ``idx``."""
        return Dataset(self.x[idx], self.y[idx], self.task, self.kind, self.feature_names)

    @property
    def num_classes(self) -> int:
        """Classes (labels are 0..K-1), or 1 for regression."""
        return int(self.y.max()) + 1 if self.task == "classification" else 1


def load_bundled(name: str) -> Dataset:
    """Load a dataset that ships inside scikit-learn (no download)."""
    from sklearn import datasets as sk

    if name == "breast-cancer":
        b = sk.load_breast_cancer()
        return Dataset(b.data.astype(np.float32), b.target.astype(np.int64), "classification",
                       "mlp", list(b.feature_names))
    if name == "wine":
        b = sk.load_wine()
        return Dataset(b.data.astype(np.float32), b.target.astype(np.int64), "classification",
                       "mlp", list(b.feature_names))
    if name == "diabetes":
        b = sk.load_diabetes()
        return Dataset(b.data.astype(np.float32), b.target.astype(np.float32), "regression",
                       "mlp", list(b.feature_names))
    if name == "digits":
        b = sk.load_digits()
        x = (b.images / 16.0).astype(np.float32)[:, None, :, :]  # (n, 1, 8, 8) in [0, 1]
        return Dataset(x, b.target.astype(np.int64), "classification", "cnn",
                       [f"pixel_{i}" for i in range(64)])
    raise ConfigError(f"Unknown dataset. Choose one of {', '.join(DATASETS)}. Received: {name!r}")


def infer_task(y: np.ndarray) -> str:
    """Classification for integer-like targets with at most 20 values, else regression."""
    if y.dtype.kind in "OUSb":
        return "classification"
    values = np.unique(y[~np.isnan(y)] if y.dtype.kind == "f" else y)
    integer_like = bool(np.all(np.mod(values, 1) == 0))
    return "classification" if integer_like and len(values) <= 20 else "regression"


def read_table(path: Path) -> "pandas.DataFrame":  # type: ignore[name-defined]  # noqa: F821, UP037
    """Read a CSV or Parquet file into a DataFrame, with errors that name the file."""
    import pandas as pd

    if not path.is_file():
        raise ConfigError(f"Data file {path} does not exist. Received: {path}")
    try:
        if path.suffix.lower() == ".csv":
            return pd.read_csv(path)
        return pd.read_parquet(path)
    except Exception as e:  # pandas raises many types for unreadable files
        raise ConfigError(f"Could not read {path} as {path.suffix} ({e}). Received: {path}") from e


def load_site_file(path: str | Path, *, target: str, task: str | None = None) -> Dataset:
    """Load a site's own file: CSV/Parquet with a target column, or NPZ with ``x`` and ``y``.

    Table features must be numeric (missing values allowed: they become the federation's mean);
    classification labels must be integers 0..K-1 (``fedsplit simulate`` encodes others).
    """
    path = Path(path)
    suffix = path.suffix.lower()
    if suffix in IMAGE_SUFFIXES:
        if not path.is_file():
            raise ConfigError(f"Data file {path} does not exist. Received: {path}")
        try:
            with np.load(path, allow_pickle=False) as npz:
                x, y = npz["x"].astype(np.float32), npz["y"]
        except (KeyError, ValueError, OSError) as e:
            raise ConfigError(
                f"{path} must be an NPZ file with arrays 'x' (images, N x C x H x W or N x H x W) "
                f"and 'y' (labels). ({e}) Received: {path.name}"
            ) from e
        if x.ndim == 3:
            x = x[:, None]
        if x.ndim != 4 or len(x) != len(y):
            raise ConfigError(
                f"{path}: 'x' must be N x C x H x W (or N x H x W) with one label per image. "
                f"Received: x {x.shape}, y {y.shape}"
            )
        return _finish(x, y, task or "classification", "cnn",
                       [f"pixel_{i}" for i in range(int(np.prod(x.shape[1:])))], path)
    if suffix not in TABLE_SUFFIXES:
        raise ConfigError(
            f"Site data must be .csv, .parquet or .npz. Received: {path.name}"
        )
    return dataset_from_frame(read_table(path), target=target, task=task, source=path)


def dataset_from_frame(df: Any, *, target: str, task: str | None, source: Path) -> Dataset:
    """Turn a site's table (a DataFrame) into a `Dataset`; ``source`` names it in errors."""
    if target not in df.columns:
        raise ConfigError(
            f"{source} has no target column {target!r}; pass the right one with --target. "
            f"Columns: {', '.join(map(str, df.columns))}. Received: {target!r}"
        )
    features = df.drop(columns=[target])
    non_numeric = [str(c) for c in features.columns if features[c].dtype.kind not in "iufb"]
    if non_numeric:
        raise ConfigError(
            f"{source}: feature columns must be numeric; encode these first (one-hot with a "
            f"vocabulary shared by all sites) or drop them: {', '.join(non_numeric)}. "
            f"Received: {len(non_numeric)} non-numeric column(s)"
        )
    if df[target].isna().any():
        raise ConfigError(
            f"{source}: target column {target!r} has {int(df[target].isna().sum())} missing "
            f"value(s); drop those rows first. Received: missing targets"
        )
    y = df[target].to_numpy()
    task = task or infer_task(y)
    return _finish(features.to_numpy(dtype=np.float32), y, task, "mlp",
                   [str(c) for c in features.columns], source)


def _finish(x: np.ndarray, y: np.ndarray, task: str, kind: str, names: list[str],
            path: Path) -> Dataset:
    if len(y) == 0:
        raise ConfigError(f"{path} holds no rows. Received: 0 rows")
    if task == "classification":
        if y.dtype.kind not in "iub" and not (y.dtype.kind == "f" and np.all(np.mod(y, 1) == 0)):
            raise ConfigError(
                f"{path}: classification labels must be integers 0..K-1. Encode them (e.g. "
                f"'yes'/'no' -> 1/0) with one mapping shared by every site. Received: dtype "
                f"{y.dtype}, e.g. {y[:3].tolist()}"
            )
        y = y.astype(np.int64)
        if y.min() < 0:
            raise ConfigError(f"{path}: labels must be >= 0. Received: {int(y.min())}")
    else:
        y = y.astype(np.float32)
    return Dataset(x, y, task, kind, names)


def partition(y: np.ndarray, num_sites: int, scheme: str, seed: int) -> list[np.ndarray]:
    """Split row indices across sites: ``iid``, ``dirichlet:ALPHA`` or ``sizes:n1,n2,...``.

    Reproducible for a given seed. ``dirichlet`` draws each class's share per site from
    Dirichlet(alpha), so small alpha gives strongly label-skewed sites.
    """
    rng = np.random.default_rng(seed)
    n = len(y)
    if num_sites < 1:
        raise ConfigError(f"--sites must be >= 1. Received: {num_sites}")
    name, _, arg = scheme.partition(":")
    if name == "iid":
        parts = np.array_split(rng.permutation(n), num_sites)
    elif name == "sizes":
        try:
            sizes = [int(s) for s in arg.split(",")]
        except ValueError:
            sizes = []
        if len(sizes) != num_sites or min(sizes, default=0) < 1 or sum(sizes) > n:
            raise ConfigError(
                f"--partition sizes:n1,...,nK needs {num_sites} positive sizes summing to at most "
                f"{n} rows. Received: {scheme!r}"
            )
        perm = rng.permutation(n)
        parts = np.split(perm[: sum(sizes)], np.cumsum(sizes)[:-1])
    elif name == "dirichlet":
        try:
            alpha = float(arg)
        except ValueError:
            alpha = -1.0
        if alpha <= 0:
            raise ConfigError(
                f"--partition dirichlet:ALPHA needs ALPHA > 0 (e.g. dirichlet:0.5). "
                f"Received: {scheme!r}"
            )
        if infer_task(y) != "classification":
            raise ConfigError(f"dirichlet partitions skew labels; use iid for regression. "
                              f"Received: {scheme!r}")
        buckets: list[list[int]] = [[] for _ in range(num_sites)]
        for cls in np.unique(y):
            idx = rng.permutation(np.flatnonzero(y == cls))
            shares = rng.dirichlet([alpha] * num_sites)
            cuts = (np.cumsum(shares)[:-1] * len(idx)).astype(int)
            for site, chunk in enumerate(np.split(idx, cuts)):
                buckets[site].extend(chunk.tolist())
        parts = [rng.permutation(np.array(b, dtype=np.int64)) for b in buckets]
    else:
        raise ConfigError(
            f"--partition must be iid, dirichlet:ALPHA or sizes:n1,n2,... Received: {scheme!r}"
        )
    small = [i for i, p in enumerate(parts) if len(p) < 2]
    if small:
        raise ConfigError(
            f"Partition {scheme!r} leaves site(s) {small} with fewer than 2 rows; use fewer sites, "
            f"a larger alpha or other sizes. Received: sizes {[len(p) for p in parts]}"
        )
    return [np.asarray(p, dtype=np.int64) for p in parts]


def split_indices(n: int, fraction: float, seed: int) -> tuple[np.ndarray, np.ndarray]:
    """Return (keep, held_out) index arrays with ``fraction`` of rows held out (at least 1)."""
    perm = np.random.default_rng(seed).permutation(n)
    k = max(1, round(n * fraction)) if n > 1 else 0
    return np.sort(perm[k:]), np.sort(perm[:k])


def feature_stats(data: Dataset) -> Moments:
    """Return per-feature (count, sum, sum of squares) ignoring NaN; images pool all pixels."""
    x = data.x.reshape(len(data.x), -1)
    return moments(x.reshape(-1, 1) if data.kind == "cnn" else x)
