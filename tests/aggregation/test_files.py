"""`aggregation.files.aggregate_files`: the one weight-files-in, model-and-report-out flow."""

from __future__ import annotations

import json
from pathlib import Path

import numpy as np
import pytest
from fedsplit.aggregation.errors import AggregationError
from fedsplit.aggregation.files import aggregate_files, report_path_for
from fedsplit.protocol import Update, read_weights, write_weights
from fedsplit.protocol.arrays import specs_of

from fedsplit import aggregation


def write(tmp: Path, name: str, value: float, count: int, **fields) -> Path:
    arrays = {"w": np.full((2, 3), value, np.float32), "b": np.full(2, value, np.float32)}
    return write_weights(Update(arrays, num_examples=count, **fields), tmp / f"{name}.h5")


FEDAVG = aggregation.get_strategy("fedavg")


def test_writes_weighted_model_and_report_beside_it(tmp_path: Path) -> None:
    """Counts 1 and 3: weighted mean, count 4, round written, report at the default path."""
    a = write(tmp_path, "a", 1.0, 1, site="h1", model="mlp")
    b = write(tmp_path, "b", 5.0, 3, site="h2", model="mlp")
    done = aggregate_files(FEDAVG, [a, b], tmp_path / "out" / "global.h5", round_id=7)
    model = read_weights(done.weights_path)
    np.testing.assert_allclose(model.arrays["w"], np.full((2, 3), 4.0))
    assert (model.num_examples, model.site, model.round, model.model) == (4, "aggregate", 7, "mlp")
    assert done.report_path == report_path_for(done.weights_path) == tmp_path / "out/global.report.json"
    report = json.loads(done.report_path.read_text())
    assert [s["site"] for s in report["sites"]] == ["h1", "h2"]
    assert sorted(p.name for p in (tmp_path / "out").iterdir()) == ["global.h5",
                                                                   "global.report.json"]


def test_model_id_comes_from_the_used_inputs_only(tmp_path: Path) -> None:
    """An excluded input's id does not count; inputs without an id do not vote."""
    good = [write(tmp_path, f"g{k}", 1.0, 10, site=f"h{k}", model="mlp") for k in range(2)]
    silent = write(tmp_path, "silent", 1.0, 10, site="h9")
    odd = write_weights(Update({"w": np.zeros((4, 4), np.float32)}, num_examples=10, site="odd",
                               model="other"), tmp_path / "odd.h5")
    done = aggregate_files(FEDAVG, [*good, silent, odd], tmp_path / "m.h5")
    assert [s.excluded for s in done.result.report.sites] == [False, False, False, True]
    assert done.model == "mlp" and read_weights(done.weights_path).model == "mlp"
    mixed = write(tmp_path, "mixed", 1.0, 10, site="h8", model="cnn")
    done = aggregate_files(FEDAVG, [*good, mixed], tmp_path / "n.h5")
    assert done.model is None and read_weights(done.weights_path).model is None


def test_labels_and_duplicate_sites(tmp_path: Path) -> None:
    """Files without a site take the label given (else their stem); duplicates get the file name."""
    a = write(tmp_path, "a", 1.0, 1)
    b = write(tmp_path, "b", 1.0, 1)
    done = aggregate_files(FEDAVG, [a, b], tmp_path / "m.h5", labels=["x", "y"])
    assert [s.site for s in done.result.report.sites] == ["x", "y"]
    done = aggregate_files(FEDAVG, [a, b], tmp_path / "m.h5")
    assert [s.site for s in done.result.report.sites] == ["a", "b"]
    same = [write(tmp_path, f"s{k}", 1.0, 1, site="h1") for k in range(2)]
    done = aggregate_files(FEDAVG, same, tmp_path / "m.h5")
    assert [s.site for s in done.result.report.sites] == ["h1 (s0.h5)", "h1 (s1.h5)"]


def test_round_model_as_specs_or_reference_file(tmp_path: Path) -> None:
    """The majority layout loses to the round's model, given as specs or as a file."""
    ref_update = Update({"w": np.zeros((4, 4), np.float32)}, num_examples=1)
    reference = write_weights(ref_update, tmp_path / "ref.h5")
    files = [write(tmp_path, "a", 1.0, 1), write(tmp_path, "b", 1.0, 1),
             write_weights(Update({"w": np.ones((4, 4), np.float32)}, num_examples=2, site="c"),
                           tmp_path / "c.h5")]
    by_file = aggregate_files(FEDAVG, files, tmp_path / "m.h5", reference=reference)
    by_specs = aggregate_files(FEDAVG, files, tmp_path / "n.h5",
                               expected=specs_of(ref_update.arrays))
    for done in (by_file, by_specs):
        assert [s.excluded for s in done.result.report.sites] == [True, True, False]
        assert "layout" in done.result.report.sites[0].reason


def test_bad_calls_are_named(tmp_path: Path) -> None:
    a = write(tmp_path, "a", 1.0, 1)
    with pytest.raises(AggregationError, match=r"one label per input.*Received: 2 labels for 1"):
        aggregate_files(FEDAVG, [a], tmp_path / "m.h5", labels=["x", "y"])
    with pytest.raises(AggregationError, match=r"not both"):
        aggregate_files(FEDAVG, [a], tmp_path / "m.h5", reference=a,
                        expected=specs_of(read_weights(a).arrays))
