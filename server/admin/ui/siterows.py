"""One hospital's part in one round, from an aggregation report entry and/or a history entry.

Both federation kinds end up in the same `SiteRow`: REST rounds (an upload plus, once
aggregated, the report's entry) and Flower rounds (``history.json``'s train entry plus the
report's). Status tags, in the order shown:

- ``replied`` / ``uploaded``: the site sent an update (Flower reply / REST upload);
- ``late``: no reply within the round timeout; ``failed``: its ClientApp crashed;
- ``excluded``: left out of the aggregate, with ``reason``;
- ``capped``: its count was cut to its registered cohort size (``claimed`` is what it sent);
- ``trimmed``: median / trimmed mean dropped some of its coordinates (``trimmed_fraction``);
- ``selected`` / ``not selected``: Krum's choice (with its ``score``).
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

FAILED_PREFIX = "the site's ClientApp failed"


@dataclass
class SiteRow:
    """What one hospital did in one round."""

    site: str
    tags: list[str] = field(default_factory=list)
    reason: str | None = None
    num_examples: int | None = None
    claimed: int | None = None
    weight: float | None = None
    l2: float | None = None
    trimmed_fraction: float | None = None
    score: float | None = None
    metrics: dict[str, float] = field(default_factory=dict)
    eval_metrics: dict[str, float] = field(default_factory=dict)
    epsilon: float | None = None

    @property
    def returned(self) -> bool:
        """Whether the hospital's update arrived and passed the checks (Krum may still drop it)."""
        return not ({"late", "failed", "excluded"} & set(self.tags))

    @property
    def used(self) -> bool:
        """Whether the update went into the aggregate."""
        return not ({"late", "failed", "excluded", "not selected"} & set(self.tags))


class RoundRows:
    """The hospitals of one round (REST or Flower): who returned, who went into the aggregate."""

    rows: list[SiteRow]

    @property
    def used(self) -> list[SiteRow]:
        """Hospitals whose update went into the aggregate."""
        return [r for r in self.rows if r.used]

    @property
    def returned(self) -> list[SiteRow]:
        """Hospitals whose update arrived and passed the checks."""
        return [r for r in self.rows if r.returned]


def _float(value: Any) -> float | None:
    return float(value) if isinstance(value, int | float) and not isinstance(value, bool) else None


def _int(value: Any) -> int | None:
    return int(value) if isinstance(value, int | float) and not isinstance(value, bool) else None


def epsilon_of(entry: dict[str, Any]) -> float | None:
    """A site's spent epsilon: ``entry["epsilon"]`` or ``entry["metrics"]["epsilon"]``."""
    value = _float(entry.get("epsilon"))
    if value is None and isinstance(entry.get("metrics"), dict):
        value = _float(entry["metrics"].get("epsilon"))
    return value


def apply_history(row: SiteRow, entry: dict[str, Any], *, sent_tag: str = "replied") -> None:
    """Fill ``row`` from a history train entry (``{site, num_examples, metrics}`` or excluded)."""
    if entry.get("excluded"):
        reason = str(entry.get("reason") or "")
        if entry.get("late"):
            row.tags.append("late")
        elif reason.startswith(FAILED_PREFIX):
            row.tags.append("failed")
        else:
            row.tags.append("excluded")
        row.reason = reason or None
    elif sent_tag not in row.tags:
        row.tags.insert(0, sent_tag)
    if row.num_examples is None:
        row.num_examples = _int(entry.get("num_examples"))
    metrics = entry.get("metrics")
    if isinstance(metrics, dict):
        row.metrics = {str(k): float(v) for k, v in metrics.items() if _float(v) is not None}
    row.epsilon = epsilon_of(entry)


def apply_report(row: SiteRow, report: dict[str, Any]) -> None:
    """Fill ``row`` from an aggregation report's site entry (`aggregation.base.SiteReport`)."""
    if report.get("excluded"):
        if not {"late", "failed", "excluded"} & set(row.tags):
            row.tags.append("excluded")
        row.reason = row.reason or (str(report["reason"]) if report.get("reason") else None)
    row.num_examples = _int(report.get("num_examples")) if not report.get("excluded") else row.num_examples
    row.weight = _float(report.get("weight"))
    row.l2 = _float(report.get("l2_to_aggregate"))
    claimed = _int(report.get("claimed_examples"))
    if claimed is not None:
        row.claimed = claimed
        row.tags.append("capped")
    trimmed = _float(report.get("trimmed_fraction"))
    if trimmed is not None:
        row.trimmed_fraction = trimmed
        if trimmed > 0:
            row.tags.append("trimmed")
    if report.get("selected") is True:
        row.tags.append("selected")
    elif report.get("selected") is False and not report.get("excluded"):
        row.tags.append("not selected")
    row.score = _float(report.get("score"))


def rows_from_round(train_sites: list[dict[str, Any]], report: dict[str, Any] | None,
                    eval_sites: list[dict[str, Any]] | None = None,
                    *, sent_tag: str = "replied") -> list[SiteRow]:
    """Every hospital of one round, sorted by name: history entries merged with the report."""
    rows: dict[str, SiteRow] = {}
    for entry in train_sites:
        name = str(entry.get("site") or "(unnamed)")
        row = rows.setdefault(name, SiteRow(site=name))
        apply_history(row, entry, sent_tag=sent_tag)
    for entry in (report or {}).get("sites", []) or []:
        if not isinstance(entry, dict):
            continue
        name = str(entry.get("site") or "(unnamed)")
        row = rows.get(name)
        if row is None:
            row = rows[name] = SiteRow(site=name)
            if not entry.get("excluded"):
                row.tags.append(sent_tag)
        apply_report(row, entry)
    for entry in eval_sites or []:
        name = entry.get("site")
        if name is None or name not in rows or entry.get("excluded"):
            continue
        metrics = entry.get("metrics")
        if isinstance(metrics, dict):
            rows[name].eval_metrics = {
                str(k): float(v) for k, v in metrics.items()
                if _float(v) is not None and k != "num-examples"
            }
    return [rows[name] for name in sorted(rows)]
