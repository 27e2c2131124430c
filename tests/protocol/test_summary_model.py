"""summary.json through `RunSummary` (issue 34, item 2): every key `fedsplit simulate` writes is
declared on the model, files written by the code before the model was the writer load and write
back unchanged, and the privacy audit (``privacy.json``) has its own model.

``data/summary-v2-*.json`` and ``data/privacy-v2-simulate-dp.json`` were written by
``fedsplit simulate`` at commit f2914aa, when `orchestration.experiment.run_experiment` still
built summary.json as a dict (``--dataset breast-cancer --rounds 2 --seed 0``):

- ``-attack-personalize``: 3 sites, ``--personalize 3 --attack signflip --attackers 1
  --server-opt adam``;
- ``-dp-audit`` (and ``privacy-v2-simulate-dp.json``): 2 sites, ``--dp epsilon=5,delta=1e-5``
  (the privacy section and the membership-inference audit ``simulate`` adds under DP);
- ``-survival``: ``--dataset tcga-brca`` (6 regions, the survival files);
- ``-prior``: 2 sites, ``--personalize prior`` (each hospital's bias test).
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import pytest
from fedsplit.protocol.errors import ConfigError
from fedsplit.protocol.record.privacy import AuditResult, PrivacyAudit
from fedsplit.protocol.record.summary import RunSummary
from pydantic import BaseModel

DATA = Path(__file__).parent / "data"
TODAY = sorted(p.name for p in DATA.glob("summary-v2-*.json"))
ALL = sorted(p.name for p in DATA.glob("summary-v*.json"))


def raw(name: str) -> dict[str, Any]:
    return json.loads((DATA / name).read_text())


def undeclared(model: BaseModel, where: str = "") -> list[str]:
    """Every key a model (and its parts) read without declaring it: ``where.key``."""
    found = [f"{where}{key}" for key in (model.model_extra or {})]
    for name in type(model).model_fields:
        value = getattr(model, name)
        items = (value.items() if isinstance(value, dict)
                 else enumerate(value) if isinstance(value, list) else [("", value)])
        for key, part in items:
            if isinstance(part, BaseModel):
                found += undeclared(part, f"{where}{name}{f'.{key}' if key != '' else ''}.")
    return found


def test_the_fixtures_of_todays_writer_are_there() -> None:
    assert {"summary-v2-simulate-attack-personalize.json", "summary-v2-simulate-dp-audit.json",
            "summary-v2-simulate-survival.json"} <= set(TODAY)


@pytest.mark.parametrize("name", ALL)
def test_a_summary_loads_and_writes_back_unchanged(name: str, tmp_path: Path) -> None:
    summary = RunSummary.load(DATA / name)
    assert summary.to_json() == raw(name)
    summary.save(tmp_path / "summary.json")
    assert json.loads((tmp_path / "summary.json").read_text()) == raw(name)
    assert RunSummary.load(tmp_path / "summary.json") == summary


@pytest.mark.parametrize("name", TODAY)
def test_every_key_todays_simulate_writes_is_declared(name: str) -> None:
    summary = RunSummary.load(DATA / name)
    assert undeclared(summary) == []
    assert set(raw(name)) <= {f.alias or n for n, f in RunSummary.model_fields.items()}


def test_the_run_and_its_hospitals_are_typed() -> None:
    summary = RunSummary.load(DATA / "summary-v2-simulate-attack-personalize.json")
    data = raw("summary-v2-simulate-attack-personalize.json")
    assert summary.attack is not None and summary.attack.kind == "signflip"
    assert summary.attack.hostile_sites == ["site-2"]
    assert summary.recipe is not None and summary.recipe.name == data["recipe"]["name"]
    assert summary.server_opt is not None and summary.server_opt.name == "adam"
    assert summary.site_names == ["site-0", "site-1", "site-2"] and summary.sites == 3
    assert summary.steps_per_round == data["steps_per_round"]
    assert summary.step_rows == data["step_rows"] and summary.left_out == []
    assert summary.metric_names == data["metric_names"] and summary.failures == []
    assert summary.personalized is not None and summary.personalized.steps == 3
    assert summary.survival is None and summary.privacy is None


def test_a_survival_summary_names_its_files() -> None:
    summary = RunSummary.load(DATA / "summary-v2-simulate-survival.json")
    files = raw("summary-v2-simulate-survival.json")["survival"]
    assert summary.survival is not None and summary.survival.to_json() == files
    assert summary.survival.baseline is not None
    assert summary.survival.baseline.endswith("global.baseline.json")
    assert summary.selection_metric == "c_index"


def test_the_prior_test_is_typed_and_keeps_an_infinite_statistic() -> None:
    names = [n for n in TODAY if n.endswith("-prior.json")]
    if names:  # today's writer's file: every hospital's record reads as a PriorTest
        summary = RunSummary.load(DATA / names[0])
        tuned = summary.personalized
        assert tuned is not None and tuned.prior_test
        for name, record in tuned.prior_test.items():
            assert record.to_json() == raw(names[0])["personalized"]["prior_test"][name]
    tuned = RunSummary.from_json({"personalized": {"steps": "prior", "prior_test": {"a": {
        "statistic": float("inf"), "df": 1, "p_value": 0.0, "adopted": True,
        "bias_shift": [2.5]}}}}).personalized
    assert tuned is not None and tuned.prior_test is not None
    record = tuned.prior_test["a"]
    assert record.adopted and record.df == 1
    assert record.to_json()["statistic"] == float("inf")  # an Any field would write null


def test_the_audit_in_the_summary_is_the_brief_of_privacy_json() -> None:
    summary = RunSummary.load(DATA / "summary-v2-simulate-dp-audit.json")
    result = AuditResult.load(DATA / "privacy-v2-simulate-dp.json")
    assert result.to_json() == raw("privacy-v2-simulate-dp.json")
    assert undeclared(result) == []
    assert summary.privacy is not None and summary.privacy.audit is not None
    assert result.brief().to_json() == summary.privacy.audit.to_json()
    audit = summary.privacy.audit
    assert audit.headline is not None and audit.federation is not None
    assert audit.headline.auc == audit.federation.auc and audit.headline.scope == "federation"
    assert set(audit.per_site) == set(summary.privacy.per_site)
    assert all(not group.attacks for group in audit.per_site.values())  # no curves in summary
    fed = result.federation
    assert fed is not None and set(fed.attacks) == set(result.attacks)
    assert fed.attacks[str(fed.attack)].roc["fpr"][0] == 0.0
    assert result.dp == summary.privacy.dp


def test_a_malformed_audit_is_refused_naming_the_field() -> None:
    data = raw("summary-v2-simulate-dp-audit.json")
    data["privacy"]["audit"]["federation"]["auc"] = "high"
    with pytest.raises(ConfigError, match=r"privacy\.audit\.federation\.auc"):
        RunSummary.from_json(data)
    assert PrivacyAudit().to_json() == {}


def test_undeclared_finds_an_unknown_key() -> None:
    """The check above can fail: a key no model declares is found where it is."""
    data = raw("summary-v2-simulate-attack-personalize.json")
    data["local_only"][1]["surprise"] = 1
    data["novel"] = True
    assert undeclared(RunSummary.from_json(data)) == ["novel", "local_only.1.surprise"]


def test_the_audit_written_before_intervals_still_loads() -> None:
    """Before the bootstrap intervals (commit ee04da3) the audit kept per hospital only the
    stronger attack's AUC, name and TPR, and privacy.json had no headline: both still load."""
    audit = {"max_auc": 0.61, "mean_auc": 0.55, "per_site": {
        "site-0": {"auc": 0.61, "attack": "calibrated", "tpr_at_1pct_fpr": 0.02},
        "site-1": {"auc": 0.49, "attack": "loss-threshold", "tpr_at_1pct_fpr": 0.0}}}
    data = {"task": "classification", "privacy": {"dp": "epsilon=5", "audit": audit}}
    summary = RunSummary.from_json(data)
    assert summary.to_json() == data
    assert summary.privacy is not None and summary.privacy.audit is not None
    assert summary.privacy.audit.headline is None
    assert summary.privacy.audit.per_site["site-0"].attack == "calibrated"
    roc = {"fpr": [0.0, 1.0], "tpr": [0.0, 1.0]}
    old = {"attacks": ["loss-threshold"], "references": 2, "max_auc": 0.5, "mean_auc": 0.5,
           "per_site": {"site-0": {"auc": 0.5, "attack": "loss-threshold", "members": 4,
                                   "non_members": 2, "accuracy": None, "attacks": {
                                       "loss-threshold": {"auc": 0.5, "roc": roc}}}}}
    result = AuditResult.from_json(old)
    assert result.to_json() == old and result.brief().federation is None
