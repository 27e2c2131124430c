"""Hospitals whose columns differ are refused in one line naming the odd one(s) out against the
majority and both sides of each difference, or, without a majority, each side (issue 41,
item 2): any number of hospitals, several renamed, missing or extra columns, a renamed target."""

from __future__ import annotations

import pytest
from fedsplit.protocol.column_sets import check_same_columns, check_table_columns
from fedsplit.protocol.errors import ConfigError
from fedsplit.protocol.schema import TableSettings, column_report, merge_reports

BREAST = ["mean_radius", "texture", "age", "target"]


def refusal(columns: dict[str, list[str]], **kw) -> str:
    with pytest.raises(ConfigError) as err:
        check_same_columns(columns, **kw)
    text = str(err.value)
    assert "\n" not in text and text.count("Received: ") == 1, text
    return text


def test_the_hospital_that_renamed_a_column_is_named_with_both_sides() -> None:
    east = ["radius_mean", "texture", "age", "target"]
    for order in (["north", "south", "east"], ["east", "north", "south"]):  # not by arrival
        cols = {"north": BREAST, "south": BREAST[::-1], "east": east}
        text = refusal({s: cols[s] for s in order})
        assert text.startswith("The hospitals' columns differ: Hospital east differs from the "
                               "majority (north, south): east lacks 'mean_radius' and has "
                               "'radius_mean' (renamed?)."), text
        assert "north lacks" not in text and "south lacks" not in text
        assert text.endswith("Received: east lacks ['mean_radius'] has ['radius_mean']")


def test_same_columns_in_any_order_pass() -> None:
    check_same_columns({"a": BREAST, "b": BREAST[::-1], "c": BREAST[1:] + BREAST[:1]})
    check_same_columns({"only": BREAST})


def test_several_hospitals_several_differences() -> None:
    """Five hospitals: one renamed two columns, one lost a column, one added one."""
    cols = {"a": BREAST, "b": BREAST,
            "c": ["radius_mean", "texture_mean", "age", "target"],
            "d": ["mean_radius", "texture", "target"],
            "e": [*BREAST, "ward"]}
    text = refusal(cols)
    assert "Hospitals c, d, e differ from the majority (a, b)" not in text  # a, b: 2 of 5
    assert "Hospitals c, d, e differ from a, b: " in text
    assert ("c lacks 'mean_radius', 'texture' and has 'radius_mean', 'texture_mean' (renamed?); "
            "d lacks 'age'; e has 'ward'") in text
    assert "--ignore-column NAME" in text


def test_no_majority_says_so_and_lists_each_side() -> None:
    two = refusal({"north": BREAST, "east": ["radius_mean", "texture", "age", "target"]})
    assert ("no majority (2 hospitals, half on each side) for 'mean_radius' at north but not "
            "at east; 'radius_mean' at east but not at north") in two
    four = refusal({"n": BREAST, "s": BREAST, "e": ["radius_mean", *BREAST[1:]],
                    "w": ["radius_mean", *BREAST[1:]]})
    assert ("no majority (4 hospitals, half on each side) for 'mean_radius' at n, s but not at "
            "e, w; 'radius_mean' at e, w but not at n, s") in four
    dropped = refusal({"a": BREAST, "b": BREAST[1:]})
    assert "'mean_radius' at a but not at b" in dropped
    assert "--ignore-column mean_radius" in dropped


def test_a_renamed_target_is_the_odd_one_even_where_most_renamed_it() -> None:
    """The run names the target: the hospitals without it are odd, however many they are."""
    renamed = ["mean_radius", "texture", "age", "outcome"]
    target = {"target": "the target, --target"}
    one = refusal({"north": BREAST, "south": BREAST, "east": renamed}, named=target)
    assert ("Hospital east differs from the majority (north, south): east lacks 'target' (the "
            "target, --target) and has 'outcome' (renamed?)") in one
    assert "--ignore-column" not in one  # leaving out the rename would not bring the target
    most = refusal({"north": BREAST, "south": renamed, "east": renamed}, named=target)
    assert "Hospitals south, east differ from north: south lacks 'target' (the target" in most
    # the survival columns and the ID column are named by their own options
    settings = TableSettings(target="time", event="event", id_column="id",
                             ignore_columns=("notes",))
    with pytest.raises(ConfigError, match=r"Hospital c differs from the majority \(a, b\): c "
                                          r"lacks 'id' \(the ID column, --id-column\), 'event' "
                                          r"\(the event column, --event\) and has 'status'"):
        check_table_columns({"a": ["id", "time", "event", "x"], "b": ["x", "event", "time", "id"],
                             "c": ["time", "status", "x", "notes"]}, settings)


def test_many_hospitals_are_named_up_to_five() -> None:
    cols = {f"h{i:02d}": BREAST for i in range(12)}
    cols.update({f"odd{i}": BREAST[1:] for i in range(7)})
    text = refusal(cols)
    assert "Hospitals odd0, odd1, odd2, odd3, odd4 and 2 more differ from the majority (h00, " \
           "h01, h02, h03, h04 and 7 more)" in text
    assert len(text) < 1200


def test_the_coordinators_merge_names_the_odd_hospital() -> None:
    """The schema exchange of a real federation (merge_reports over the column reports)."""
    import pandas as pd

    settings = TableSettings(target="target")
    rows = {"mean_radius": ["12.1", "13.4"] * 5, "age": ["50", "61"] * 5, "target": ["0", "1"] * 5}
    frames = {"north": pd.DataFrame(rows), "south": pd.DataFrame(rows),
              "east": pd.DataFrame(rows).rename(columns={"mean_radius": "radius_mean"})}
    reports = [column_report(n, f, settings) for n, f in frames.items()]
    with pytest.raises(ConfigError, match=r"Hospital east differs from the majority \(north, "
                                          r"south\): east lacks 'mean_radius' and has "
                                          r"'radius_mean' \(renamed\?\)"):
        merge_reports(reports, settings)
