"""The leakage audit finds members of a deliberately overfitted model."""

from __future__ import annotations

import numpy as np

from client.data import Dataset
from client.models import ModelSpec, build_model
from client.train import fit, set_statistics
from orchestration.privacy_audit import AuditSite, attack_metrics, audit_model
from protocol.config import RunConfig


def _data(rng: np.random.Generator, n: int) -> Dataset:
    x = rng.normal(size=(n, 6)).astype(np.float32)
    y = rng.integers(0, 2, n)  # labels are noise: only memorising them lowers the loss
    return Dataset(x, y, "classification", "mlp", [f"f{i}" for i in range(6)])


def test_overfitted_model_leaks_membership() -> None:
    rng = np.random.default_rng(0)
    sites = [AuditSite(f"h{i}", _data(rng, 60), _data(rng, 60)) for i in range(2)]
    cfg = RunConfig(num_server_rounds=2, local_epochs=1, lr=0.01, batch_size=16, hidden="16")
    model = build_model(ModelSpec("mlp", "classification", (6,), 2, hidden=(256, 256)), seed=0)
    set_statistics(model, np.zeros(6), np.ones(6))
    members = np.concatenate([s.members.x for s in sites])
    labels = np.concatenate([s.members.y for s in sites])
    fit(model, members, labels, epochs=300, lr=0.003, batch_size=32, seed=0)
    result = audit_model(model, sites, cfg, references=1)
    for site in result["per_site"].values():
        assert site["attacks"]["loss-threshold"]["auc"] > 0.7  # chance is 0.5
        assert set(site["attacks"]) == {"loss-threshold", "calibrated"}
        assert 0 <= site["tpr_at_1pct_fpr"] <= 1
    assert result["max_auc"] > 0.7


def test_attack_metrics_at_chance_and_perfect() -> None:
    perfect = attack_metrics(np.array([3.0, 4.0]), np.array([1.0, 2.0]))
    assert perfect["auc"] == 1.0 and perfect["tpr_at_1pct_fpr"] == 1.0
    same = attack_metrics(np.ones(10), np.ones(10))
    assert same["auc"] == 0.5
