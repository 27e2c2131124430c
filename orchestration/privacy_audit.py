"""Membership-inference audit of a run's global model, per simulated hospital and pooled.

For every hospital of a simulated run (``RUN_DIR/sites/<name>/``), the members are the rows its
agent trained on and the non-members its own held-out rows (the same split the agent makes:
``val-fraction``, ``seed``), so both come from the same hospital and the same distribution.
Two attacks score each row (higher = "was trained on"):

- ``loss-threshold`` (Yeom et al. 2018): minus the global model's loss on the row.
- ``calibrated`` (difficulty calibration, Watson et al. 2022): minus (the global model's loss on
  the row minus its mean loss under reference models that never saw the row). References come
  in pairs: this hospital's training rows are split at random into two halves, and each
  reference is trained, like the federation's model and for the same total epochs, on the other
  hospitals' training rows plus one half. A training row is calibrated by the reference trained
  on the other half, a held-out row by one of the pair drawn at random, so every row's
  reference is in-distribution and out-of-sample in the same way. A row that is hard for every
  model is no longer mistaken for a non-member, nor an easy one for a member.

Metrics (`membership_metrics`): the ROC AUC (0.5 = the attacker learns nothing) with a 95%
confidence interval (stratified percentile bootstrap: members and non-members resampled
separately, ``RESAMPLES`` times, seeded by the run's seed; the pROC ``ci.auc`` bootstrap), and
the true-positive rate at 1% false positives, read off the empirical ROC curve (``non_members``
says how coarse it is). The reported ``auc`` of a group is the stronger attack's (named in
``attack``); its ``ci95`` bootstraps that maximum itself (both attacks on the same resamples),
so the choice of attack is inside the interval.

- ``per_site.<name>``: one hospital's training rows against its held-out rows (20 to 50 rows
  held out on heart-disease: intervals 0.15 to 0.25 wide).
- ``federation``: every hospital's training rows against every hospital's held-out rows, each
  row scored as above (one global model, one threshold): the tight estimate.
- ``headline``: the federation's number, the audit's "membership AUC". ``worst_site`` is the
  largest per-hospital AUC, a maximum over hospitals and attacks of noisy estimates (biased
  upwards), reported with its interval but not as the headline.

Written to ``RUN_DIR/privacy.json`` with the ROC curves in ``RUN_DIR/privacy-roc.png``.
"""

from __future__ import annotations

import json
import warnings
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from pathlib import Path

import numpy as np
import torch
from fedsplit.client.data import Dataset, feature_stats
from fedsplit.client.models import SiteModel, load_model
from fedsplit.client.node_config import NodeConfig
from fedsplit.client.site import DATA_SUFFIXES
from fedsplit.client.train import fit, score, set_statistics
from fedsplit.protocol.atomic import atomic_path
from fedsplit.protocol.config import RunConfig
from fedsplit.protocol.errors import ConfigError
from fedsplit.protocol.record.common import HISTORY_FILE, SUMMARY_FILE
from fedsplit.protocol.record.horizontal import RunRecord
from fedsplit.protocol.record.privacy import (
    PRIVACY_FILE,
    AttackScores,
    AuditHeadline,
    AuditResult,
    MembershipGroup,
    SummaryPrivacy,
    WorstSite,
)
from fedsplit.protocol.record.summary import RunSummary, privacy_section
from fedsplit.protocol.stats import combine_moments
from fedsplit.protocol.tasks import task_kind

ATTACKS = ("loss-threshold", "calibrated")
RESAMPLES = 2000  # bootstrap resamples per confidence interval
CONFIDENCE = 0.95

Scores = tuple[np.ndarray, np.ndarray]  # (members' scores, non-members' scores)


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
    if task_kind(model.spec.task).classes:
        y = torch.as_tensor(data.y, dtype=torch.long)
        return torch.nn.functional.cross_entropy(out, y, reduction="none").numpy().astype(np.float64)
    scaled = (torch.as_tensor(data.y, dtype=torch.float32) - model.target_mean) / model.target_std
    return ((out.reshape(-1) - scaled) ** 2).numpy().astype(np.float64)


def attack_metrics(member_scores: np.ndarray, non_member_scores: np.ndarray) -> AttackScores:
    """ROC AUC, TPR at 1% FPR and the ROC curve of scores where members should score higher
    (``ci95`` is left unset: `membership_metrics` bootstraps it)."""
    from sklearn.metrics import roc_auc_score, roc_curve

    labels = np.r_[np.ones(len(member_scores)), np.zeros(len(non_member_scores))]
    scores = np.r_[member_scores, non_member_scores]
    fpr, tpr, _ = roc_curve(labels, scores)
    at = float(np.interp(0.01, fpr, tpr))
    # the empirical curve's TPR among thresholds whose FPR is at most 1%
    strict = float(tpr[fpr <= 0.01].max()) if np.any(fpr <= 0.01) else 0.0
    return AttackScores(auc=float(roc_auc_score(labels, scores)), tpr_at_1pct_fpr=strict,
                        tpr_at_1pct_fpr_interpolated=at,
                        members=len(member_scores), non_members=len(non_member_scores),
                        roc={"fpr": [round(float(v), 5) for v in fpr],
                             "tpr": [round(float(v), 5) for v in tpr]})


def auc_intervals(members: Sequence[np.ndarray], non_members: Sequence[np.ndarray], *,
                  seed: int, resamples: int = RESAMPLES) -> np.ndarray:
    """95% intervals of each attack's AUC and, last, of the largest of them: ``(attacks + 1, 2)``.

    ``members[a]`` / ``non_members[a]`` are attack ``a``'s scores of the same rows in the same
    order. Stratified percentile bootstrap (`scipy.stats.bootstrap` over row indices: members
    and non-members resampled separately, every attack scored on the same resample); the AUC of
    a resample is the Mann-Whitney U over (members x non-members), equal to the ROC AUC with
    ties counted one half.
    """
    from scipy.stats import bootstrap, mannwhitneyu

    ins, outs = np.asarray(members, dtype=np.float64), np.asarray(non_members, dtype=np.float64)

    def statistic(i: np.ndarray, o: np.ndarray, axis: int = -1) -> np.ndarray:
        i, o = i.astype(np.intp), o.astype(np.intp)
        aucs = np.stack([mannwhitneyu(ins[a][i], outs[a][o], axis=-1, method="asymptotic").statistic
                         for a in range(len(ins))]) / (i.shape[-1] * o.shape[-1])
        return np.concatenate([aucs, aucs.max(axis=0, keepdims=True)])

    with warnings.catch_warnings(), np.errstate(divide="ignore", invalid="ignore"):
        warnings.simplefilter("ignore", RuntimeWarning)  # p-values of all-tied resamples (unused)
        res = bootstrap((np.arange(ins.shape[1]), np.arange(outs.shape[1])), statistic,
                        vectorized=True, n_resamples=resamples, confidence_level=CONFIDENCE,
                        method="percentile", rng=np.random.default_rng(seed))
    return np.stack([res.confidence_interval.low, res.confidence_interval.high], axis=1)


def membership_metrics(scores: Mapping[str, Scores], *, seed: int) -> MembershipGroup:
    """Every attack's metrics with its interval, and the stronger attack's as ``auc``, ``ci95``,
    ``tpr_at_1pct_fpr``, ``attack`` (its interval bootstraps the maximum over the attacks)."""
    names = list(scores)
    ci = auc_intervals([scores[a][0] for a in names], [scores[a][1] for a in names], seed=seed)
    attacks = {}
    for j, a in enumerate(names):
        attacks[a] = attack_metrics(*scores[a])
        attacks[a].ci95 = [float(v) for v in ci[j]]
    best = max(names, key=lambda a: attacks[a].auc)
    return MembershipGroup(auc=attacks[best].auc, ci95=[float(v) for v in ci[-1]],
                           tpr_at_1pct_fpr=attacks[best].tpr_at_1pct_fpr, attack=best,
                           members=attacks[best].members, non_members=attacks[best].non_members,
                           attacks=attacks)


def _concat(parts: Sequence[Dataset]) -> Dataset:
    ref = parts[0]
    return Dataset(np.concatenate([p.x for p in parts]), np.concatenate([p.y for p in parts]),
                   ref.task, ref.kind, ref.feature_names)


def reference_model(like: SiteModel, train: Dataset, cfg: RunConfig, seed: int) -> SiteModel:
    """The federation's architecture trained on ``train`` only, for the run's total epochs."""
    from fedsplit.client.models import build_model

    model = build_model(like.spec, seed=seed)
    mean, std = combine_moments([feature_stats(train)])  # as the hospitals pool them
    y = train.y.astype(np.float64)
    set_statistics(model, mean, std, float(y.mean()), float(y.std()))
    fit(model, train.x, train.y, epochs=cfg.num_server_rounds * cfg.local_epochs, lr=cfg.lr,
        batch_size=cfg.batch_size, seed=seed)
    return model


def reference_losses(like: SiteModel, site: AuditSite, others: Sequence[Dataset],
                     cfg: RunConfig, *, references: int, seed: int) -> Scores:
    """Each member's and non-member's mean loss under ``references`` reference models that never
    saw it (``references // 2`` random halvings of the site's training rows; module docstring)."""
    n, m = len(site.members), len(site.non_members)
    ref_in, ref_out = np.zeros(n), np.zeros(m)
    for p in range(references // 2):
        rng = np.random.default_rng(seed + 7919 * p)
        perm = rng.permutation(n)
        halves = (perm[: n // 2], perm[n // 2:])
        out_losses = []
        for j in (0, 1):
            train = _concat([*others, site.members.subset(halves[1 - j])])
            ref = reference_model(like, train, cfg, seed=seed + 7919 * p + j)
            ref_in[halves[j]] += example_losses(ref, site.members.subset(halves[j]))
            out_losses.append(example_losses(ref, site.non_members))
        ref_out += np.where(rng.integers(0, 2, m) == 0, out_losses[0], out_losses[1])
    return ref_in / (references // 2), ref_out / (references // 2)


def audit_model(model: SiteModel, sites: Sequence[AuditSite], cfg: RunConfig, *,
                references: int = 2) -> AuditResult:
    """Run both attacks against ``model`` for every site and pooled; the ``privacy.json`` content
    (the caller sets ``run`` and ``dp``)."""
    if not sites:
        raise ConfigError("The privacy audit needs at least one hospital. Received: 0 sites")
    if references < 2 or references % 2:
        raise ConfigError(f"The calibrated attack trains reference models in pairs (one per half "
                          f"of a hospital's training rows): give an even number, at least 2. "
                          f"Received: references={references}")
    per_site: dict[str, MembershipGroup] = {}
    pooled: dict[str, tuple[list[np.ndarray], list[np.ndarray]]] = {a: ([], []) for a in ATTACKS}
    for k, site in enumerate(sites):
        if len(site.members) < 2 or len(site.non_members) < 2:
            raise ConfigError(f"Hospital {site.name} needs at least 2 training and 2 held-out rows "
                              f"to be audited. Received: {len(site.members)} and "
                              f"{len(site.non_members)}")
        target_in, target_out = example_losses(model, site.members), example_losses(model, site.non_members)
        others = [s.members for s in sites if s is not site]
        ref_in, ref_out = reference_losses(model, site, others, cfg, references=references,
                                           seed=cfg.seed * 1009 + 31 * k)
        scores = {"loss-threshold": (-target_in, -target_out),
                  "calibrated": (-(target_in - ref_in), -(target_out - ref_out))}
        for a, (s_in, s_out) in scores.items():
            pooled[a][0].append(s_in)
            pooled[a][1].append(s_out)
        group = membership_metrics(scores, seed=cfg.seed + k)
        group.accuracy = score(model, site.non_members.x, site.non_members.y).get("accuracy")
        per_site[site.name] = group
    federation = membership_metrics({a: (np.concatenate(i), np.concatenate(o))
                                     for a, (i, o) in pooled.items()}, seed=cfg.seed)
    worst = max(per_site, key=lambda name: per_site[name].auc)
    aucs = [s.auc for s in per_site.values()]
    return AuditResult(
        attacks=list(ATTACKS), references=references, resamples=RESAMPLES,
        headline=AuditHeadline(scope="federation", auc=federation.auc, ci95=federation.ci95,
                               attack=federation.attack),
        federation=federation,
        worst_site=WorstSite(site=worst, auc=per_site[worst].auc, ci95=per_site[worst].ci95,
                             attack=per_site[worst].attack),
        max_auc=max(aucs), mean_auc=float(np.mean(aucs)), per_site=per_site)


def _site_file(folder: Path) -> Path:
    files = sorted(p for p in folder.iterdir() if p.suffix.lower() in DATA_SUFFIXES)
    if len(files) != 1:
        raise ConfigError(f"{folder} must hold one simulated hospital's data file. Received: "
                          f"{[p.name for p in files]}")
    return files[0]


def run_sites(run_dir: Path, cfg: RunConfig) -> list[AuditSite]:
    """Every simulated hospital of ``run_dir``, loaded and split exactly as its agent did
    (`client.site.load_site` with the federation's agreed schema from the history)."""
    from fedsplit.client.site import load_site

    folder = run_dir / "sites"
    if not folder.is_dir():
        raise ConfigError(f"{run_dir} is not a simulated run (no sites/ folder): the audit needs "
                          f"each hospital's rows. Give a `fedsplit simulate --out` folder. "
                          f"Received: {run_dir}")
    history_path = run_dir / "federation" / HISTORY_FILE
    schema = RunRecord.load(history_path).table_schema if history_path.exists() else None
    schema_json = json.dumps(schema) if schema else None
    cfg = cfg.model_copy(update={"data_dir": str(folder)})
    sites = []
    for sub in sorted((p for p in folder.iterdir() if p.is_dir() and p.name.startswith("site-")),
                      key=lambda p: int(p.name.split("-", 1)[1])):
        _site_file(sub)
        site = load_site(NodeConfig(partition_id=int(sub.name.split("-", 1)[1])), 0, cfg,
                         schema_json)
        sites.append(AuditSite(site.name, site.train, site.val))
    return sites


def plot_roc(result: AuditResult, path: Path) -> None:
    """ROC curve of every hospital's and the federation's reported attack, atomically to ``path``."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, ax = plt.subplots(figsize=(5.5, 5))
    try:
        groups = [(name, site, 1.0) for name, site in result.per_site.items()]
        if result.federation is not None:
            groups.append(("all hospitals", result.federation, 2.2))
        for name, group, width in groups:
            roc = group.attacks[str(group.attack)].roc
            low, high = group.ci95
            ax.plot(roc["fpr"], roc["tpr"], lw=width,
                    label=f"{name} ({group.attack}, AUC {group.auc:.3f} "
                          f"[{low:.2f}, {high:.2f}])")
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


def privacy_audit(run_dir: Path, *, references: int = 2) -> AuditResult:
    """Audit ``run_dir``'s final global model; write ``privacy.json`` (`AuditResult`) and
    ``privacy-roc.png``."""
    run_dir = Path(run_dir)
    summary_path = run_dir / SUMMARY_FILE
    model_path = run_dir / "federation" / "global.h5"
    if not summary_path.exists() or not model_path.exists():
        raise ConfigError(f"{run_dir} holds no finished simulated run (summary.json and "
                          f"federation/global.h5). Run `fedsplit simulate --out {run_dir}` first. "
                          f"Received: {run_dir}")
    summary = RunSummary.load(summary_path)
    cfg = RunConfig.from_flower(summary.config)
    torch.manual_seed(cfg.seed)
    result = audit_model(load_model(model_path), run_sites(run_dir, cfg), cfg,
                         references=references)
    result.run, result.dp = str(run_dir), summary.privacy.dp if summary.privacy else None
    result.save(run_dir / PRIVACY_FILE)
    plot_roc(result, run_dir / "privacy-roc.png")
    return result


def privacy_summary(run_dir: Path, dp_spec: str) -> SummaryPrivacy:
    """``summary.json``'s ``privacy`` section: the budget and each hospital's last spent epsilon."""
    from fedsplit.protocol.privacy import DPSpec

    history = RunRecord.load(Path(run_dir) / "federation" / HISTORY_FILE)
    spec = DPSpec.parse(dp_spec)
    return privacy_section(history, dp=spec.to_spec() if spec else None,
                           level=spec.level if spec else None,
                           epsilon_budget=spec.epsilon if spec else None,
                           delta=spec.delta if spec else None)


def add_privacy(run_dir: Path, *, audit: bool, references: int = 2) -> RunSummary:
    """Add the ``privacy`` section (and, with ``audit``, the audit's AUCs:
    `AuditResult.brief`) to summary.json; return the summary."""
    path = Path(run_dir) / SUMMARY_FILE
    summary = RunSummary.load(path)
    summary.privacy = privacy_summary(run_dir, RunConfig.from_flower(summary.config).dp)
    summary.save(path)
    if audit:
        summary.privacy.audit = privacy_audit(run_dir, references=references).brief()
        summary.save(path)
    return summary
