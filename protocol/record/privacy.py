"""The privacy parts of a horizontal run's record: ``summary.json``'s privacy section
(`SummaryPrivacy`: the DP spec and budget, each hospital's last epsilon as `SitePrivacy`, the
audit in brief) and ``privacy.json`` (`AuditResult`: the whole membership-inference audit of
``fedsplit privacy-audit``). Read and written only through these classes (conventions:
`protocol.record.common`).
"""

from __future__ import annotations

from typing import ClassVar

from fedsplit.protocol.aggregation_report import RecordPart
from fedsplit.protocol.record.common import JsonFile
from pydantic import Field


class SitePrivacy(RecordPart):
    """A hospital's last spent epsilon and the round it was recorded in."""

    epsilon: float
    round: int


class MembershipAUC(RecordPart):
    """A membership-inference AUC (0.5: the attacker learns nothing) with its 95% interval
    (``ci95``: low, high) and the ``attack`` that gave it (the stronger one)."""

    auc: float
    ci95: list[float] = Field(default_factory=list)
    attack: str | None = None


class AttackScores(RecordPart):
    """One attack on one group of rows (``privacy.json``): its AUC and interval, true-positive
    rate at 1% false positives (empirical and ``_interpolated``), the rows and its ROC curve."""

    auc: float
    ci95: list[float] = Field(default_factory=list)
    tpr_at_1pct_fpr: float | None = None
    tpr_at_1pct_fpr_interpolated: float | None = None
    members: int | None = None
    non_members: int | None = None
    roc: dict[str, list[float]] = Field(default_factory=dict)


class MembershipGroup(MembershipAUC):
    """The audit of one group (a hospital's rows, or the federation's): the stronger attack's
    AUC, interval, TPR at 1% FPR and rows. In ``privacy.json`` also every attack's scores
    (``attacks``) and, for a hospital, the model's ``accuracy`` on its held-out rows."""

    tpr_at_1pct_fpr: float | None = None
    members: int | None = None
    non_members: int | None = None
    attacks: dict[str, AttackScores] = Field(default_factory=dict)
    accuracy: float | None = None

    #: the keys summary.json keeps of a group (`PrivacyAudit.brief`)
    BRIEF: ClassVar[tuple[str, ...]] = ("auc", "ci95", "attack", "tpr_at_1pct_fpr", "members",
                                        "non_members")

    def brief(self) -> MembershipGroup:
        """The group as summary.json records it: the stronger attack's numbers only."""
        return MembershipGroup.model_validate(
            {k: v for k, v in self.to_json().items() if k in self.BRIEF})


class AuditHeadline(MembershipAUC):
    """The audit's headline number: the federation's (``scope``)."""

    scope: str | None = None


class WorstSite(MembershipAUC):
    """The largest per-hospital AUC (a maximum of noisy estimates: biased upwards)."""

    site: str | None = None


class PrivacyAudit(RecordPart):
    """The membership-inference audit (``fedsplit privacy-audit``, after a DP ``simulate``) as
    summary.json's ``privacy.audit`` holds it: ``headline`` (the federation's AUC), the
    ``worst_site``, the ``federation`` and each hospital's group (``per_site``), and the largest
    and mean per-hospital AUC."""

    headline: AuditHeadline | None = None
    worst_site: WorstSite | None = None
    federation: MembershipGroup | None = None
    max_auc: float | None = None
    mean_auc: float | None = None
    per_site: dict[str, MembershipGroup] = Field(default_factory=dict)


#: the whole membership-inference audit of a simulated run, beside its summary.json
PRIVACY_FILE = "privacy.json"


class AuditResult(JsonFile, PrivacyAudit):
    """``privacy.json``: the whole audit (`orchestration.privacy_audit`): the attacks run, the
    reference models per hospital and bootstrap resamples, every group with each attack's scores
    and ROC curve, the run folder and its DP spec."""

    _file: ClassVar[str] = PRIVACY_FILE
    _kind: ClassVar[str] = "privacy audit"

    attacks: list[str] = Field(default_factory=list)
    references: int | None = None
    resamples: int | None = None
    run: str | None = None
    dp: str | None = None

    def brief(self) -> PrivacyAudit:
        """What summary.json's ``privacy.audit`` keeps: the groups without the attacks' curves."""
        return PrivacyAudit(headline=self.headline, worst_site=self.worst_site,
                            federation=self.federation.brief() if self.federation else None,
                            max_auc=self.max_auc, mean_auc=self.mean_auc,
                            per_site={name: g.brief() for name, g in self.per_site.items()})


class SummaryPrivacy(RecordPart):
    """``summary.json``'s privacy section: the DP spec, budget, each hospital's last epsilon
    and, after ``fedsplit privacy-audit``, the membership-inference ``audit``."""

    dp: str | None = None
    level: str | None = None
    epsilon_budget: float | None = None
    delta: float | None = None
    per_site: dict[str, SitePrivacy] = Field(default_factory=dict)
    audit: PrivacyAudit | None = None
