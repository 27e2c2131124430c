"""Survival columns: what is read, what is refused (with counts and the fix), and the bundled
Fed-TCGA-BRCA with FLamby's split."""

from __future__ import annotations

import numpy as np
import pandas as pd
import pytest
from fedsplit.client.survival.tcga import REGIONS, load_tcga_brca
from fedsplit.protocol.survival import (
    SurvivalDataError,
    check_hospitals,
    decode_fixed,
    encode_fixed,
    read_survival,
)


def frame(times, events):
    return pd.DataFrame({"t": [str(v) for v in times], "e": [str(v) for v in events],
                         "age": ["50"] * len(times)})


def test_event_words_and_numbers_read_alike():
    t, e = read_survival("a", frame([3, 1.5, "7", 2, 9, 4], ["1", "TRUE", "yes", "0", "no", "False"]),
                         "t", "e")
    assert t.tolist() == [3, 1.5, 7, 2, 9, 4]
    assert e.tolist() == [True, True, True, False, False, False]


def test_bad_rows_are_counted_per_hospital_and_nothing_is_dropped():
    frames = {"north": frame(["", "0", "-2", "5", "6"], ["1", "1", "0", "maybe", ""]),
              "south": frame(["4", "abc", "3", "2"], ["1", "0", "1", "0"]),
              "fine": frame([1, 2, 3], [1, 0, 1])}
    with pytest.raises(SurvivalDataError) as err:
        check_hospitals(frames, "t", "e")
    text = str(err.value)
    assert "north: 1 row(s) have no time" in text
    assert "north: 2 row(s) have a time <= 0" in text
    assert "['maybe'] in 1 row(s)" in text and "north: 1 row(s) have no value in event" in text
    assert "south: time column 't' holds text in 1 row(s) (e.g. ['abc'])" in text
    assert "fine" not in text.split("Received")[0]
    assert "north: 3 bad time, 2 bad event of 5 rows" in text
    assert "drop those rows" in text and "1/0, TRUE/FALSE or yes/no" in text


def test_hospital_without_events_or_with_one_time_is_refused():
    with pytest.raises(SurvivalDataError, match="no patient has an event"):
        read_survival("x", frame([1, 2, 3], [0, "no", "FALSE"]), "t", "e")
    with pytest.raises(SurvivalDataError, match="every time in 't' is the same"):
        read_survival("x", frame([5, 5, 5], [1, 0, 1]), "t", "e")


def test_missing_columns_named():
    with pytest.raises(SurvivalDataError, match=r"no event column .status..*--event"):
        read_survival("x", frame([1, 2], [1, 0]), "t", "status")
    with pytest.raises(SurvivalDataError, match="two different columns"):
        read_survival("x", frame([1, 2], [1, 0]), "t", "t")


def test_fixed_point_sums_are_exact_to_2e_10():
    rng = np.random.default_rng(1)
    parts = [rng.normal(scale=1e3, size=50) for _ in range(5)]
    total = np.zeros(50, dtype=np.int64)
    for p in parts:
        total = (total + encode_fixed(p, 5)) & np.int64((1 << 62) - 1)
    assert np.max(np.abs(decode_fixed(total) - np.sum(parts, axis=0))) < 5 * 2.0 ** -33
    with pytest.raises(Exception, match="fixed-point range"):
        encode_fixed(np.array([1e12]), 5)


def test_tcga_brca_has_flamby_split():
    data = load_tcga_brca()
    assert tuple(data) == REGIONS
    sizes = [(len(tr), len(te)) for tr, te in data.values()]
    assert sizes == [(248, 63), (156, 40), (164, 42), (129, 33), (129, 33), (40, 11)]
    train, _test = data["northeast"]
    assert len(train.columns) == 42 and {"pid", "E", "T"} <= set(train.columns)
    all_rows = pd.concat([pd.concat(p) for p in data.values()])
    assert all_rows["pid"].is_unique and len(all_rows) == 1088
    checked = check_hospitals({k: v[0] for k, v in data.items()}, "T", "E")
    events = sum(int(e.sum()) for _, e in checked.values())
    assert 0 < events < 866
    # FLamby's day-0 censored patients are kept, at day 0.5, censored
    zero = all_rows[all_rows["T"] == "0.5"]
    assert len(zero) == 12 and set(zero["E"]) == {"0.0"}
