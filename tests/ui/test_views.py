"""View-models of the web view without a server: hospital statuses, run discovery, curves, SVG."""

from __future__ import annotations

import json
import os
import xml.etree.ElementTree as ET
from pathlib import Path

import pytest
from fedsplit.protocol.aggregation_report import AggregationReport, SiteReport
from fedsplit.protocol.errors import ConfigError
from fedsplit.protocol.record.horizontal import SiteEntry
from fedsplit.server.admin.ui import check_runs_dirs, view_url
from fedsplit.server.admin.ui.activity import summary_line
from fedsplit.server.admin.ui.charts import Series, line_chart
from fedsplit.server.admin.ui.curves import primary_metric, privacy_of, run_charts
from fedsplit.server.admin.ui.runs import MAX_DEPTH, RunCatalog, discover, load_run, run_id_of
from fedsplit.server.admin.ui.siterows import rows_from_round

from tests.ui.rundata import HOSTILE, write_hostile_run


def test_every_hospital_status_is_derived_from_history_and_report(tmp_path: Path) -> None:
    """Selected, not selected, capped, excluded with its reason, late and failed, each on its row."""
    run = load_run("r", write_hostile_run(tmp_path / "r"))
    assert run is not None
    rows = {row.site: row for row in run.round(1).rows}
    assert rows["hospital-a"].tags == ["replied", "selected"] and rows["hospital-a"].used
    assert rows["hospital-a"].weight == 1.0 and rows["hospital-a"].l2 == 0.0
    assert rows["hospital-b"].tags == ["replied", "not selected"] and not rows["hospital-b"].used
    assert rows["hospital-b"].score == 9.0
    assert rows[HOSTILE].tags == ["replied", "capped", "not selected"]
    assert (rows[HOSTILE].num_examples, rows[HOSTILE].claimed) == (50, 80)
    assert rows["hospital-c"].tags == ["excluded"] and "NaN" in rows["hospital-c"].reason
    assert rows["hospital-d"].tags == ["late"] and "round-timeout" in rows["hospital-d"].reason
    assert rows["hospital-e"].tags == ["failed"] and "CUDA" in rows["hospital-e"].reason
    assert rows["hospital-a"].eval_metrics == {"accuracy": pytest.approx(0.85)}
    assert rows["hospital-a"].epsilon == pytest.approx(0.4)
    assert [r.site for r in run.round(1).used] == ["hospital-a"]
    assert [r.site for r in run.round(1).returned] == [HOSTILE, "hospital-a", "hospital-b"]
    assert summary_line("round", 1, run.round(1).rows) == (
        "round 1 aggregated: 3 of 6 hospitals returned, hospital-c excluded, hospital-d late, "
        "hospital-e failed; 1 used, 2 not selected")
    assert run.round(3).error and "quorum" in run.round(3).error and not run.round(3).has_model


def test_trimmed_share_is_a_status() -> None:
    """A median/trimmed-mean report's trimmed_fraction > 0 tags the row 'trimmed'."""
    rows = rows_from_round(
        [SiteEntry(site="a", num_examples=3), SiteEntry(site="b", num_examples=4)],
        AggregationReport(sites=[
            SiteReport(site="a", num_examples=3, weight=0.5, trimmed_fraction=0.25),
            SiteReport(site="b", num_examples=4, weight=0.5, trimmed_fraction=0.0)]),
    )
    assert [r.tags for r in rows] == [["replied", "trimmed"], ["replied"]]
    assert rows[0].trimmed_fraction == 0.25


def test_runs_are_found_below_each_folder_bounded_in_depth(tmp_path: Path) -> None:
    """Out-dirs and folders of them; bulky folders skipped; nothing deeper than MAX_DEPTH."""
    write_hostile_run(tmp_path / "a")
    write_hostile_run(tmp_path / "group" / "b")
    (tmp_path / "a" / "flower" / "x").mkdir(parents=True)
    (tmp_path / "a" / "flower" / "x" / "history.json").write_text("{}")  # inside a skipped folder
    deep = tmp_path.joinpath(*["d"] * (MAX_DEPTH + 1))
    deep.mkdir(parents=True)
    (deep / "history.json").write_text("{}")
    names = [name for name, _ in discover([tmp_path])]
    root = tmp_path.name
    assert names == [f"{root}/a/federation", f"{root}/group/b/federation"]
    # a run folder given directly is found too, and ids are stable 12-hex digests of the path
    assert [n for n, _ in discover([tmp_path / "a" / "federation"])] == ["federation"]
    assert run_id_of(tmp_path / "a" / "federation") == run_id_of(tmp_path / "a" / "x" / ".." / "federation")
    assert discover([tmp_path / "missing"]) == []


def test_catalog_skips_unreadable_history_and_rereads_changed_files(tmp_path: Path) -> None:
    """A broken history.json is left out; a rewritten one is read again."""
    fed = write_hostile_run(tmp_path / "ok")
    (tmp_path / "bad").mkdir()
    (tmp_path / "bad" / "history.json").write_text("{not json")
    catalog = RunCatalog([tmp_path])
    runs = catalog.runs()
    assert [r.name for r in runs] == [f"{tmp_path.name}/ok/federation"]
    data = json.loads((fed / "history.json").read_text())
    data["status"] = "running"
    (fed / "history.json").write_text(json.dumps(data))
    os.utime(fed / "history.json", (1e9, 2e9))
    assert catalog.get(runs[0].run_id).status == "running"


def test_curves_have_baselines_per_hospital_lines_and_privacy(tmp_path: Path) -> None:
    """Global metric against centralized and single-site baselines; epsilon against the budget."""
    run = load_run("r", write_hostile_run(tmp_path / "r"))
    assert primary_metric(run) == "accuracy"
    charts = {c.title: c for c in run_charts(run)}
    glob = charts["Global accuracy per round"]
    assert [label for label, _, _ in glob.legend] == [
        "federated, held-out test split", "federated evaluation on the hospitals' held-out rows",
        "centralized (pooled data)", "hospital-a alone", "hospital-b alone"]
    assert "Privacy spent (epsilon) per hospital" in charts
    privacy = privacy_of(run)
    assert privacy.budget == 2.0 and privacy.spent["hospital-a"] == pytest.approx(0.8)
    assert privacy.left["hospital-a"] == pytest.approx(1.2)
    # a hospital's own view: its own lines only, no centralized baseline
    mine = {c.title: c for c in run_charts(run, {"hospital-a"})}
    labels = [label for c in mine.values() for label, _, _ in c.legend]
    assert "hospital-b" not in labels and "hospital-b alone" not in labels
    assert "centralized (pooled data)" not in labels
    assert privacy_of(run, {"hospital-b"}).spent == {"hospital-b": pytest.approx(1.0)}


def test_svg_is_valid_xml_and_escapes_labels() -> None:
    """Untrusted hospital names become text, never markup."""
    chart = line_chart("t<1>", [Series(HOSTILE, [(1, 0.5), (2, 0.75), (3, float("nan"))])],
                       baselines=[Series("base", [(1, 0.6), (3, 0.6)])])
    assert chart is not None and "<script>" not in chart.svg
    root = ET.fromstring(str(chart.svg))
    titles = [e.text for e in root.iter("{http://www.w3.org/2000/svg}title")]
    assert HOSTILE in titles and "t<1>" in titles
    assert len(list(root.iter("{http://www.w3.org/2000/svg}polyline"))) == 2
    assert line_chart("empty", [Series("a", [])]) is None


def test_runs_dirs_check_and_view_url(tmp_path: Path) -> None:
    """--runs refuses a file, keeps a missing folder with a note; the printed URL is /ui."""
    notes: list[str] = []
    (tmp_path / "f").write_text("x")
    with pytest.raises(ConfigError, match="Received: the file"):
        check_runs_dirs([tmp_path / "f"], warn=notes.append)
    assert check_runs_dirs([tmp_path / "later"], warn=notes.append) == [(tmp_path / "later").resolve()]
    assert "does not exist yet" in notes[0]
    assert view_url("0.0.0.0", 8080) == "http://127.0.0.1:8080/ui"
    assert view_url("::1", 9) == "http://[::1]:9/ui"
