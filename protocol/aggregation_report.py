"""The aggregation report: what one aggregation did, per update (issue 34: one type).

`AggregationReport` with one `SiteReport` per update is built by every rule (`aggregation/`),
written as history.json's round ``aggregation`` and as ``models/round-NNN.report.json``
(`protocol.record.horizontal.RoundEntry`, `server.history`), beside ``fedsplit aggregate``'s output, in
the admin database's REST rounds, and read by the admin API and the web view. It lives in its
own file so the rules import the type without the rest of the run record (the aggregation
process starts 70 ms faster); `protocol.record` re-exports it, and `RecordPart` is the base
of every part of the run record.
"""

from __future__ import annotations

from typing import Any, Self

from pydantic import BaseModel, ConfigDict, Field, model_validator


class RecordPart(BaseModel):
    """A part of the run record: undeclared keys are kept, unset keys are not written."""

    model_config = ConfigDict(extra="allow", populate_by_name=True, validate_assignment=False)

    def to_json(self) -> dict[str, Any]:
        """The part as JSON-ready data, with exactly the keys that were set (or read)."""
        return self.model_dump(mode="json", by_alias=True, exclude_unset=True)


class _Whole(RecordPart):
    """A part that states every declared field whenever it exists (null when it has no value):
    the aggregation report has always been written whole, by the rules and in history.json, so
    every key is written whether it was set or read. Undeclared keys are kept as for any part."""

    @model_validator(mode="after")
    def _every_field_stated(self) -> Self:
        self.__pydantic_fields_set__.update(type(self).model_fields)
        return self


class SiteReport(_Whole):
    """How one update took part in an aggregation: one line of `AggregationReport`, built by the
    rules (`aggregation.building_blocks.site_reports`, the input checks of `aggregation.guard`,
    the coordinator's exclusions) and read by the coordinator, the admin API and the web view.

    ``num_examples`` is the count used (after any cohort cap); ``claimed_examples`` is what the
    site sent when a cap changed it. ``weight`` is the update's share of the aggregate (0 when
    excluded or not selected). ``excluded`` with ``reason``: the update was left out (input
    checks, a failed or malformed reply). ``flags``: notes on the update (a clipped count,
    hidden under secure aggregation). ``trimmed_fraction`` (median, trimmed mean): share of
    coordinates at which this update's value was dropped (fractional weight counts for the
    weighted variants); ``trimmed_most`` marks the update(s) dropped most often. ``selected``
    and ``score`` (Krum, multi-Krum): whether the update was chosen and its Krum score.
    ``l2_to_aggregate``: Euclidean distance from this update to the aggregate, all parameters.

    Not `SiteEntry` (the hospital's own side of a round: see there). ``site``, ``num_examples``
    and ``weight`` are always set by the rules; they may be absent only in a hospital's view of
    a report (`server.admin.services.isolation`).
    """

    site: str | None = None
    num_examples: int | None = None
    weight: float | None = None
    excluded: bool = False
    reason: str | None = None
    claimed_examples: int | None = None
    flags: list[str] = Field(default_factory=list)
    trimmed_fraction: float | None = None
    trimmed_most: bool = False
    selected: bool | None = None
    score: float | None = None
    l2_to_aggregate: float | None = None

    @property
    def used(self) -> bool:
        """Whether the update went into the aggregate (not excluded, not left out by Krum)."""
        return not self.excluded and self.selected is not False


class AggregationReport(_Whole):
    """What an aggregation did, per update: the one report type, built by every rule
    (`aggregation.building_blocks.make_result`, secure aggregation, the exact Cox fit) and
    written unchanged as history.json's round ``aggregation``, as ``models/round-NNN.report.json``
    beside the round's model (`server.history.RunHistory`), beside ``fedsplit aggregate``'s
    output (`aggregation.files`) and in the admin database's round (REST rounds).

    ``sites``: one `SiteReport` per update, in input order (then the replies the coordinator
    excluded before aggregating). ``num_examples``: the total count of the updates aggregated.
    ``memory_budget``: the working-memory budget the aggregation ran under (bytes), when it is
    bounded; ``working_bytes``: the working memory the rule's passes actually planned for, at
    most the budget; ``details``: rule-specific summary (geometric median: iterations run,
    objective, why it stopped; ``secure_aggregation``).
    """

    strategy: str | None = None
    params: dict[str, Any] | str = Field(default_factory=dict)
    num_examples: int | None = None
    sites: list[SiteReport] = Field(default_factory=list)
    memory_budget: int | None = None
    working_bytes: int | None = None
    details: dict[str, Any] = Field(default_factory=dict)

    @property
    def excluded(self) -> list[SiteReport]:
        """Sites whose update was left out, with their reasons."""
        return [s for s in self.sites if s.excluded]

    def site(self, name: str) -> SiteReport | None:
        """The first line for hospital ``name``, if any."""
        return next((s for s in self.sites if s.site == name), None)
