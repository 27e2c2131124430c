"""km.json and cox.json are protocol models (`protocol.record.survival`): what the coordinator
builds is what it writes and what every reader loads, and a malformed file is refused with the
field named."""

from __future__ import annotations

import json
from pathlib import Path

import numpy as np
import pytest
from fedsplit.protocol.errors import ConfigError
from fedsplit.protocol.record.survival import (
    CoxCovariate,
    CoxDocument,
    CoxSites,
    KMDocument,
    NewtonStep,
)
from fedsplit.server.survival.km import apply_min_count


def km_document() -> KMDocument:
    times = np.arange(1.0, 41.0)
    events = np.tile([1, 2, 0, 1], 10)
    at_risk = 200 - np.concatenate([[0], np.cumsum(events + 1)[:-1]])
    return KMDocument(hospitals=["north", "south"], rows=200, events=int(events.sum()),
                      min_count=5, curve=apply_min_count(times, at_risk, events, 5).points(),
                      secure_aggregation="off")


def test_a_written_km_document_loads_as_written(tmp_path: Path) -> None:
    doc = km_document()
    doc.save(tmp_path / "km.json")
    assert KMDocument.load(tmp_path / "km.json") == doc
    written = json.loads((tmp_path / "km.json").read_text())
    assert "wall_seconds" not in written  # a field is written only once it is set
    doc.wall_seconds = 2.5
    doc.save(tmp_path / "km.json")
    assert KMDocument.load(tmp_path / "km.json").wall_seconds == 2.5


def test_a_curve_of_uneven_lists_is_refused_with_the_field_named(tmp_path: Path) -> None:
    data = km_document().to_json()
    data["curve"]["survival"] = data["curve"]["survival"][:-1]
    (tmp_path / "km.json").write_text(json.dumps(data))
    with pytest.raises(ConfigError, match=r"curve.*one length"):
        KMDocument.load(tmp_path / "km.json")
    doc, note = KMDocument.checked(data)
    assert doc is None and note is not None and "fedsplit km" in note


def test_a_secure_cox_fit_has_no_per_site_figures_and_reads_back(tmp_path: Path) -> None:
    fit = CoxDocument(
        rows=120, events=40, hospitals=["north", "south"], penalizer=0.0,
        covariates={"age": CoxCovariate(coef=0.02, se=float("nan"), p=float("nan"), z=1.2)},
        newton_steps=[NewtonStep(round=1, loglik=-150.0, step_norm=0.1)],
        per_site=CoxSites(rows=None, concordance=None), secure_aggregation="on")
    assert fit.covariates["age"].se is None and fit.covariates["age"].p is None
    fit.save(tmp_path / "cox.json")
    back = CoxDocument.load(tmp_path / "cox.json")
    assert back == fit and back.per_site is not None and back.per_site.rows is None
    assert json.loads((tmp_path / "cox.json").read_text())["per_site"] == {
        "rows": None, "concordance": None}


def test_a_cox_fit_without_a_finite_coefficient_is_refused() -> None:
    with pytest.raises(ValueError, match="finite"):
        CoxCovariate(coef=float("inf"))
