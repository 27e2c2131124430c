"""One hospital's part in one round, from the run record's types: its `protocol.record.horizontal.SiteEntry`
(what it sent, or why nothing usable came) and/or its line of the aggregation report
(`protocol.aggregation_report.SiteReport`: what the rule made of its update).

Both federation kinds end up in the same `SiteRow`: REST rounds (an upload, as a `SiteEntry`,
plus, once aggregated, the report's line) and Flower rounds (``history.json``'s train entry plus
the report's). Status tags, in the order shown:

- ``replied`` / ``uploaded``: the site sent an update (Flower reply / REST upload);
- ``late``: no reply within the round timeout; ``failed``: its ClientApp crashed;
- ``excluded``: left out of the aggregate, with ``reason``;
- ``capped``: its count was cut to its registered cohort size (``claimed`` is what it sent);
- ``trimmed``: median / trimmed mean dropped some of its coordinates (``trimmed_fraction``);
- ``selected`` / ``not selected``: Krum's choice (with its ``score``).
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass, field

from fedsplit.protocol.aggregation_report import AggregationReport, SiteReport
from fedsplit.protocol.horizontal_wire import NUM_EXAMPLES
from fedsplit.protocol.record.common import scalars
from fedsplit.protocol.record.horizontal import SiteEntry

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


def apply_history(row: SiteRow, entry: SiteEntry, *, sent_tag: str = "replied") -> None:
    """Fill ``row`` from a run record's train entry (a reply, or a hospital left out)."""
    if entry.excluded:
        reason = entry.reason or ""
        if entry.late:
            row.tags.append("late")
        elif reason.startswith(FAILED_PREFIX):
            row.tags.append("failed")
        else:
            row.tags.append("excluded")
        row.reason = reason or None
    elif sent_tag not in row.tags:
        row.tags.insert(0, sent_tag)
    if row.num_examples is None:
        row.num_examples = entry.num_examples
    if entry.metrics:
        row.metrics = scalars(entry.metrics)
    row.epsilon = entry.spent_epsilon()


def apply_report(row: SiteRow, report: SiteReport) -> None:
    """Fill ``row`` from the hospital's line of the aggregation report."""
    if report.excluded:
        if not {"late", "failed", "excluded"} & set(row.tags):
            row.tags.append("excluded")
        row.reason = row.reason or report.reason or None
    row.num_examples = report.num_examples if not report.excluded else row.num_examples
    row.weight = report.weight
    row.l2 = report.l2_to_aggregate
    if report.claimed_examples is not None:
        row.claimed = report.claimed_examples
        row.tags.append("capped")
    if report.trimmed_fraction is not None:
        row.trimmed_fraction = report.trimmed_fraction
        if report.trimmed_fraction > 0:
            row.tags.append("trimmed")
    if report.selected is True:
        row.tags.append("selected")
    elif report.selected is False and not report.excluded:
        row.tags.append("not selected")
    row.score = report.score


def rows_from_round(train_sites: Sequence[SiteEntry], report: AggregationReport | None,
                    eval_sites: Sequence[SiteEntry] = (), *, sent_tag: str = "replied",
                    ) -> list[SiteRow]:
    """Every hospital of one round, sorted by name: its training entry merged with its line of
    the report and its evaluation entry's metrics."""
    rows: dict[str, SiteRow] = {}
    for entry in train_sites:
        name = entry.site or "(unnamed)"
        row = rows.setdefault(name, SiteRow(site=name))
        apply_history(row, entry, sent_tag=sent_tag)
    for site in report.sites if report is not None else []:
        name = site.site or "(unnamed)"
        row = rows.get(name)
        if row is None:
            row = rows[name] = SiteRow(site=name)
            if not site.excluded:
                row.tags.append(sent_tag)
        apply_report(row, site)
    for entry in eval_sites:
        if entry.site is None or entry.site not in rows or entry.excluded:
            continue
        if entry.metrics:
            rows[entry.site].eval_metrics = {
                k: v for k, v in scalars(entry.metrics).items() if k != NUM_EXAMPLES}
    return [rows[name] for name in sorted(rows)]
