"""``history.json`` of a horizontal Flower run: what the coordinator writes after every phase
(`server.history.RunHistory`).

`RunRecord`: the run's status, configuration, model id, agreed table schema, resumes and
`RoundEntry` list; a `RoundEntry` holds the round's `Phase` for training and for evaluation
(each a list of `SiteEntry` plus the aggregated metrics), the aggregation report
(`protocol.aggregation_report.AggregationReport`, one `SiteReport` per update), the saved
model, the server optimizer's step (`ServerOptStep`), the privacy accounting (`RoundPrivacy`)
and timings. Read and written only through these classes (conventions: `protocol.record.common`).

Privacy accounting goes through `RunRecord.record_privacy`; the reply metric a hospital reports
its spent epsilon in is `protocol.horizontal_wire.DP_EPSILON`.
"""

from __future__ import annotations

from typing import Any, ClassVar

from fedsplit.protocol.aggregation_report import AggregationReport, RecordPart
from fedsplit.protocol.horizontal_wire import DP_EPSILON
from fedsplit.protocol.record.common import HISTORY_FILE, JsonFile, Metric, number
from pydantic import Field


class SiteEntry(RecordPart):
    """One hospital in one round's training or evaluation phase: what it sent, or why it sent
    nothing usable.

    A reply: ``site``, ``num_examples`` (the count it reported), ``metrics`` (every metric it
    sent, the weight key included) and for training ``info`` (device, parallel mode); under
    secure aggregation ``secure`` (its count and weights travelled masked). A hospital left out:
    ``excluded`` with ``reason`` (and ``late`` when it did not answer in time). ``epsilon``: its
    spent privacy budget after this round, when DP is on (`RunRecord.record_privacy`).

    Not the same facts as `SiteReport`, the aggregation report's line for the hospital: this is
    the hospital's side of the exchange (its reply, metrics, device, lateness, privacy spent),
    recorded for evaluation phases and for rounds that aggregated nothing too; the report line
    is what the rule made of its update (the count used after a cohort cap, its weight,
    trimming, Krum's choice, its distance), and exists for REST rounds, which have no phase
    entries. The web view joins the two by ``site`` (`server.admin.ui.siterows`).
    """

    site: str | None = None
    num_examples: int | None = None
    metrics: dict[str, Metric] = Field(default_factory=dict)
    info: dict[str, str] = Field(default_factory=dict)
    excluded: bool = False
    late: bool = False
    reason: str | None = None
    epsilon: float | None = None
    secure: bool = False

    def spent_epsilon(self) -> float | None:
        """The recorded epsilon, else an ``epsilon`` metric (runs written by other tools)."""
        if self.epsilon is not None:
            return self.epsilon
        return number(self.metrics.get("epsilon"))


class Phase(RecordPart):
    """A round's training or evaluation: every hospital's entry and the aggregated metrics."""

    sites: list[SiteEntry] = Field(default_factory=list)
    metrics: dict[str, Metric] = Field(default_factory=dict)

    @property
    def examples(self) -> int:
        """Rows behind the phase: the counts of the hospitals not left out."""
        return sum(s.num_examples or 0 for s in self.sites if not s.excluded)


class ServerOptStep(RecordPart):
    """The server optimizer's step on the aggregate: its name, rate, steps taken, and how far
    it moved the model from the rule's aggregate (L2 over every parameter)."""

    name: str
    lr: float | None = None
    step: int
    distance_from_aggregate: float | None = None


class RoundPrivacy(RecordPart):
    """A round's privacy accounting: the DP level, the run's budget (epsilon, delta) and, at
    hospital level, the epsilon every participating hospital has spent after this round."""

    level: str
    epsilon_budget: float
    delta: float
    epsilon: float | None = None


class RoundEntry(RecordPart):
    """One round: training, aggregation, saved model, evaluation and timings.

    ``train_seconds``: from the round's start to its model saved; ``seconds``: to its
    evaluation recorded, or with one message per round (`server.rounds`: the evaluation rides
    on the next round's replies) the round's own exchange, plus the closing evaluation for the
    last round. ``error``: why the round left the global model unchanged.
    """

    round: int
    train: Phase | None = None
    evaluate: Phase | None = None
    aggregation: AggregationReport | None = None
    model: str | None = None
    server_opt: ServerOptStep | None = None
    privacy: RoundPrivacy | None = None
    error: str | None = None
    train_seconds: float | None = None
    seconds: float | None = None

    @property
    def trained(self) -> bool:
        """Whether the round's training phase was recorded."""
        return self.train is not None


class Resume(RecordPart):
    """A restarted coordinator continued the run after round ``after_round`` (at ``at``)."""

    after_round: int
    at: float | None = None


class ValScore(RecordPart):
    """A candidate round's federated validation score (None: not scored) and its rows."""

    round: int
    score: float | None = None
    examples: int | None = None


class Selection(RecordPart):
    """Which round's model is ``global.h5`` (`server.selection`): the rule (``keep``), the
    metric, the round kept, its validation score and every candidate round's score."""

    keep: str
    metric: str | None = None
    rounds_kept: int | None = None
    val_score: float | None = None
    val_metric: list[ValScore] = Field(default_factory=list)


class RunRecord(JsonFile):
    """``history.json``: one horizontal Flower run, written by the coordinator after every phase.

    ``status``: running, finished or failed (with ``error``); ``config``: the Flower run
    config (`protocol.config.RunConfig.to_flower`); ``schema``: the agreed table schema
    (`protocol.schema.Schema` as JSON) and ``schema_warnings``; ``selection``: the kept
    round; ``resumed``: each restart of the coordinator; times are Unix seconds.
    """

    _file: ClassVar[str] = HISTORY_FILE
    _kind: ClassVar[str] = "run record"
    _fix: ClassVar[str] = " Move it away or rewrite it with fedsplit."

    status: str | None = None
    config: dict[str, Any] = Field(default_factory=dict)
    model_id: str | None = None
    #: the state_dict entries that travel every round (None: every tensor; the rest stays at
    #: each hospital: `client.recipes.Recipe.federated`)
    federated: list[str] | None = None
    started_at: float | None = None
    finished_at: float | None = None
    error: str | None = None
    table_schema: dict[str, Any] | None = Field(default=None, alias="schema")
    schema_warnings: list[str] = Field(default_factory=list)
    resumed: list[Resume] = Field(default_factory=list)
    selection: Selection | None = None
    rounds: list[RoundEntry] = Field(default_factory=list)

    def round(self, number: int) -> RoundEntry | None:
        """Round ``number``, if recorded."""
        return next((r for r in self.rounds if r.round == number), None)

    def round_entry(self, number: int) -> RoundEntry:
        """Round ``number``, added (empty) when not recorded yet."""
        entry = self.round(number)
        if entry is None:
            entry = RoundEntry(round=number)
            self.rounds.append(entry)
        return entry

    @property
    def completed_rounds(self) -> int:
        """The last round whose training phase was recorded (0: none)."""
        return max((r.round for r in self.rounds if r.trained), default=0)

    @property
    def model_rounds(self) -> list[RoundEntry]:
        """The rounds that saved a global model, in order."""
        return [r for r in self.rounds if r.model is not None]

    @property
    def final_examples(self) -> int | None:
        """Training rows behind the last saved model (excluded hospitals do not count)."""
        return next((r.aggregation.num_examples for r in reversed(self.rounds)
                     if r.aggregation is not None), None)

    def site_failures(self) -> dict[str, str]:
        """Each hospital's last recorded reason for being left out of training, by site name,
        in name order (hospitals that never failed are absent)."""
        reasons: dict[str, str] = {}
        for entry in self.rounds:
            for site in entry.train.sites if entry.train else []:
                if site.excluded and site.site and site.reason:
                    reasons[site.site] = site.reason
        return dict(sorted(reasons.items()))

    def failure(self, quorum: int = 1) -> str | None:
        """Why this run has no model to present, in one line; None when it trained.

        A run fails when its status is ``failed``, or when no round saved a global model
        (every round left the model unchanged: each hospital's reason is named), or when it
        saved fewer than ``quorum`` rounds' models."""
        from fedsplit.protocol.errors import one_line

        trained = len(self.model_rounds)
        if self.status != "failed" and trained >= max(1, quorum):
            return None
        parts = [self.error] if self.status == "failed" and self.error else []
        if trained < max(1, quorum):
            sites = self.site_failures()
            why = "; ".join(reason if reason.startswith(f"hospital {name},") else
                            f"{name}: {reason}" for name, reason in sites.items())
            errors = sorted({r.error for r in self.rounds if r.error})
            parts.append(f"{trained} of {len(self.rounds)} round(s) trained a model"
                         + (f"; hospitals left out: {why}" if why else "")
                         + (f"; rounds: {'; '.join(errors)}" if errors and not why else ""))
        return one_line(". ".join(parts), limit=2000)

    def spent_epsilon(self) -> dict[str, tuple[float, int]]:
        """Each hospital's last recorded epsilon and the round it was recorded in."""
        spent: dict[str, tuple[float, int]] = {}
        for entry in self.rounds:
            for site in entry.train.sites if entry.train else []:
                eps = site.spent_epsilon()
                if eps is not None and site.site is not None:
                    spent[site.site] = (eps, entry.round)
        return spent

    # -- writing --------------------------------------------------------------------------
    def record_privacy(self, server_round: int, *, level: str, epsilon_budget: float,
                       delta: float, run_epsilon: float | None = None) -> bool:
        """Record round ``server_round``'s privacy accounting; False when it has no training.

        ``run_epsilon`` (hospital-level DP): the epsilon the run has spent after this round,
        given to every hospital whose update was used. Without it (patient-level DP), each
        hospital's own report, the `DP_EPSILON` reply metric, is copied to its ``epsilon``.
        """
        entry = self.round(server_round)
        if entry is None or entry.train is None:
            return False
        for site in entry.train.sites:
            if run_epsilon is not None:
                if not site.excluded and "metrics" in site.model_fields_set:
                    site.epsilon = float(run_epsilon)
            elif (value := number(site.metrics.get(DP_EPSILON))) is not None:
                site.epsilon = value
        privacy = RoundPrivacy(level=level, epsilon_budget=float(epsilon_budget), delta=float(delta))
        if run_epsilon is not None:
            privacy.epsilon = float(run_epsilon)
        entry.privacy = privacy
        return True

