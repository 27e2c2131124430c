"""The leakage audit: it finds members of a deliberately overfitted model, pooled over hospitals
with an interval that excludes chance, and its intervals behave like intervals."""

from __future__ import annotations

import numpy as np
import pytest
from fedsplit.client.data import Dataset
from fedsplit.client.models import ModelSpec, build_model
from fedsplit.client.train import fit, set_statistics
from fedsplit.orchestration.privacy_audit import (
    AuditSite,
    attack_metrics,
    auc_intervals,
    audit_model,
    membership_metrics,
)
from fedsplit.protocol.config import RunConfig
from fedsplit.protocol.errors import ConfigError
from fedsplit.protocol.record.privacy import AttackScores, MembershipGroup
from scipy.stats import norm

CFG = RunConfig(num_server_rounds=2, local_epochs=1, lr=0.01, batch_size=16, hidden="16")
GROUP_KEYS = {"auc", "ci95", "tpr_at_1pct_fpr", "attack", "members", "non_members", "attacks"}


def _data(rng: np.random.Generator, n: int) -> Dataset:
    x = rng.normal(size=(n, 6)).astype(np.float32)
    y = rng.integers(0, 2, n)  # labels are noise: only memorising them lowers the loss
    return Dataset(x, y, "classification", "mlp", [f"f{i}" for i in range(6)])


def _trained_on(train: list[Dataset]) -> object:
    model = build_model(ModelSpec("mlp", "classification", (6,), 2, hidden=(256, 256)), seed=0)
    set_statistics(model, np.zeros(6), np.ones(6))
    fit(model, np.concatenate([d.x for d in train]), np.concatenate([d.y for d in train]),
        epochs=300, lr=0.003, batch_size=32, seed=0)
    return model


def _inside(group: AttackScores | MembershipGroup) -> bool:
    low, high = group.ci95
    return low <= group.auc <= high


@pytest.mark.slow  # a fresh process or an end-to-end run: seconds (make test)
def test_overfitted_model_leaks_membership() -> None:
    rng = np.random.default_rng(0)
    sites = [AuditSite(f"h{i}", _data(rng, 60), _data(rng, 60)) for i in range(2)]
    result = audit_model(_trained_on([s.members for s in sites]), sites, CFG, references=2)
    for site in result.per_site.values():
        assert site.attacks["loss-threshold"].auc > 0.7  # chance is 0.5
        assert set(site.attacks) == {"loss-threshold", "calibrated"}
        assert site.tpr_at_1pct_fpr is not None and 0 <= site.tpr_at_1pct_fpr <= 1
        assert _inside(site) and all(_inside(a) for a in site.attacks.values())
    assert result.max_auc is not None and result.max_auc > 0.7
    fed = result.federation
    assert fed is not None and result.headline is not None
    assert (fed.members, fed.non_members) == (120, 120)
    assert fed.auc > 0.7 and fed.ci95[0] > 0.5  # pooled: chance is outside the interval
    assert _inside(fed) and all(_inside(a) for a in fed.attacks.values())
    assert fed.auc == max(a.auc for a in fed.attacks.values())
    assert result.headline.to_json() == {"scope": "federation", "auc": fed.auc, "ci95": fed.ci95,
                                         "attack": fed.attack}


def test_model_that_never_saw_the_rows_stays_near_chance() -> None:
    rng = np.random.default_rng(1)
    sites = [AuditSite(f"h{i}", _data(rng, 60), _data(rng, 60)) for i in range(2)]
    model = _trained_on([_data(rng, 120)])  # neither members nor non-members
    fed = audit_model(model, sites, CFG, references=2).federation
    assert fed is not None
    for attack in fed.attacks.values():
        low, high = attack.ci95
        assert low < 0.5 < high and abs(attack.auc - 0.5) < 0.1


def test_privacy_json_schema() -> None:
    rng = np.random.default_rng(2)
    sites = [AuditSite(f"h{i}", _data(rng, 30), _data(rng, 10)) for i in range(3)]
    result = audit_model(_trained_on([sites[0].members]), sites, CFG, references=2)
    written = result.to_json()  # what privacy.json holds (less run and dp, set by the caller)
    assert {"attacks", "references", "resamples", "headline", "federation", "worst_site",
            "max_auc", "mean_auc", "per_site"} <= set(written)
    assert set(written["federation"]) >= GROUP_KEYS
    assert list(written["per_site"]) == ["h0", "h1", "h2"]
    for site in written["per_site"].values():
        assert GROUP_KEYS | {"accuracy"} <= set(site)
        assert (site["members"], site["non_members"]) == (30, 10)
        for attack in site["attacks"].values():
            assert {"auc", "ci95", "tpr_at_1pct_fpr", "members", "non_members", "roc"} <= set(attack)
    worst = result.worst_site
    assert worst is not None and worst.site is not None
    assert worst.auc == result.max_auc == result.per_site[worst.site].auc
    assert worst.ci95 == result.per_site[worst.site].ci95


def test_references_come_in_pairs() -> None:
    rng = np.random.default_rng(3)
    sites = [AuditSite("h0", _data(rng, 10), _data(rng, 10))]
    with pytest.raises(ConfigError, match="Received: references=3"):
        audit_model(_trained_on([sites[0].members]), sites, CFG, references=3)


def test_attack_metrics_at_chance_and_perfect() -> None:
    perfect = attack_metrics(np.array([3.0, 4.0]), np.array([1.0, 2.0]))
    assert perfect.auc == 1.0 and perfect.tpr_at_1pct_fpr == 1.0
    same = attack_metrics(np.ones(10), np.ones(10))
    assert same.auc == 0.5


def test_intervals_cover_the_true_auc_and_shrink_with_rows() -> None:
    shift = 0.5  # members ~ N(0.5, 1), non-members ~ N(0, 1): true AUC = Phi(0.5 / sqrt 2)
    true_auc = float(norm.cdf(shift / np.sqrt(2)))
    covered, widths = 0, []
    for k in range(40):  # a 95% interval misses 1 draw in 20: count over 40 fixed draws
        rng = np.random.default_rng(k)
        ins, outs = rng.normal(shift, 1, 60), rng.normal(0, 1, 60)
        (low, high), _ = auc_intervals([ins], [outs], seed=k, resamples=1000)
        assert low <= attack_metrics(ins, outs).auc <= high
        covered += low <= true_auc <= high
        widths.append(high - low)
    assert covered >= 34  # 0.95 expected; 34 of 40 or fewer has probability about 1.4%
    rng = np.random.default_rng(99)
    (low, high), _ = auc_intervals([rng.normal(shift, 1, 960)], [rng.normal(0, 1, 960)], seed=0,
                                   resamples=1000)
    assert high - low < np.mean(widths) / 2.5  # width ~ 1/sqrt(rows): 4x at 16x the rows
    ins, outs = np.random.default_rng(5).normal(size=(2, 40)), np.zeros((2, 40))
    assert np.array_equal(auc_intervals(ins, outs, seed=3), auc_intervals(ins, outs, seed=3))


def test_stronger_attack_interval_bootstraps_the_maximum() -> None:
    rng = np.random.default_rng(6)
    weak = (rng.normal(0.1, 1, 80), rng.normal(0, 1, 80))
    strong = (rng.normal(1.0, 1, 80), rng.normal(0, 1, 80))
    got = membership_metrics({"weak": weak, "strong": strong}, seed=0)
    assert got.attack == "strong" and got.auc == got.attacks["strong"].auc
    # the strong attack wins on every resample: the maximum's interval is its own
    assert np.allclose(got.ci95, got.attacks["strong"].ci95)
    assert got.ci95[0] > got.attacks["weak"].ci95[1]
