"""Membership-inference audit of a run's global model, per simulated hospital.

For every hospital of a simulated run (``RUN_DIR/sites/<name>/``), the members are the rows its
agent trained on and the non-members its own held-out rows (the same split the agent makes:
``val-fraction``, ``seed``), so both come from the same hospital and the same distribution.
Two attacks score each row (higher = "was trained on"):

- ``loss-threshold`` (Yeom et al. 2018): minus the global model's loss on the row.
- ``calibrated`` (difficulty calibration, Watson et al. 2022): minus (the global model's loss on
  the row minus its mean loss under ``references`` reference models trained, like the
  federation's model and for the same total epochs, on the other hospitals' training rows
  only, i.e. without any of this hospital's rows). A row that is hard for every model is no
  longer mistaken for a non-member, nor an easy one for a member.

Per hospital and attack: the ROC AUC (0.5 = the attacker learns nothing) and the true-positive
rate at 1% false positives (with few held-out rows this is read off the empirical ROC curve;
``non_members`` says how coarse it is). ``per_site.<name>`` reports the stronger attack (higher
AUC), named in ``attack``; every attack's numbers are under ``attacks``. Written to
``RUN_DIR/privacy.json`` with the ROC curves in ``RUN_DIR/privacy-roc.png``.
"""

from __future__ import annotations

import json
from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import numpy as np
import torch

from client.data import Dataset
from client.models import SiteModel, load_model
from client.site import DATA_SUFFIXES
from client.train import fit, score, set_statistics
from protocol.atomic import atomic_path, write_json_atomic
from protocol.config import RunConfig
from protocol.errors import ConfigError
from protocol.stats import combine_moments, moments

ATTACKS = ("loss-threshold", "calibrated")


@dataclass(frozen=True)
class AuditSite:
    """One hospital's members (its training rows) and non-members (its held-out rows)."""

    name: str
    members: Dataset
    non_members: Dataset


@torch.no_grad()
def example_losses(model: SiteModel, data: Dataset) -> np.ndarray:
    """Per-row loss of ``model`` (cross-entropy, or squared error in standardised units)."""
    model.eval()
    out = model(torch.as_tensor(data.x, dtype=torch.float32))
    if model.spec.task == "classification":
        y = torch.as_tensor(data.y, dtype=torch.long)
        return torch.nn.functional.cross_entropy(out, y, reduction="none").numpy().astype(np.float64)
    scaled = (torch.as_tensor(data.y, dtype=torch.float32) - model.target_mean) / model.target_std
    return ((out.reshape(-1) - scaled) ** 2).numpy().astype(np.float64)


def attack_metrics(member_scores: np.ndarray, non_member_scores: np.ndarray) -> dict[str, Any]:
    """ROC AUC, TPR at 1% FPR and the ROC curve of scores where members should score higher."""
    from sklearn.metrics import roc_auc_score, roc_curve

    labels = np.r_[np.ones(len(member_scores)), np.zeros(len(non_member_scores))]
    scores = np.r_[member_scores, non_member_scores]
    fpr, tpr, _ = roc_curve(labels, scores)
    at = float(np.interp(0.01, fpr, tpr))
    # the empirical curve's TPR among thresholds whose FPR is at most 1%
    strict = float(tpr[fpr <= 0.01].max()) if np.any(fpr <= 0.01) else 0.0
    return {"auc": float(roc_auc_score(labels, scores)), "tpr_at_1pct_fpr": strict,
            "tpr_at_1pct_fpr_interpolated": at,
            "roc": {"fpr": [round(float(v), 5) for v in fpr],
                    "tpr": [round(float(v), 5) for v in tpr]}}


def _concat(parts: Sequence[Dataset]) -> Dataset:
    ref = parts[0]
    return Dataset(np.concatenate([p.x for p in parts]), np.concatenate([p.y for p in parts]),
                   ref.task, ref.kind, ref.feature_names)


def reference_model(like: SiteModel, train: Dataset, cfg: RunConfig, seed: int) -> SiteModel:
    """The federation's architecture trained on ``train`` only, for the run's total epochs."""
    from client.models import build_model

    model = build_model(like.spec, seed=seed)
    flat = train.x.reshape(len(train.x), -1)
    mean, std = combine_moments([moments(flat.reshape(-1, 1) if train.kind == "cnn" else flat)])
    y = train.y.astype(np.float64)
    set_statistics(model, mean, std, float(y.mean()), float(y.std()))
    fit(model, train.x, train.y, epochs=cfg.num_server_rounds * cfg.local_epochs, lr=cfg.lr,
        batch_size=cfg.batch_size, seed=seed)
    return model


def audit_model(model: SiteModel, sites: Sequence[AuditSite], cfg: RunConfig, *,
                references: int = 2) -> dict[str, Any]:
    """Run both attacks against ``model`` for every site; return the ``privacy.json`` content."""
    if not sites:
        raise ConfigError("The privacy audit needs at least one hospital. Received: 0 sites")
    if references < 1:
        raise ConfigError(f"The calibrated attack needs at least one reference model. "
                          f"Received: references={references}")
    per_site: dict[str, Any] = {}
    for k, site in enumerate(sites):
        if len(site.members) < 2 or len(site.non_members) < 2:
            raise ConfigError(f"Hospital {site.name} needs at least 2 training and 2 held-out rows "
                              f"to be audited. Received: {len(site.members)} and "
                              f"{len(site.non_members)}")
        target_in, target_out = example_losses(model, site.members), example_losses(model, site.non_members)
        others = [s.members for s in sites if s is not site]
        attacks = {"loss-threshold": attack_metrics(-target_in, -target_out)}
        if others:
            pool = _concat(others)
            refs = [reference_model(model, pool, cfg, seed=cfg.seed * 1009 + 31 * k + r)
                    for r in range(references)]
            ref_in = np.mean([example_losses(r, site.members) for r in refs], axis=0)
            ref_out = np.mean([example_losses(r, site.non_members) for r in refs], axis=0)
            attacks["calibrated"] = attack_metrics(-(target_in - ref_in), -(target_out - ref_out))
        best = max(attacks, key=lambda a: attacks[a]["auc"])
        per_site[site.name] = {
            "auc": attacks[best]["auc"], "tpr_at_1pct_fpr": attacks[best]["tpr_at_1pct_fpr"],
            "attack": best, "members": len(site.members), "non_members": len(site.non_members),
            "accuracy": score(model, site.non_members.x, site.non_members.y).get("accuracy"),
            "attacks": attacks,
        }
    aucs = [s["auc"] for s in per_site.values()]
    return {"attacks": list(ATTACKS), "references": references,
            "max_auc": max(aucs), "mean_auc": float(np.mean(aucs)), "per_site": per_site}


def _site_file(folder: Path) -> Path:
    files = sorted(p for p in folder.iterdir() if p.suffix.lower() in DATA_SUFFIXES)
    if len(files) != 1:
        raise ConfigError(f"{folder} must hold one simulated hospital's data file. Received: "
                          f"{[p.name for p in files]}")
    return files[0]


def run_sites(run_dir: Path, cfg: RunConfig) -> list[AuditSite]:
    """Every simulated hospital of ``run_dir``, loaded and split exactly as its agent did
    (`client.site.load_site` with the federation's agreed schema from the history)."""
    from client.site import load_site

    folder = run_dir / "sites"
    if not folder.is_dir():
        raise ConfigError(f"{run_dir} is not a simulated run (no sites/ folder): the audit needs "
                          f"each hospital's rows. Give a `fedsplit simulate --out` folder. "
                          f"Received: {run_dir}")
    history_path = run_dir / "federation" / "history.json"
    schema = json.loads(history_path.read_text()).get("schema") if history_path.exists() else None
    schema_json = json.dumps(schema) if isinstance(schema, dict) else schema
    cfg = cfg.model_copy(update={"data_dir": str(folder)})
    sites = []
    for sub in sorted((p for p in folder.iterdir() if p.is_dir() and p.name.startswith("site-")),
                      key=lambda p: int(p.name.split("-", 1)[1])):
        _site_file(sub)
        site = load_site({"partition-id": int(sub.name.split("-", 1)[1])}, 0, cfg, schema_json)
        sites.append(AuditSite(site.name, site.train, site.val))
    return sites


def plot_roc(result: dict[str, Any], path: Path) -> None:
    """ROC curve of every hospital's reported attack, atomically to ``path``."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, ax = plt.subplots(figsize=(5.5, 5))
    try:
        for name, site in result["per_site"].items():
            roc = site["attacks"][site["attack"]]["roc"]
            ax.plot(roc["fpr"], roc["tpr"], label=f"{name} ({site['attack']}, AUC {site['auc']:.3f})")
        ax.plot([0, 1], [0, 1], "k--", lw=0.8, label="chance")
        ax.set_xlabel("false-positive rate (held-out rows called members)")
        ax.set_ylabel("true-positive rate (training rows found)")
        ax.set_title("Membership inference against the global model")
        ax.legend(fontsize=7)
        fig.tight_layout()
        with atomic_path(path) as tmp:
            fig.savefig(tmp, format="png", dpi=110)
    finally:
        plt.close(fig)


def privacy_audit(run_dir: Path, *, references: int = 2) -> dict[str, Any]:
    """Audit ``run_dir``'s final global model; write ``privacy.json`` and ``privacy-roc.png``."""
    run_dir = Path(run_dir)
    summary_path = run_dir / "summary.json"
    model_path = run_dir / "federation" / "global.h5"
    if not summary_path.exists() or not model_path.exists():
        raise ConfigError(f"{run_dir} holds no finished simulated run (summary.json and "
                          f"federation/global.h5). Run `fedsplit simulate --out {run_dir}` first. "
                          f"Received: {run_dir}")
    summary = json.loads(summary_path.read_text())
    cfg = RunConfig.from_flower(summary["config"])
    torch.manual_seed(cfg.seed)
    result = audit_model(load_model(model_path), run_sites(run_dir, cfg), cfg,
                         references=references)
    result["run"] = str(run_dir)
    result["dp"] = summary.get("privacy", {}).get("dp") if summary.get("privacy") else None
    write_json_atomic(run_dir / "privacy.json", result)
    plot_roc(result, run_dir / "privacy-roc.png")
    return result


def privacy_summary(run_dir: Path, dp_spec: str) -> dict[str, Any]:
    """``summary.json``'s ``privacy`` section: the budget and each hospital's last spent epsilon."""
    from protocol.privacy import DPSpec

    history = json.loads((Path(run_dir) / "federation" / "history.json").read_text())
    spec = DPSpec.parse(dp_spec)
    per_site: dict[str, Any] = {}
    for entry in history.get("rounds", []):
        for site in entry.get("train", {}).get("sites", []):
            if "epsilon" in site:
                per_site[site["site"]] = {"epsilon": site["epsilon"], "round": entry["round"]}
    return {"dp": spec.to_spec() if spec else None,
            "level": spec.level if spec else None,
            "epsilon_budget": spec.epsilon if spec else None,
            "delta": spec.delta if spec else None,
            "per_site": per_site}


def add_privacy(run_dir: Path, *, audit: bool, references: int = 2) -> dict[str, Any]:
    """Add the ``privacy`` section (and, with ``audit``, the audit's AUCs) to summary.json."""
    path = Path(run_dir) / "summary.json"
    summary = json.loads(path.read_text())
    section = privacy_summary(run_dir, summary["config"].get("dp", ""))
    summary["privacy"] = section
    write_json_atomic(path, summary)
    if audit:
        result = privacy_audit(run_dir, references=references)
        section["audit"] = {"max_auc": result["max_auc"], "mean_auc": result["mean_auc"],
                            "per_site": {k: {"auc": v["auc"], "attack": v["attack"],
                                             "tpr_at_1pct_fpr": v["tpr_at_1pct_fpr"]}
                                         for k, v in result["per_site"].items()}}
        summary["privacy"] = section
        write_json_atomic(path, summary)
    return summary
