"""The hospital's rules for its class labels and categories, whatever the run asks.

- **Minimum count**: the hospital reports (and its own schema names) a text category or a class
  label only when at least max(policy ``min_category_count``, the run's ``min-category-count``)
  of its training rows hold it (`hospital_settings`). A rarer label is never named: with
  policy ``rare_labels = "withhold"`` it is left out of the column report (only how many were
  withheld is sent) and the hospital's rows holding it are dropped from its training and
  scoring unless the agreed schema holds the label (named by other hospitals): then they are
  used (`protocol.schema.named_label_rows`). With ``rare_labels = "refuse"`` the hospital
  refuses the run, saying how many labels are too rare, never which (`check_own_labels`).
- **Label cap**: a hospital whose own target holds more distinct class labels than its
  policy's ``max_labels`` refuses the run (`check_own_labels`); so does one asked to train or
  score with an agreed schema or a model holding more (`check_federation_labels`).

Every refusal is one `PolicyRefusal` line naming the hospital.
"""

from __future__ import annotations

from dataclasses import replace

from fedsplit.protocol.schema import SiteColumns, TableSettings
from fedsplit.protocol.site_policy import PolicyRefusal, SitePolicy
from fedsplit.protocol.tasks import LabelEncoding, label_encoding


def hospital_settings(policy: SitePolicy, settings: TableSettings) -> TableSettings:
    """The run's table settings with the hospital's own minimum count applied (the larger)."""
    count = max(policy.min_category_count, settings.min_category_count)
    return settings if count == settings.min_category_count else replace(
        settings, min_category_count=count)


def check_own_labels(policy: SitePolicy, site: str, target: str, labels: int, rare: int,
                     min_count: int) -> None:
    """Refuse, naming the hospital, a target holding more distinct class labels (``labels``, rare
    ones included) than ``policy.max_labels``, or, under ``rare_labels = "refuse"``, any label
    held by fewer than ``min_count`` training rows (``rare``: how many, never which)."""
    if labels > policy.max_labels:
        raise PolicyRefusal(
            f"Hospital {site} refuses the run: its target {target!r} holds {labels:,} distinct "
            f"class labels, more than the {policy.max_labels} its policy allows (max_labels; "
            f"each label would be a model output at every hospital). Map the labels to fewer "
            f"classes in its file, or raise max_labels in its policy file. Received: "
            f"{labels:,} labels")
    if policy.rare_labels == "refuse" and rare:
        raise PolicyRefusal(
            f"Hospital {site} refuses the run: {rare} of its class labels of {target!r} are held "
            f"by fewer than {min_count} of its training rows, and its policy (rare_labels = "
            f"\"refuse\") stops a run rather than withhold them. Merge or remove those rows in "
            f"its file, or set rare_labels = \"withhold\" in its policy file. Received: {rare} "
            f"rare label(s)")


def check_report_labels(policy: SitePolicy, report: SiteColumns, target: str,
                        min_count: int, task: str = "auto") -> None:
    """`check_own_labels` on a column report (its named labels and how many it withheld); a
    run whose labels are values (regression) has none (a numeric target's values are not
    checked)."""
    if (label_encoding(task) is not LabelEncoding.VALUES and report.target is not None
            and report.target.labels is not None):
        check_own_labels(policy, report.site, target,
                         len(report.target.labels) + report.target.withheld,
                         report.target.withheld, min_count)


def check_federation_labels(policy: SitePolicy, site: str, labels: int, what: str) -> None:
    """Refuse, naming the hospital, to train or score with ``what`` (the agreed schema, the
    model) holding more class labels than ``policy.max_labels``."""
    if labels > policy.max_labels:
        raise PolicyRefusal(
            f"Hospital {site} refuses {what} with {labels:,} class labels: its policy allows "
            f"{policy.max_labels} (max_labels; each label is a model output trained on its "
            f"patients). Ask the coordinator for a run with fewer classes, or raise max_labels in "
            f"its policy file. Received: {labels:,} labels")
