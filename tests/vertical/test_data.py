"""Site tables: imputation and scaling fitted on training rows only; categorical columns."""

from __future__ import annotations

from pathlib import Path

import numpy as np
import pandas as pd
from fedsplit.client.vertical.data import Preprocessor
from fedsplit.orchestration.vertical.local import local_coordinator
from fedsplit.protocol.vertical.config import FusionParams
from fedsplit.server.vertical.coordinator import encode_labels


def test_preprocessor_uses_only_the_rows_it_is_fitted_on() -> None:
    train = pd.DataFrame({"age": [20.0, np.nan, 40.0, 30.0], "sex": ["m", "f", None, "f"]})
    prep = Preprocessor.fit(train)
    assert prep.medians == [30.0]
    assert prep.modes == ["f"]
    held_out = pd.DataFrame({"age": [np.nan, 1000.0], "sex": [None, "unseen"]})
    x = prep.transform(held_out)
    names = prep.feature_names
    assert names == ["age", "sex=f", "sex=m", "sex=<other>"]
    assert x[0, 0] == 0.0  # missing age -> training median 30 -> (30 - mean 30) / std
    assert list(x[0, 1:]) == [1.0, 0.0, 0.0]  # missing sex -> training mode "f"
    assert list(x[1, 1:]) == [0.0, 0.0, 1.0]  # unseen category -> other


def test_site_statistics_come_from_training_rows_only(tmp_path: Path) -> None:
    n = 40
    ids = [f"p{i}" for i in range(n)]
    values = np.arange(n, dtype=float)
    values[::5] = np.nan
    pd.DataFrame({"pid": ids, "v": values}).to_csv(tmp_path / "site.csv", index=False)
    labels = encode_labels(ids, np.array([i % 2 for i in range(n)]), None)
    params = FusionParams(embedding_dim=2, steps_per_round=1)
    coord, transport = local_coordinator(labels, [tmp_path / "site.csv"], "pid", params, test_fraction=0.25)
    coord.align()
    coord.prepare()
    state = transport.states[0]
    import json

    prep = json.loads(state.config["prep"])
    train_ids = [ids[r] for r in coord.train_rows]
    expected = pd.Series([values[ids.index(i)] for i in train_ids]).median()
    everything = pd.Series(values).median()
    assert prep["medians"] == [expected]
    assert len(coord.train_rows) + len(coord.test_rows) == n
    assert expected != everything or len(coord.test_rows) == 0  # the split changes the median here


def test_preprocessing_does_not_depend_on_row_order(rng: np.random.Generator) -> None:
    frame = pd.DataFrame({"ticket": [f"T{i % 37}" for i in range(60)] + [None] * 3})
    a = Preprocessor.fit(frame)
    b = Preprocessor.fit(frame.sample(frac=1.0, random_state=3).reset_index(drop=True))
    assert a == b
