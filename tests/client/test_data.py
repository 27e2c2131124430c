"""Site data: bundled datasets, reproducible partitions, and hospital files."""

from __future__ import annotations

from pathlib import Path

import numpy as np
import pandas as pd
import pytest
from fedsplit.client.data import load_bundled, load_site_file, partition
from fedsplit.orchestration.experiment import Experiment, prepare_sites
from fedsplit.protocol import RunConfig
from fedsplit.protocol.errors import ConfigError
from fedsplit.protocol.schema import TableSettings


@pytest.mark.parametrize("scheme", ["iid", "dirichlet:0.5", "sizes:50,100,150"])
def test_partitions_are_reproducible_disjoint_and_seeded(scheme) -> None:
    """Same seed, same split; another seed, another split; no row in two sites."""
    y = load_bundled("breast-cancer").y
    a, b = partition(y, 3, scheme, seed=4), partition(y, 3, scheme, seed=4)
    assert all(np.array_equal(p, q) for p, q in zip(a, b, strict=True))
    c = partition(y, 3, scheme, seed=5)
    assert not all(np.array_equal(p, q) for p, q in zip(a, c, strict=True))
    rows = np.concatenate(a)
    assert len(rows) == len(set(rows.tolist()))
    if scheme.startswith("sizes"):
        assert [len(p) for p in a] == [50, 100, 150]
    if scheme == "iid":
        assert len(rows) == len(y)


def test_dirichlet_skews_labels_and_iid_does_not() -> None:
    """Small alpha gives sites very different label mixes; IID keeps them close."""
    y = load_bundled("digits").y

    def spread(parts: list[np.ndarray]) -> float:
        shares = np.array([np.bincount(y[p], minlength=10) / len(p) for p in parts])
        return float(np.abs(shares - shares.mean(0)).sum(1).mean())

    assert spread(partition(y, 4, "dirichlet:0.1", 0)) > 4 * spread(partition(y, 4, "iid", 0))


@pytest.mark.parametrize(
    ("scheme", "match"),
    [
        ("sizes:10,20", "3 positive sizes"),
        ("sizes:10,x,3", "3 positive sizes"),
        ("sizes:1000,1000,1000", "at most 569"),
        ("dirichlet:0", "ALPHA > 0"),
        ("dirichlet:abc", "ALPHA > 0"),
        ("stratified", "must be iid"),
    ],
)
def test_bad_partitions_are_refused(scheme, match) -> None:
    """Each malformed --partition says what is expected."""
    with pytest.raises(ConfigError, match=match):
        partition(load_bundled("breast-cancer").y, 3, scheme, 0)


def test_site_files_load_and_refuse_bad_tables(tmp_path: Path) -> None:
    """CSV, Parquet and NPZ load as they come (gaps get an indicator, text is one-hot, text
    labels are indexed); a missing target column and unknown file types are explained."""
    frame = pd.DataFrame({"age": [50, 61, np.nan, 47], "bp": [1.0, 2.0, 3.0, 4.0], "y": [0, 1, 1, 0]})
    frame.to_csv(tmp_path / "a.csv", index=False)
    frame.to_parquet(tmp_path / "a.parquet")
    for name in ("a.csv", "a.parquet"):
        data = load_site_file(tmp_path / name, target="y")
        assert data.feature_names == ["age", "age:missing", "bp"]
        assert data.task == "classification" and np.isnan(data.x[2, 0]) and data.x[2, 1] == 1.0
    np.savez(tmp_path / "img.npz", x=np.zeros((5, 8, 8)), y=np.arange(5))
    assert load_site_file(tmp_path / "img.npz", target="y").x.shape == (5, 1, 8, 8)

    with pytest.raises(ConfigError, match="no target column 'outcome'"):
        load_site_file(tmp_path / "a.csv", target="outcome")
    frame.assign(ward=["A", "B", "A", "C"]).to_csv(tmp_path / "text.csv", index=False)
    settings = TableSettings(target="y", min_category_count=1)
    text = load_site_file(tmp_path / "text.csv", target="y", settings=settings)
    assert text.feature_names[-3:] == ["ward=A", "ward=B", "ward=C"]
    assert text.x[:, -3:].tolist() == [[1, 0, 0], [0, 1, 0], [1, 0, 0], [0, 0, 1]]
    frame.assign(y=["yes", "no", "no", "yes"]).to_csv(tmp_path / "labels.csv", index=False)
    labels = load_site_file(tmp_path / "labels.csv", target="y", task="classification")
    assert labels.y.tolist() == [1, 0, 0, 1] and labels.schema.labels == ("no", "yes")
    with pytest.raises(ConfigError, match=r"\.csv, \.parquet or \.npz"):
        load_site_file(tmp_path / "a.xlsx", target="y")


def test_simulate_encodes_text_labels_once_and_cuts_test_rows_per_site(tmp_path: Path) -> None:
    """--site files with 'yes'/'no' labels get one shared mapping; a test split per file."""
    rng = np.random.default_rng(0)
    paths = []
    for i in range(2):
        frame = pd.DataFrame(rng.normal(size=(40, 3)), columns=["a", "b", "c"])
        frame["outcome"] = rng.choice(["yes", "no"], size=40)
        paths.append(tmp_path / f"h{i}.csv")
        frame.to_csv(paths[-1], index=False)
    exp = Experiment(cfg=RunConfig(target="outcome"), out=tmp_path / "out", site_files=paths)
    sites, test = prepare_sites(exp)
    assert [len(s) for s in sites] == [32, 32] and len(test) == 16
    assert set(np.unique(np.concatenate([s.y for s in sites]))) == {0, 1}

    other = pd.DataFrame(rng.normal(size=(10, 2)), columns=["a", "z"]).assign(outcome="yes")
    other.to_csv(tmp_path / "odd.csv", index=False)
    bad = Experiment(cfg=RunConfig(target="outcome"), out=tmp_path / "out",
                     site_files=[paths[0], tmp_path / "odd.csv"])
    with pytest.raises(ConfigError, match=r"no majority .*'b', 'c' at h0 but not at odd; 'z' "
                                          r"at odd but not at h0"):
        prepare_sites(bad)
