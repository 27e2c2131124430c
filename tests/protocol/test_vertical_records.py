"""Vertical and survival run records, typed end to end (issue 34, item 2).

``data/vertical-simulate-*`` were written by ``fedsplit vertical simulate`` before its writers
built the protocol models (``-history``: the coordinator's ``federation/history.json``;
``-summary``: ``summary.json``; ``-head``: ``federation/head/head.json``; ``-site``: a site's
``site.json``): breast-cancer, 2 sites, 2 rounds x 4 steps, ``--overlap 0.8`` (rows some site
lacks: ``metrics_complete_rows``), and diabetes (regression), 3 sites, ``--keep last`` (no
validation rows: ``val_metric`` of None). ``km-status-v1.json`` is ``fedsplit km``'s status file
(tcga-brca); ``*-pre-kind*.json`` are what the survival app wrote before ``kind`` existed.
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import pytest
from fedsplit.orchestration.vertical.experiment import summarize
from fedsplit.orchestration.vertical.local import Baselines
from fedsplit.protocol.errors import ConfigError
from fedsplit.protocol.record.kinds import load_run_record, run_kind
from fedsplit.protocol.record.survival import SurvivalAnalysisRecord
from fedsplit.protocol.record.vertical import (
    ArrayShape,
    VerticalRunRecord,
    VerticalScores,
    VerticalSummary,
)
from fedsplit.protocol.vertical.config import FusionParams
from fedsplit.protocol.vertical.saved import HeadMeta, SiteModelMeta

DATA = Path(__file__).parent / "data"
HISTORIES = ["vertical-simulate-history-v1.json",
             "vertical-simulate-keep-last-regression-history-v1.json"]
SUMMARIES = ["vertical-simulate-summary-v1.json",
             "vertical-simulate-keep-last-regression-summary-v1.json"]


def raw(name: str) -> dict[str, Any]:
    return json.loads((DATA / name).read_text())


@pytest.mark.parametrize("name", HISTORIES)
def test_a_vertical_history_written_before_the_models_loads_typed_and_writes_back_unchanged(
        name: str, tmp_path: Path) -> None:
    record = load_run_record(DATA / name)
    assert isinstance(record, VerticalRunRecord) and run_kind(raw(name)) == "vertical"
    assert record.overlap and all(o.share_of_labels is not None and o.share_of_labels > 0.8
                                  for o in record.overlap)
    assert record.inventory is not None
    shape = record.inventory["train.step from-site"].arrays["embeddings"]
    assert shape == ArrayShape(dtype="float32", width=[16])
    kept = record.kept_round()
    assert kept is not None and kept.complete_rows is not None
    assert kept.complete_rows < (kept.num_examples or 0)  # some held-out rows lack a site
    assert kept.metrics_complete_rows is not None
    record.save(tmp_path / "history.json")
    assert json.loads((tmp_path / "history.json").read_text()) == raw(name)


@pytest.mark.parametrize("name", SUMMARIES)
def test_a_vertical_summary_written_before_the_models_loads_typed_and_writes_back_unchanged(
        name: str, tmp_path: Path) -> None:
    summary = VerticalSummary.load(DATA / name)
    assert summary.federated is not None and summary.centralized is not None
    assert summary.federated.model is not None and summary.federated.model.endswith("head")
    assert summary.test_examples == summary.federated.num_examples
    assert [s.site for s in summary.local_only] == [f"site-{i}" for i in range(summary.sites or 0)]
    for baseline in [summary.centralized, *summary.local_only]:
        assert baseline.per_round is not None and len(baseline.per_round) == len(summary.rounds)
    assert [o.site for o in summary.overlap] == [s.site for s in summary.local_only]
    summary.save(tmp_path / "summary.json")
    assert json.loads((tmp_path / "summary.json").read_text()) == raw(name)


@pytest.mark.parametrize(("history", "summary"), list(zip(HISTORIES, SUMMARIES, strict=True)))
def test_the_summary_writer_rebuilds_todays_summary_from_todays_history(history: str,
                                                                        summary: str) -> None:
    """`summarize` (what ``fedsplit vertical simulate`` saves) gives the file the code before
    it wrote, key for key and value for value, from that run's history and baselines."""
    old = VerticalSummary.load(DATA / summary)
    assert old.centralized is not None and old.federated is not None
    assert old.federated.model is not None and old.federated.seconds is not None
    new = summarize(VerticalRunRecord.load(DATA / history), Path(old.federated.model).parent,
                    params=FusionParams.parse(old.params), dataset=raw(summary)["dataset"],
                    sites=old.sites or 0,
                    base=Baselines(local_only=old.local_only, centralized=old.centralized),
                    seconds=old.federated.seconds)
    assert new.to_json() == raw(summary)


def test_a_history_without_a_kept_round_is_refused_by_the_summary_writer() -> None:
    record = VerticalRunRecord.load(DATA / HISTORIES[0])
    record.selection = None
    with pytest.raises(ConfigError, match="no selection"):
        summarize(record, Path("/x/federation"), params=FusionParams(), dataset="d", sites=2,
                  base=Baselines(local_only=[], centralized=VerticalScores()), seconds=1.0)


def test_a_malformed_vertical_record_is_refused_naming_the_field(tmp_path: Path) -> None:
    data = raw(HISTORIES[0])
    data["overlap"][1]["shared"] = "many"
    (tmp_path / "history.json").write_text(json.dumps(data))
    with pytest.raises(ConfigError, match=r"overlap\.1\.shared"):
        load_run_record(tmp_path / "history.json")
    data = raw(SUMMARIES[0])
    data["inventory"]["train.step to-site"]["arrays"]["gradients"]["width"] = "wide"
    (tmp_path / "summary.json").write_text(json.dumps(data))
    with pytest.raises(ConfigError, match=r"inventory\.train\.step to-site\.arrays\.gradients\.width"):
        VerticalSummary.load(tmp_path / "summary.json")


@pytest.mark.parametrize("name", ["vertical-simulate-head-v1.json",
                                  "vertical-simulate-regression-head-v1.json"])
def test_a_saved_head_meta_loads_typed_and_writes_back_unchanged(name: str, tmp_path: Path) -> None:
    meta = HeadMeta.load(DATA / name)
    assert meta.params.embedding_dim == 16 and len(meta.sites) >= 2
    assert meta.num_outputs == (len(meta.classes) if meta.task == "classification" else 1)
    meta.save(tmp_path / "head.json")
    assert (tmp_path / "head.json").read_text() == (DATA / name).read_text()


def test_a_saved_site_model_loads_typed_and_writes_back_unchanged(tmp_path: Path) -> None:
    name = "vertical-simulate-site-v1.json"
    info = SiteModelMeta.load(DATA / name)
    assert (info.site, info.branch.in_dim, info.branch.embedding_dim) == ("site-0", 15, 16)
    assert len(info.prep["numeric"]) == info.branch.in_dim
    info.save(tmp_path / "site.json")
    assert (tmp_path / "site.json").read_text() == (DATA / name).read_text()


def test_a_head_meta_with_bad_params_is_refused(tmp_path: Path) -> None:
    data = raw("vertical-simulate-head-v1.json")
    data["params"]["embedding_dim"] = 0
    (tmp_path / "head.json").write_text(json.dumps(data))
    with pytest.raises(ConfigError, match=r"params\.embedding_dim"):
        HeadMeta.load(tmp_path / "head.json")


@pytest.mark.parametrize(("name", "mode", "status"), [
    ("km-status-v1.json", "km", "finished"),
    ("km-status-pre-kind.json", "km", "finished"),
    ("cox-status-pre-kind-failed.json", "cox", "failed"),
])
def test_km_and_cox_status_files_load_as_survival_records_and_write_back_unchanged(
        name: str, mode: str, status: str, tmp_path: Path) -> None:
    record = load_run_record(DATA / name)
    assert isinstance(record, SurvivalAnalysisRecord)
    assert (record.mode, record.status) == (mode, status)
    assert run_kind(raw(name)) == f"survival-{mode}"
    record.save(tmp_path / "history.json")
    assert json.loads((tmp_path / "history.json").read_text()) == raw(name)


def test_the_survival_writer_writes_the_keys_of_todays_status_file(tmp_path: Path) -> None:
    """`SurvivalAnalysisRecord.start` / ``end`` (what `server.survival.app` saves) write the
    keys ``fedsplit km`` wrote when the fixture was taken."""
    record = SurvivalAnalysisRecord.start("km", at=1.0)
    record.end("finished", at=2.0)
    record.save(tmp_path / "history.json")
    assert list(json.loads((tmp_path / "history.json").read_text())) == list(raw("km-status-v1.json"))
