"""One type per fact of a horizontal round (issue 34 item 2): the aggregation report and its site
lines (`protocol.aggregation_report.AggregationReport` / `SiteReport`) from the rules to the web view, a
hospital's round line (`SiteEntry`), typed selection, and the resumable run-config keys.

Files in tests/protocol/data/ named ``report-v1-*`` and ``history-v1-runhistory-*`` were written
by the code before these types were one (the aggregation dataclasses, the dict site entries and
the dict selection): they must load through the models, rewrite to the same JSON, and the code
now must write the same keys for the same inputs.
"""

from __future__ import annotations

import json
from pathlib import Path

import numpy as np
import pytest
from fedsplit.aggregation.files import aggregate_files
from fedsplit.protocol import Update, write_weights
from fedsplit.protocol.aggregation_report import AggregationReport, SiteReport
from fedsplit.protocol.config import RunConfig
from fedsplit.protocol.record.horizontal import Phase, RoundEntry, RunRecord, SiteEntry
from fedsplit.server.admin.auth import ADMIN, SITE, Principal
from fedsplit.server.admin.services import isolation
from fedsplit.server.admin.ui.siterows import rows_from_round
from fedsplit.server.history import RESUMABLE_CHANGES, RunHistory
from fedsplit.server.selection import round_score, select

from fedsplit import aggregation

DATA = Path(__file__).parent / "data"
REPORTS = ["report-v1-aggregate-files-krum-capped-layout.json",
           "report-v1-aggregate-files-trimmed-mean.json",
           "report-v1-runhistory-round-001.json",
           "report-v1-secure-strategy-as-built.json"]
HISTORY = "history-v1-runhistory-krum-late-short.json"


def raw(name: str) -> dict:
    return json.loads((DATA / name).read_text())


def updates(tmp: Path) -> list[Path]:
    """The inputs the ``report-v1-aggregate-files-*`` fixtures were written from."""
    def w(name: str, value: float, count: int, site: str) -> Path:
        arrays = {"w": np.full((2, 3), value, np.float32), "b": np.full(2, value, np.float32)}
        return write_weights(Update(arrays, num_examples=count, site=site, model="mlp"),
                             tmp / f"{name}.h5")

    files = [w("a", 1.0, 10, "h1"), w("b", 2.0, 30, "h2"), w("c", 3.0, 50, "h3"),
             w("d", 2.5, 20, "h4"), w("f", 1.5, 15, "h7")]
    odd = write_weights(Update({"w": np.zeros((4, 4), np.float32)}, num_examples=5, site="h5",
                               model="mlp"), tmp / "e.h5")
    return [*files, odd]


def test_the_rules_and_the_record_share_one_report_type() -> None:
    """What a rule builds is the run record's type: no second definition, no conversion."""
    assert aggregation.AggregationReport is AggregationReport
    assert aggregation.SiteReport is SiteReport
    import fedsplit.protocol.record.horizontal as horizontal

    assert not hasattr(horizontal, "ReportSite")


@pytest.mark.parametrize("name", REPORTS)
def test_reports_written_before_load_and_rewrite_unchanged(name: str) -> None:
    """A report file written by the old dataclasses reads as the model and writes the same JSON."""
    data = raw(name)
    report = AggregationReport.model_validate(data)
    assert report.to_json() == data
    assert all(isinstance(s, SiteReport) for s in report.sites)


@pytest.mark.parametrize(("strategy", "params", "files", "name"), [
    ("krum", {"f": 1}, 6, "report-v1-aggregate-files-krum-capped-layout.json"),
    ("trimmed-mean", {"beta": 0.25}, 5, "report-v1-aggregate-files-trimmed-mean.json"),
])
def test_a_rule_writes_the_report_it_wrote_before(tmp_path: Path, strategy: str, params: dict,
                                                  files: int, name: str) -> None:
    """Same inputs, same report file: every key (null ones included), the same values."""
    rule = aggregation.get_strategy(strategy, params)
    done = aggregate_files(rule, updates(tmp_path)[:files], tmp_path / "out.h5",
                           cohort_caps={"h3": 40}, cap_policy="clip")
    written = json.loads(done.report_path.read_text())
    assert written == raw(name)
    assert done.result.report.to_json() == written


def test_the_round_report_and_history_are_written_from_one_object(tmp_path: Path) -> None:
    """history.json's round ``aggregation`` and round-NNN.report.json are the rule's report."""
    rule = aggregation.get_strategy("krum", {"f": 1})
    done = aggregate_files(rule, updates(tmp_path), tmp_path / "agg.h5",
                           cohort_caps={"h3": 40}, cap_policy="clip")
    run = tmp_path / "run"
    run.mkdir()
    history = RunHistory(run, {"strategy": "krum"})
    history.set_model("mlp/classification/2/2/none")
    sites = [SiteEntry(site=s.site, num_examples=s.num_examples) for s in done.result.report.sites]
    history.record_train(1, done.result, sites, {})
    assert history.record.round(1).aggregation is done.result.report
    saved = json.loads((run / "history.json").read_text())["rounds"][0]["aggregation"]
    beside = json.loads((run / "models" / "round-001.report.json").read_text())
    assert saved == beside == done.result.report.to_json()
    assert set(beside["sites"][0]) == set(raw(REPORTS[2])["sites"][0])


def test_a_history_written_before_loads_and_keeps_its_selection() -> None:
    """history.json from the dict-writing coordinator: it round-trips, and typed selection over
    its rounds gives the selection the old code wrote."""
    data = raw(HISTORY)
    record = RunRecord.from_json(data)
    assert record.to_json() == data
    kept = select(record.rounds, "best-val", record.model_id)
    assert kept.to_json() == data["selection"]
    assert kept.rounds_kept == 1 and kept.val_metric[0].examples == 10
    train = record.round(1).train
    assert [s.late for s in train.sites if s.excluded] == [False, True]
    assert record.round(1).aggregation.site("h3").claimed_examples == 50


def test_selection_is_typed_and_ignores_rounds_without_a_model() -> None:
    """Rounds in, `Selection` out; a round that saved no model is not a candidate; ties go to
    the later round."""
    def scored(n: int, acc: float, model: bool = True) -> RoundEntry:
        return RoundEntry(round=n, model=f"models/round-{n:03d}.h5" if model else None,
                          evaluate=Phase(metrics={"accuracy": acc},
                                         sites=[SiteEntry(site="a", num_examples=3),
                                                SiteEntry(site="b", excluded=True)]))

    chosen = select([scored(3, 0.7), scored(1, 0.7), scored(2, 0.9, model=False)], "best-val",
                    "mlp/classification/2/2/none")
    assert chosen.rounds_kept == 3 and chosen.val_score == 0.7
    assert [(v.round, v.score, v.examples) for v in chosen.val_metric] == [(1, 0.7, 3), (3, 0.7, 3)]
    assert round_score(RoundEntry(round=2, evaluate=Phase(metrics={"accuracy": 0.5})),
                       "accuracy") == 0.5
    assert round_score(RoundEntry(round=1), "accuracy") is None


def test_the_web_view_rows_come_from_the_record_types() -> None:
    """A round of the old history: rows joined from its SiteEntry lines and its report lines."""
    entry = RunRecord.from_json(raw(HISTORY)).round(1)
    rows = {r.site: r for r in rows_from_round(entry.train.sites, entry.aggregation,
                                               entry.evaluate.sites)}
    assert rows["h2"].tags == ["replied", "selected"] and rows["h2"].weight == 1.0
    assert rows["h3"].tags == ["replied", "capped", "not selected"] and rows["h3"].claimed == 50
    assert rows["h5"].tags == ["excluded"] and "layout" in rows["h5"].reason
    assert rows["h6"].tags == ["late"]
    assert rows["h1"].eval_metrics == {"accuracy": 0.75}
    assert rows["h2"].epsilon == pytest.approx(0.4) and rows["h5"].epsilon is None


def test_a_hospital_sees_its_own_report_line_as_before() -> None:
    """The isolation rule reads the stored report through the model; the API keeps its keys."""
    stored = raw("report-v1-aggregate-files-krum-capped-layout.json")
    h3 = Principal(role=SITE, site_id=3, site_name="h3")
    admin = Principal(role=ADMIN)
    assert isolation.report_for(admin, stored) == stored
    seen = isolation.report_for(h3, stored, ["h1", "h2", "h3", "h4", "h5", "h7"])
    assert seen == {"strategy": "krum", "params": {"f": 1},
                    "sites": [{k: v for k, v in stored["sites"][2].items()
                               if k in isolation.OWN_REPORT_KEYS}]}
    typed = isolation.visible_report(h3, stored)
    assert typed is not None and typed.num_examples is None and typed.sites[0].weight is None
    assert isolation.shares_in_model(stored) == {"h2": 1.0}
    assert isolation.shares_in_model(AggregationReport.model_validate(stored)) == {"h2": 1.0}
    assert isolation.shares_in_model({"sites": "not a list"}) == {}


def test_resumable_keys_are_declared_once_on_the_run_config() -> None:
    """The resume check's keys come from RunConfig.RESUMABLE (the same keys as before)."""
    assert RESUMABLE_CHANGES == RunConfig.resumable_keys() == frozenset(
        {"num-server-rounds", "round-timeout", "resume", "quorum", "min-nodes", "device", "keep",
         "min-count", "site-roster"})
    assert set(RunConfig.RESUMABLE) <= set(RunConfig.model_fields)
    server = Path(__file__).parents[2] / "server"
    assert not [p for p in server.rglob("*.py") if '"min-count"' in p.read_text()]
