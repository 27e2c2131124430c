"""Bundled data cut by columns into vertical site files (and a label file for the coordinator).

``breast-cancer``: the 30 columns in order, split into ``sites`` contiguous groups (3 sites: 10
columns each). ``digits``: the 64 pixels of each 8x8 image in row-major order, split the way
the seed lecture cuts MNIST at column 392 (2 sites: top and bottom half of every image).
``diabetes`` (regression, 442 patients): the 10 columns in order (age, sex, bmi, bp, s1-s6),
split into ``sites`` contiguous groups (2 sites: age/sex/bmi/bp/s1 and s2-s6).
``overlap`` < 1 keeps that share of patients at every site and gives each other patient to a
single site, so views are missing (the partial-overlap case).
"""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path

import numpy as np
from fedsplit.protocol.errors import ConfigError

ID_COLUMN = "patient_id"
TARGET = "target"
VERTICAL_DATASETS = ("breast-cancer", "digits", "diabetes")


@dataclass
class SiteFiles:
    """Paths written for one vertical simulation."""

    sites: list[Path]
    labels: Path
    id_column: str = ID_COLUMN
    target: str = TARGET


def _load(name: str) -> tuple[np.ndarray, np.ndarray, list[str]]:
    from sklearn import datasets as sk

    if name == "breast-cancer":
        b = sk.load_breast_cancer()
        return b.data, b.target, [str(c) for c in b.feature_names]
    if name == "diabetes":
        b = sk.load_diabetes()
        return b.data, b.target, [str(c) for c in b.feature_names]
    if name == "digits":
        b = sk.load_digits()
        return b.data / 16.0, b.target, [f"pixel_{r}_{c}" for r in range(8) for c in range(8)]
    raise ConfigError(f"Vertical bundled datasets: {', '.join(VERTICAL_DATASETS)}. Received: {name!r}")


def write_bundled(name: str, num_sites: int, folder: Path, *, overlap: float = 1.0,
                  seed: int = 0) -> SiteFiles:
    """Write ``folder/site-i.csv`` (ID + its columns) and ``folder/labels.csv`` (ID + target)."""
    import pandas as pd

    x, y, names = _load(name)
    if not 1 <= num_sites <= len(names):
        raise ConfigError(f"--sites must be between 1 and {len(names)} for {name}. Received: {num_sites}")
    if not 0 < overlap <= 1:
        raise ConfigError(f"--overlap must be in (0, 1]. Received: {overlap}")
    rng = np.random.default_rng(seed)
    ids = np.array([f"P{i:05d}" for i in rng.permutation(len(y))])
    holders = np.ones((len(y), num_sites), dtype=bool)
    if overlap < 1 and num_sites > 1:
        single = rng.permutation(len(y))[: round(len(y) * (1 - overlap))]
        holders[single] = False
        holders[single, rng.integers(0, num_sites, len(single))] = True
    folder.mkdir(parents=True, exist_ok=True)
    paths = []
    for k, cols in enumerate(np.array_split(np.arange(len(names)), num_sites)):
        frame = pd.DataFrame(x[:, cols], columns=[names[c] for c in cols])
        frame.insert(0, ID_COLUMN, ids)
        frame = frame[holders[:, k]].sample(frac=1.0, random_state=seed + k)  # each site its own order
        path = folder / f"site-{k}.csv"
        frame.to_csv(path, index=False)
        paths.append(path)
    labels = folder / "labels.csv"
    pd.DataFrame({ID_COLUMN: ids, TARGET: y}).to_csv(labels, index=False)
    return SiteFiles(paths, labels)


TITANIC_GROUPS = (("Pclass", "Sex", "Age"), ("SibSp", "Parch", "Ticket", "Fare", "Embarked"))


def write_titanic(train_csv: Path, folder: Path) -> SiteFiles:
    """Cut Kaggle's Titanic ``train.csv`` into the seed lecture's two column groups.

    Site one: class, sex, age. Site two: siblings/spouses, parents/children, ticket, fare,
    embarked. The label file holds PassengerId and Survived. Missing values stay missing
    (sites impute them from their training rows).
    """
    import pandas as pd

    frame = pd.read_csv(train_csv)
    folder.mkdir(parents=True, exist_ok=True)
    paths = []
    for k, cols in enumerate(TITANIC_GROUPS):
        path = folder / f"site-{k}.csv"
        frame[["PassengerId", *cols]].sample(frac=1.0, random_state=k).to_csv(path, index=False)
        paths.append(path)
    labels = folder / "labels.csv"
    frame[["PassengerId", "Survived"]].to_csv(labels, index=False)
    return SiteFiles(paths, labels, "PassengerId", "Survived")
