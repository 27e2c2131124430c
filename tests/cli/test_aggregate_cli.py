"""``fedsplit aggregate`` and ``fedsplit strategies`` as a user runs them."""

from __future__ import annotations

import json
from pathlib import Path

import numpy as np
import pytest
from fedsplit.cli.app import app
from fedsplit.cli.errors import run_guarded
from fedsplit.protocol import Update, read_weights, write_weights
from fedsplit.protocol.errors import AggregationError, WeightFileError


@pytest.fixture
def site_files(tmp_path: Path) -> list[Path]:
    """Three weight files with counts 50, 50 and 400."""
    rng = np.random.default_rng(1)
    paths = []
    for name, n in [("h1", 50), ("h2", 50), ("h3", 400)]:
        update = Update({"fc.weight": rng.normal(size=(3, 4)).astype(np.float32),
                         "fc.bias": rng.normal(size=3).astype(np.float32)},
                        num_examples=n, site=name, model="mlp/classification/4/3/-")
        paths.append(write_weights(update, tmp_path / f"{name}.h5"))
    return paths


def test_aggregate_equals_hand_computed_weighted_mean(site_files, tmp_path, capsys) -> None:
    """Counts 50, 50, 400: the output is the weighted mean to 1e-6 and its count the sum."""
    out = tmp_path / "global.h5"
    code = run_guarded(app, ["aggregate", *map(str, site_files), "-o", str(out),
                             "--report-json", str(tmp_path / "report.json")])
    assert code == 0
    result = read_weights(out)
    inputs = [read_weights(p) for p in site_files]
    for name in result.arrays:
        expected = sum(n * u.arrays[name].astype(np.float64)
                       for n, u in zip([50, 50, 400], inputs, strict=True)) / 500
        np.testing.assert_allclose(result.arrays[name], expected, atol=1e-6, rtol=0)
    assert result.num_examples == 500
    assert result.model == "mlp/classification/4/3/-"
    printed = capsys.readouterr().out
    for site, weight in [("h1", "0.1000"), ("h2", "0.1000"), ("h3", "0.8000")]:
        assert site in printed and weight in printed
    report = json.loads((tmp_path / "report.json").read_text())
    assert [s["num_examples"] for s in report["sites"]] == [50, 50, 400]


def test_aggregate_refuses_mismatched_shapes_with_clear_error(site_files, tmp_path, capsys) -> None:
    """A site with other columns gets the vertical-fusion hint and the aggregation exit code; no output."""
    odd = Update({"fc.weight": np.zeros((3, 7), np.float32), "fc.bias": np.zeros(3, np.float32)},
                 num_examples=10, site="odd")
    odd_path = write_weights(odd, tmp_path / "odd.h5")
    out = tmp_path / "global.h5"
    code = run_guarded(app, ["aggregate", str(site_files[0]), str(odd_path), "-o", str(out)])
    err = capsys.readouterr().err
    assert code == AggregationError.exit_code
    assert "IncompatibleUpdatesError" in err and "(3, 4)" in err and "(3, 7)" in err
    assert "vertical fusion" in err
    assert not out.exists()


def test_aggregate_refuses_bad_file_and_bad_param(site_files, tmp_path, capsys) -> None:
    """A non-HDF5 input and an unknown parameter are named, each with its branch's exit code."""
    junk = tmp_path / "junk.h5"
    junk.write_text("not hdf5")
    code = run_guarded(app, ["aggregate", str(junk), "-o", str(tmp_path / "o.h5")])
    assert code == WeightFileError.exit_code
    assert "not an HDF5 file" in capsys.readouterr().err
    code = run_guarded(app, ["aggregate", str(site_files[0]), "-o", str(tmp_path / "o.h5"),
                             "--param", "beta=0.3"])
    assert code == AggregationError.exit_code
    assert "Invalid parameters for strategy 'fedavg'" in capsys.readouterr().err


def test_strategies_lists_fedavg(capsys) -> None:
    """`fedsplit strategies` shows every registered strategy."""
    assert run_guarded(app, ["strategies"]) == 0
    assert "fedavg" in capsys.readouterr().out


def test_files_with_the_same_site_name_are_told_apart(site_files, tmp_path, capsys) -> None:
    """Several files naming the same site (e.g. rounds' global.h5) get their file name added."""
    same = []
    for i, path in enumerate(site_files):
        update = read_weights(path)
        update.site = "global"
        same.append(write_weights(update, tmp_path / f"round-{i}.h5"))
    assert run_guarded(app, ["aggregate", *map(str, same), "-o", str(tmp_path / "avg.h5")]) == 0
    printed = capsys.readouterr().out
    for i in range(3):
        assert f"global (round-{i}.h5)" in printed
