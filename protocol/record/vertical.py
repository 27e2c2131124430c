"""The records of a vertical run (``fedsplit vertical simulate``, the vertical coordinator):
``history.json`` (`VerticalRunRecord`, its `VerticalRound` list, `VerticalSelection`, each
site's `SiteOverlap` and the message inventory), ``summary.json`` (`VerticalSummary`: the fused
model and the baselines as `VerticalScores`) and ``fills.json`` (`VerticalFills`). Read and
written only through these classes (conventions: `protocol.record.common`).
"""

from __future__ import annotations

from typing import Any, ClassVar

from fedsplit.protocol.aggregation_report import RecordPart
from fedsplit.protocol.record.common import HISTORY_FILE, SUMMARY_FILE, JsonFile, Metric
from pydantic import Field


class VerticalEvaluation(RecordPart):
    """The fused model scored on held-out (or validation) rows
    (`server.vertical.coordinator.VerticalCoordinator.evaluate`): ``metrics`` on all
    ``num_examples`` rows, ``complete_rows`` of which every site holds, and
    ``metrics_complete_rows`` on those when some rows lack a site (absent when none does)."""

    num_examples: int
    metrics: dict[str, Metric] = Field(default_factory=dict)
    complete_rows: int | None = None
    metrics_complete_rows: dict[str, Metric] | None = None


class VerticalRound(RecordPart):
    """One round of a vertical run: the fused model's training loss and steps, its held-out
    ``metrics`` (on ``num_examples`` test rows, ``complete_rows`` of which every site holds;
    ``metrics_complete_rows`` when some rows lack a site) and its validation scores
    (``val_metrics`` on ``val_examples`` rows; None without validation rows)."""

    round: int
    train_loss: float | None = None
    steps: int | None = None
    seconds: float | None = None
    metrics: dict[str, Metric] = Field(default_factory=dict)
    num_examples: int | None = None
    metrics_complete_rows: dict[str, Metric] | None = None
    val_metrics: dict[str, Metric] | None = None
    val_examples: int | None = None
    complete_rows: int | None = None

    @classmethod
    def of(cls, number: int, *, train_loss: float, steps: int, seconds: float,
           test: VerticalEvaluation, val: VerticalEvaluation | None,
           val_examples: int) -> VerticalRound:
        """The round as the coordinator records it: its training, its held-out evaluation
        (``test``, with exactly the keys it was evaluated with) and its validation one."""
        return cls(round=number, train_loss=train_loss, steps=steps, seconds=seconds,
                   **test.model_dump(exclude_unset=True),
                   val_metrics=None if val is None else dict(val.metrics), val_examples=val_examples)


class VerticalSelection(RecordPart):
    """The kept round of a vertical run: the rule (``best-val`` or ``last``), the metric, the
    round kept, its validation score and every round's (None: not scored)."""

    keep: str
    metric: str | None = None
    rounds_kept: int | None = None
    val_score: float | None = None
    val_metric: list[float | None] = Field(default_factory=list)


class SiteOverlap(RecordPart):
    """One site's ID alignment (PSI) with the label holder: the site's rows, the label holder's
    (``label_rows``), the patients both hold (``shared``) as a share of each, and ``status``:
    ``ok``, or ``low`` under 30% of the label holder's patients."""

    site: str
    site_rows: int | None = None
    label_rows: int | None = None
    shared: int | None = None
    share_of_labels: float | None = None
    share_of_site: float | None = None
    status: str | None = None


class ArrayShape(RecordPart):
    """An array a vertical message carried: its dtype and its width (shape after the rows)."""

    dtype: str
    width: list[int] = Field(default_factory=list)


class MessageInventory(RecordPart):
    """What one vertical message type carried in one direction (``"<type> to-site"`` /
    ``"<type> from-site"``): its arrays by name and its config keys, checked against
    `protocol.vertical.wire.ALLOWED`."""

    arrays: dict[str, ArrayShape] = Field(default_factory=dict)
    config: list[str] = Field(default_factory=list)


class VerticalRunRecord(JsonFile):
    """``history.json`` of a vertical run (``fedsplit vertical simulate`` / the vertical
    coordinator, `server.vertical.app`), written after every phase.

    ``overlap``: each site's ID alignment (`SiteOverlap`); ``psi_seconds``; the label
    ``task``; the train, test and validation row counts; each site's ``input_widths``;
    ``rounds`` (`VerticalRound`); ``selection`` (`VerticalSelection`); where the kept round's
    site models (``site_models``) and the last round's (``last_site_models``) were saved; the
    message ``inventory`` (`MessageInventory` per message type and direction) and traffic. Files
    written before ``kind`` existed load unchanged.
    """

    _file: ClassVar[str] = HISTORY_FILE
    _kind: ClassVar[str] = "vertical run record"
    _fix: ClassVar[str] = " Move it away or rewrite it with fedsplit."

    kind: str = "vertical"
    status: str | None = None
    config: dict[str, Any] = Field(default_factory=dict)
    started_at: float | None = None
    finished_at: float | None = None
    error: str | None = None
    overlap: list[SiteOverlap] | None = None
    psi_seconds: float | None = None
    task: str | None = None
    train_rows: int | None = None
    test_rows: int | None = None
    val_rows: int | None = None
    input_widths: dict[str, int] | list[int] | None = None
    rounds: list[VerticalRound] = Field(default_factory=list)
    selection: VerticalSelection | None = None
    site_models: list[str] | None = None
    last_site_models: list[str] | None = None
    inventory: dict[str, MessageInventory] | None = None
    messages: int | None = None
    bytes_to_sites: int | None = None
    bytes_from_sites: int | None = None

    def kept_round(self) -> VerticalRound | None:
        """The round the selection kept (None before one is)."""
        kept = self.selection.rounds_kept if self.selection is not None else None
        return next((r for r in self.rounds if r.round == kept), None)


class VerticalScores(RecordPart):
    """One model of a vertical run scored on the held-out test rows: the fused federation's
    kept round (``summary.json``'s ``federated``), the centralized model (every site's columns
    pooled) or one site alone (``site``); the baselines are `orchestration.vertical.local.train_kept`'s.

    Every model: ``metrics`` (``metrics_complete_rows``: on the rows every site holds, when some
    do not), ``keep``, ``rounds_kept`` (chosen on ``val_rows`` validation rows; ``val_metric``:
    each round's validation score, None when not scored) and ``final_metrics`` (its last
    round's). ``num_examples`` is the fused model's test rows but a baseline's training rows (a
    baseline's test rows: ``test_examples``; its every round's metrics: ``per_round``). The fused
    model adds where its kept and last heads and site branches were saved (``model``,
    ``site_models``, ``last_model``, ``last_site_models``), the federation's ``seconds`` and
    ``messages``."""

    site: str | None = None
    metrics: dict[str, Metric] = Field(default_factory=dict)
    num_examples: int | None = None
    test_examples: int | None = None
    metrics_complete_rows: dict[str, Metric] | None = None
    keep: str | None = None
    rounds_kept: int | None = None
    val_metric: list[float | None] = Field(default_factory=list)
    val_rows: int | None = None
    final_metrics: dict[str, Metric] | None = None
    per_round: list[dict[str, Metric]] | None = None
    model: str | None = None
    site_models: list[str] | None = None
    last_model: str | None = None
    last_site_models: list[str] | None = None
    seconds: float | None = None
    messages: int | None = None


class VerticalSummaryRound(RecordPart):
    """A round of the federation in ``summary.json``: its held-out ``metrics``, training loss,
    steps so far and validation scores (None without validation rows)."""

    round: int
    metrics: dict[str, Metric] = Field(default_factory=dict)
    train_loss: float | None = None
    steps: int | None = None
    val_metrics: dict[str, Metric] | None = None


class VerticalSummary(JsonFile):
    """``summary.json`` of ``fedsplit vertical simulate`` (`orchestration.vertical.experiment`):
    the fused model (``federated``), the ``centralized`` baseline and each site alone
    (``local_only``), on the same test rows (``test_examples``); the run's ``task``, fusion
    ``params`` (`protocol.vertical.config.FusionParams` as a JSON object), ``dataset`` (a
    bundled name or the site files), ``sites``, ``fill``, each site's ``overlap``,
    ``psi_seconds``, ``train_rows``, the fused model's ``keep`` rule, each round
    (`VerticalSummaryRound`) and the message ``inventory``."""

    _file: ClassVar[str] = SUMMARY_FILE
    _kind: ClassVar[str] = "vertical run summary"

    task: str | None = None
    params: dict[str, Any] = Field(default_factory=dict)
    dataset: str | list[str] | None = None
    sites: int | None = None
    fill: str | None = None
    overlap: list[SiteOverlap] = Field(default_factory=list)
    psi_seconds: float | None = None
    train_rows: int | None = None
    test_examples: int | None = None
    keep: str | None = None
    federated: VerticalScores | None = None
    centralized: VerticalScores | None = None
    local_only: list[VerticalScores] = Field(default_factory=list)
    rounds: list[VerticalSummaryRound] = Field(default_factory=list)
    inventory: dict[str, MessageInventory] = Field(default_factory=dict)


class VerticalFill(VerticalEvaluation):
    """One fill in ``fills.json`` (``fedsplit vertical compare-fills``): its name, the training
    rows, and the held-out evaluation (`VerticalEvaluation`)."""

    fill: str
    train_rows: int | None = None


class VerticalFills(JsonFile):
    """``fills.json`` of ``fedsplit vertical compare-fills``: every fill on the same split."""

    _file: ClassVar[str] = "fills.json"
    _kind: ClassVar[str] = "vertical fill comparison"

    fills: list[VerticalFill] = Field(default_factory=list)
