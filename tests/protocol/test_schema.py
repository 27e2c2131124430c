"""The table schema: per-site column reports, the merge (conflicts, warnings, withheld rare
categories), the versioned JSON form and the encoding every site and `predict` use."""

from __future__ import annotations

import json

import numpy as np
import pandas as pd
import pytest
from fedsplit.protocol.errors import ConfigError
from fedsplit.protocol.schema import (
    Schema,
    SiteColumns,
    TableSettings,
    column_report,
    encode_frame,
    merge_reports,
    moment_warnings,
)
from fedsplit.protocol.stats import moments

SETTINGS = TableSettings(target="y", id_column="pid", min_category_count=3)


def hospital(n: int, *, sex: list[str] | None = None, chol: list | None = None, seed: int = 0,
             **extra: list) -> pd.DataFrame:
    """A raw hospital table as text cells, the way a CSV export reads."""
    rng = np.random.default_rng(seed)
    frame = pd.DataFrame({
        "pid": [str(1000 + i) for i in range(n)],
        "age": [str(a) for a in rng.integers(30, 80, n)],
        "sex": sex or list(rng.choice(["Male", "Female"], n)),
        "fbs": list(rng.choice(["TRUE", "FALSE", ""], n)),
        "chol": [str(c) for c in (chol if chol is not None else rng.integers(150, 300, n))],
        "y": [str(v) for v in rng.integers(0, 2, n)],
    })
    for key, values in extra.items():
        frame[key] = values
    return frame


def test_kinds_missing_markers_and_any_column_order_merge_into_one_schema() -> None:
    """Numbers, booleans in any case, text and the usual missing markers are recognised; two
    hospitals with their columns in different orders agree on one schema."""
    # Prepare
    a = hospital(20, seed=1)
    a.loc[0, "age"], a.loc[1, "age"], a.loc[2, "fbs"] = "?", "NaN", "yes"
    b = hospital(20, seed=2)[["y", "chol", "fbs", "sex", "age", "pid"]]
    b.loc[3, "chol"] = "null"
    # Execute
    reports = [column_report("a", a, SETTINGS), column_report("b", b, SETTINGS)]
    merged = merge_reports(reports, SETTINGS)
    # Assert
    kinds = {c.name: c.kind for c in reports[0].columns}
    assert kinds == {"age": "numeric", "sex": "categorical", "fbs": "boolean", "chol": "numeric"}
    assert next(c for c in reports[0].columns if c.name == "age").missing == 2
    schema = merged.schema
    assert schema.feature_names == ["age", "age:missing", "sex=Female", "sex=Male", "fbs",
                                    "fbs:missing", "chol", "chol:missing"]
    assert schema.task == "classification" and schema.labels == ("0", "1")
    x, y = encode_frame(schema, b, where="b")
    x_a, _ = encode_frame(schema, a, where="a")
    assert x.shape == (20, 8) and y is not None and set(y) <= {0, 1}
    assert np.isnan(x_a[0, 0]) and x_a[0, 1] == 1.0 and x_a[2, 4] == 1.0  # '?' missing, 'yes' true
    assert np.isnan(x[3, 6]) and x[3, 7] == 1.0
    # the ID column is never a feature and never in a report
    assert "pid" not in [c.name for c in reports[0].columns]


def test_rare_categories_are_withheld_and_fall_back_to_missing() -> None:
    """A category held by fewer than min-category-count rows is not named in the report; its
    rows (and any unseen category) encode as all-zero one-hot with the missing indicator set."""
    # Prepare: 'Other' twice at site a (withheld with min count 3), never at site b
    a = hospital(12, sex=["Male"] * 5 + ["Female"] * 5 + ["Other"] * 2)
    b = hospital(12, sex=["Male"] * 6 + ["Female"] * 6, seed=3)
    # Execute
    report = column_report("a", a, SETTINGS)
    merged = merge_reports([report, column_report("b", b, SETTINGS)], SETTINGS)
    # Assert
    sex = next(c for c in report.columns if c.name == "sex")
    assert sex.categories == {"Female": 5, "Male": 5} and sex.withheld == 1
    assert "Other" not in report.to_json()
    assert any("rare categories withheld" in w and "sex at a (1)" in w for w in merged.warnings)
    col = next(c for c in merged.schema.columns if c.name == "sex")
    assert col.categories == ("Female", "Male") and col.missing_indicator
    x, _ = encode_frame(merged.schema, a.assign(sex=["Martian", *a.sex[1:]]), where="a")
    names = merged.schema.feature_names
    sex_cols = [names.index("sex=Female"), names.index("sex=Male")]
    assert x[0, sex_cols].tolist() == [0.0, 0.0] and x[0, names.index("sex:missing")] == 1.0
    assert x[10, sex_cols].tolist() == [0.0, 0.0]  # the withheld 'Other' rows: the same fallback


@pytest.mark.parametrize(("change", "named"), [
    (lambda f: f.drop(columns=["chol"]),  # two hospitals: no majority, each side named
     r"no majority \(2 hospitals.*'chol' at a but not at b.*--ignore-column chol"),
    (lambda f: f.assign(extra="1"), r"no majority .*'extra' at b but not at a"),
    (lambda f: f.assign(chol=["high"] * len(f)),
     r"Column 'chol' holds text at b \(e\.g\. 'high'\) but numbers.*at a.*--na-values"),
    (lambda f: f.assign(fbs=["7"] * len(f)), r"Column 'fbs' holds booleans.*numbers other than 0/1 at b"),
    (lambda f: f.assign(y=["sick"] * 5 + ["well"] * (len(f) - 5)), r"label sets differ"),
])
def test_conflicts_name_the_hospital_the_column_and_the_fix(change, named) -> None:
    """A column absent at a site, text against numbers, booleans against counts, other labels."""
    a, b = hospital(15, seed=1), change(hospital(15, seed=2))
    with pytest.raises(ConfigError, match=named):
        merge_reports([column_report("a", a, SETTINGS), column_report("b", b, SETTINGS)], SETTINGS)


def test_text_labels_shared_by_no_other_hospital_are_refused() -> None:
    """Two hospitals writing different label words: the sets share nothing, so they differ."""
    a = hospital(10, seed=1).assign(y=["positive"] * 5 + ["negative"] * 5)
    b = hospital(10, seed=2).assign(y=["sick"] * 5 + ["well"] * 5)
    with pytest.raises(ConfigError, match=r"Hospital a's labels.*share none.*label sets differ"):
        merge_reports([column_report("a", a, SETTINGS), column_report("b", b, SETTINGS)], SETTINGS)


def test_suspicious_columns_are_warned_about() -> None:
    """Constant at one site (cholesterol 0 for every patient), entirely missing at one site, and
    values a hundred times the others' (another unit) are flagged, not refused."""
    # Prepare
    a = hospital(20, seed=1)
    swiss = hospital(20, chol=[0] * 20, seed=2)
    b = hospital(20, seed=3, sodium=[""] * 20)
    a["sodium"], swiss["sodium"] = [str(v) for v in range(130, 150)], ["140"] * 20
    units = hospital(20, seed=4, sodium=[str(v * 1000) for v in range(130, 150)])
    frames = {"a": a, "b": b, "switzerland": swiss, "units": units}
    reports = [column_report(k, v, SETTINGS) for k, v in frames.items()]
    # Execute
    merged = merge_reports(reports, SETTINGS)
    x = {k: encode_frame(merged.schema, v, where=k)[0] for k, v in frames.items()}
    warnings = merged.warnings + moment_warnings(merged.schema, {k: moments(v) for k, v in x.items()})
    # Assert
    text = "\n".join(warnings)
    assert "column 'sodium' is entirely missing at b" in text
    assert "column 'chol' is constant at switzerland (0 in all 20 rows)" in text
    assert "column 'sodium' at units is about" in text and "another unit" in text
    assert "column 'chol' is constant at a" not in text


def test_the_schema_round_trips_and_the_strict_reader_refuses_others() -> None:
    """Same schema, same JSON and digest; unknown fields and other versions are refused."""
    merged = merge_reports([column_report("a", hospital(10), SETTINGS)], SETTINGS)
    text = merged.schema.to_json()
    again = Schema.from_json(text)
    assert again == merged.schema and again.digest() == merged.schema.digest()
    raw = json.loads(text)
    for bad, named in (({**raw, "version": 2}, "version 2"), ({**raw, "rows": [1]}, "rows"),
                       ({**raw, "format": "x"}, "format")):
        with pytest.raises(ConfigError, match=named):
            Schema.from_json(json.dumps(bad))
    report = json.loads(column_report("a", hospital(10), SETTINGS).to_json())
    report["columns"][0]["values"] = ["41", "52"]
    with pytest.raises(ConfigError, match="undocumented fields"):
        SiteColumns.from_json(json.dumps(report))


def test_regression_targets_and_wrong_kinds_at_encoding() -> None:
    """A continuous target makes a regression schema; a mistyped value is refused by name."""
    frame = hospital(30).assign(y=[f"{v:.2f}" for v in np.linspace(1, 9, 30)])
    schema = merge_reports([column_report("a", frame, SETTINGS)], SETTINGS).schema
    assert schema.task == "regression" and schema.labels == ()
    _, y = encode_frame(schema, frame, where="a")
    assert y is not None and y.dtype == np.float32 and y[-1] == pytest.approx(9.0)
    with pytest.raises(ConfigError, match=r"column 'age' must hold numbers; 'old' is not"):
        encode_frame(schema, frame.assign(age=["old"] * 30), where="a")
    with pytest.raises(ConfigError, match="task=classification needs class labels"):
        merge_reports([column_report("a", frame, SETTINGS)], SETTINGS, task="classification")


def test_a_per_column_missing_marker_applies_to_that_column_only() -> None:
    """--na-values chol=0: a cholesterol of 0 (or 0.0) is missing; a 0 elsewhere stays a 0."""
    settings = TableSettings(target="y", na_values=("chol=0", "unknown"))
    frame = hospital(6, chol=["0", "0.0", "210", "unknown", "180", "0"]).assign(
        age=["0", "50", "unknown", "61", "70", "45"], y=["1"] * 6)  # no label rarer than 5 rows
    report = column_report("a", frame, settings)
    counts = {c.name: c.missing for c in report.columns}
    assert counts["chol"] == 4 and counts["age"] == 1  # age 0 stays, 'unknown' is missing
    schema = merge_reports([report], settings).schema
    x, _ = encode_frame(schema, frame, where="a")
    names = schema.feature_names
    assert x[0, names.index("age")] == 0.0 and x[1, names.index("chol:missing")] == 1.0
