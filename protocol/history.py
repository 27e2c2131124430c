"""The run record: what a horizontal Flower run writes (``OUT/history.json``) and what
``fedsplit simulate`` adds beside it (``summary.json``: baselines, per-round test scores, privacy).

One model per part, read and written only through these classes:

- `RunRecord` (``history.json``): the run's status, configuration, model id, agreed table
  schema, resumes and `RoundEntry` list;
- `RoundEntry`: one round's `Phase` for training and for evaluation (each a list of
  `SiteEntry` plus the aggregated metrics), the aggregation report (`AggregationReport`,
  with one `SiteReport` per update), the saved model, the server optimizer's step
  (`ServerOptStep`), the privacy accounting (`RoundPrivacy`) and timings;
- `RunSummary` (``summary.json``): the `Scores` of the centralized and hospital-alone
  `Baseline` models, of the federated model per round (`SummaryRound`) and at the end, and the
  privacy section (`SummaryPrivacy`).

The JSON on disk keeps the keys fedsplit has always written (a file written before these models
existed loads unchanged): a key is written when the writer set it, so an absent key stays
absent rather than becoming ``null``. Keys a model does not declare are kept as they are
(``extra="allow"``), so a newer writer's field survives an older reader's rewrite. To add a
field: declare it on its model with a default (``None`` or an empty container), set it in the
writer, and describe it in docs/run-record.md. The records are written atomically
(`protocol.atomic`).

Privacy accounting goes through `RunRecord.record_privacy`; the reply metric a hospital reports
its spent epsilon in is `protocol.horizontal_wire.DP_EPSILON`.

Other run kinds (`RUN_KINDS`, told apart by `run_kind`, read by `load_run_record`): a vertical
run's `VerticalRunRecord` and `VerticalSummary`, and the status file of ``fedsplit km`` /
``fedsplit cox`` (`SurvivalAnalysisRecord`).
"""

from __future__ import annotations

import json
import math
from pathlib import Path
from typing import Any, ClassVar, Self

from fedsplit.protocol.aggregation_report import AggregationReport as AggregationReport
from fedsplit.protocol.aggregation_report import RecordPart as _Part
from fedsplit.protocol.aggregation_report import SiteReport as SiteReport
from fedsplit.protocol.atomic import write_json_atomic
from fedsplit.protocol.errors import ConfigError
from fedsplit.protocol.horizontal_wire import DP_EPSILON
from pydantic import Field, ValidationError, model_validator

HISTORY_FILE = "history.json"
SUMMARY_FILE = "summary.json"

#: A metric as recorded: a number, or a list of numbers (Flower allows both in a reply).
Metric = float | list[float]


def scalars(metrics: dict[str, Metric] | None) -> dict[str, float]:
    """The single-number metrics of ``metrics`` (lists dropped)."""
    return {k: float(v) for k, v in (metrics or {}).items() if not isinstance(v, list)}


def _number(value: Any) -> float | None:
    if isinstance(value, bool) or not isinstance(value, int | float):
        return None
    return float(value)


# --- history.json ---------------------------------------------------------------------------
class SiteEntry(_Part):
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
        return _number(self.metrics.get("epsilon"))


class Phase(_Part):
    """A round's training or evaluation: every hospital's entry and the aggregated metrics."""

    sites: list[SiteEntry] = Field(default_factory=list)
    metrics: dict[str, Metric] = Field(default_factory=dict)

    @property
    def examples(self) -> int:
        """Rows behind the phase: the counts of the hospitals not left out."""
        return sum(s.num_examples or 0 for s in self.sites if not s.excluded)


class ServerOptStep(_Part):
    """The server optimizer's step on the aggregate: its name, rate, steps taken, and how far
    it moved the model from the rule's aggregate (L2 over every parameter)."""

    name: str
    lr: float | None = None
    step: int
    distance_from_aggregate: float | None = None


class RoundPrivacy(_Part):
    """A round's privacy accounting: the DP level, the run's budget (epsilon, delta) and, at
    hospital level, the epsilon every participating hospital has spent after this round."""

    level: str
    epsilon_budget: float
    delta: float
    epsilon: float | None = None


class RoundEntry(_Part):
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


class Resume(_Part):
    """A restarted coordinator continued the run after round ``after_round`` (at ``at``)."""

    after_round: int
    at: float | None = None


class ValScore(_Part):
    """A candidate round's federated validation score (None: not scored) and its rows."""

    round: int
    score: float | None = None
    examples: int | None = None


class Selection(_Part):
    """Which round's model is ``global.h5`` (`server.selection`): the rule (``keep``), the
    metric, the round kept, its validation score and every candidate round's score."""

    keep: str
    metric: str | None = None
    rounds_kept: int | None = None
    val_score: float | None = None
    val_metric: list[ValScore] = Field(default_factory=list)


class _JsonFile(_Part):
    """A whole JSON file of the run: read and checked (`from_json`, `load`), written atomically
    (`save`); `ConfigError` names what is wrong."""

    _file: ClassVar[str]  # the file's usual name
    _kind: ClassVar[str]  # what it is, in error messages
    _fix: ClassVar[str] = ""  # advice after a malformed record

    @classmethod
    def from_json(cls, data: Any, *, source: str | None = None) -> Self:
        """Check and read the file's content (as parsed JSON)."""
        source = source or cls._file
        if not isinstance(data, dict):
            raise ConfigError(f"{source} must hold a JSON object (a fedsplit {cls._kind}). "
                              f"Received: {type(data).__name__}")
        try:
            return cls.model_validate(data)
        except ValidationError as e:
            raise ConfigError(f"{source} is not a fedsplit {cls._kind}: {_first_error(e)}."
                              f"{cls._fix} Received: {source}") from e

    @classmethod
    def load(cls, path: str | Path) -> Self:
        """Read ``path``; `ConfigError` when unreadable or malformed."""
        return cls.from_json(_read(Path(path)), source=str(path))

    def save(self, path: str | Path) -> None:
        """Write to ``path`` atomically."""
        write_json_atomic(path, self.to_json())


class RunRecord(_JsonFile):
    """``history.json``: one horizontal Flower run, written by the coordinator after every phase.

    ``status``: running, finished or failed (with ``error``); ``config``: the Flower run
    config (`protocol.config.RunConfig.to_flower`); ``schema``: the agreed table schema
    (`protocol.schema.Schema` as JSON) and ``schema_warnings``; ``selection``: the kept
    round; ``resumed``: each restart of the coordinator; times are Unix seconds.
    """

    _file: ClassVar[str] = "history.json"
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
            elif (value := _number(site.metrics.get(DP_EPSILON))) is not None:
                site.epsilon = value
        privacy = RoundPrivacy(level=level, epsilon_budget=float(epsilon_budget), delta=float(delta))
        if run_epsilon is not None:
            privacy.epsilon = float(run_epsilon)
        entry.privacy = privacy
        return True


# --- summary.json ---------------------------------------------------------------------------
class Scores(_Part):
    """A model scored on the held-out test rows: pooled (``metrics``), on each hospital's
    (``per_site``) and their unweighted mean (``mean_per_site``)."""

    metrics: dict[str, float] = Field(default_factory=dict)
    per_site: dict[str, dict[str, float]] = Field(default_factory=dict)
    mean_per_site: dict[str, float] = Field(default_factory=dict)
    #: hospitals scored with their own tensors that never travel (FedBN): ``metrics`` is then
    #: each hospital's weighted by its test rows
    site_models: list[str] = Field(default_factory=list)


class Baseline(Scores):
    """A model trained without federation: centralized (pooled rows, no ``site``) or one
    hospital alone (``site``), with its rows, optimizer steps, the round kept by validation
    and its validation scores."""

    site: str | None = None
    num_examples: int | None = None
    steps: int | None = None
    rounds_kept: int | None = None
    val_metric: list[float] = Field(default_factory=list)
    val_examples: int | None = None


class FederatedScores(Scores):
    """The federated model kept (``global.h5``): its scores, training rows and file, and the
    selection as the baselines report theirs: ``keep`` (``best-val`` or ``last``), the round
    kept (``rounds_kept``), the federated validation score of every candidate round
    (``val_metric``, None where a round was not scored; ``val_rounds`` their numbers), the
    kept round's validation rows (``val_examples``) and the last round's file (``last_model``)."""

    num_examples: int | None = None
    model: str | None = None
    keep: str | None = None
    rounds_kept: int | None = None
    val_metric: list[float | None] = Field(default_factory=list)
    val_rounds: list[int] = Field(default_factory=list)
    val_examples: int | None = None
    last_model: str | None = None


class PriorTest(_Part):
    """One hospital's likelihood-ratio test of ``--personalize prior``: the ``statistic`` (may be
    infinite), its degrees of freedom, ``p_value``, whether the refitted bias was ``adopted`` and
    ``bias_shift`` (refitted minus global bias, per output, adopted or not)."""

    statistic: float | None = None
    df: int | None = None
    p_value: float | None = None
    adopted: bool = False
    bias_shift: list[float] = Field(default_factory=list)


class Personalized(Scores):
    """Each hospital's fine-tuned copy of the final model (``--personalize``): ``steps`` is
    the step budget (a number, ``alone`` or ``prior``), ``scope`` the weights tuned (``all``
    or ``bias``), ``steps_per_site`` each hospital's budget (or ``prior_test``: each
    hospital's record of the bias test), ``fine_tune_examples`` the rows each tuned on."""

    steps: int | str | None = None
    scope: str | None = None
    steps_per_site: dict[str, int] = Field(default_factory=dict)
    prior_test: dict[str, PriorTest] | None = None
    fine_tune_examples: dict[str, int] = Field(default_factory=dict)
    num_examples: int | None = None


class SummaryRound(Scores):
    """The federated model of one round on the test rows, and the hospitals' own evaluation."""

    round: int
    site_evaluation: dict[str, Metric] = Field(default_factory=dict)


class SitePrivacy(_Part):
    """A hospital's last spent epsilon and the round it was recorded in."""

    epsilon: float
    round: int


class MembershipAUC(_Part):
    """A membership-inference AUC (0.5: the attacker learns nothing) with its 95% interval
    (``ci95``: low, high) and the ``attack`` that gave it (the stronger one)."""

    auc: float
    ci95: list[float] = Field(default_factory=list)
    attack: str | None = None


class AttackScores(_Part):
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


class PrivacyAudit(_Part):
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


class AuditResult(_JsonFile, PrivacyAudit):
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


class SummaryPrivacy(_Part):
    """``summary.json``'s privacy section: the DP spec, budget, each hospital's last epsilon
    and, after ``fedsplit privacy-audit``, the membership-inference ``audit``."""

    dp: str | None = None
    level: str | None = None
    epsilon_budget: float | None = None
    delta: float | None = None
    per_site: dict[str, SitePrivacy] = Field(default_factory=dict)
    audit: PrivacyAudit | None = None


class ServerOptSettings(_Part):
    """The server optimizer a run used (``--server-opt`` and its settings)."""

    name: str
    lr: float | None = None
    beta1: float | None = None
    beta2: float | None = None
    tau: float | None = None
    momentum: float | None = None


class SchemaSummary(_Part):
    """The agreed table schema in brief: its digest, column and feature counts, the labels and
    the warnings raised while agreeing on it."""

    digest: str | None = None
    columns: int | None = None
    features: int | None = None
    labels: list[str] = Field(default_factory=list)
    warnings: list[str] = Field(default_factory=list)


class RecipeSummary(_Part):
    """The recipe every hospital trained (`protocol.recipe.RecipeIdentity`): name, version and
    validated parameters."""

    name: str | None = None
    version: str | None = None
    params: dict[str, Any] = Field(default_factory=dict)


class AttackSummary(_Part):
    """A simulated attack (``--attack``, ``--attackers``): its kind and the hostile hospitals."""

    kind: str | None = None
    hostile_sites: list[str] = Field(default_factory=list)


class SurvivalFiles(_Part):
    """A survival run's summary files (paths as written): the pooled
    Kaplan-Meier curve (``km``, JSON; ``km_plot``, PNG) and the kept model's Breslow
    ``baseline``."""

    km: str | None = None
    km_plot: str | None = None
    baseline: str | None = None


class RunSummary(_JsonFile):
    """``summary.json`` of ``fedsplit simulate``: baselines and the federated model's scores.

    The run: ``task``, ``recipe``, ``dataset`` (a bundled name, or each ``--site`` file),
    ``partition``, the hospitals (``sites``, ``site_names``, ``left_out``: indices partitioned
    but not run), ``attack``. ``metric_names``: what the recipe scores; ``selection_metric``: the
    metric models are kept and compared by; ``test_examples`` and ``test_examples_per_site``:
    the held-out test rows, pooled and per hospital; ``steps_per_round`` and ``step_rows``: each
    hospital's optimizer steps per round and rows per step; ``survival``: a survival run's files.
    """

    _file: ClassVar[str] = "summary.json"
    _kind: ClassVar[str] = "run summary"

    task: str | None = None
    recipe: RecipeSummary | None = None
    metric_names: list[str] = Field(default_factory=list)
    config: dict[str, Any] = Field(default_factory=dict)
    dataset: str | list[str] | None = None
    strategy: str | None = None
    strategy_params: dict[str, Any] = Field(default_factory=dict)
    server_opt: ServerOptSettings | None = None
    attack: AttackSummary | None = None
    sites: int | None = None
    site_names: list[str] = Field(default_factory=list)
    partition: str | None = None
    left_out: list[int] = Field(default_factory=list)
    selection_metric: str | None = None
    model_id: str | None = None
    test_examples: int | None = None
    test_examples_per_site: dict[str, int] = Field(default_factory=dict)
    steps_per_round: dict[str, int] = Field(default_factory=dict)
    step_rows: dict[str, int] = Field(default_factory=dict)
    table_schema: SchemaSummary | None = Field(default=None, alias="schema")
    centralized: Baseline | None = None
    local_only: list[Baseline] = Field(default_factory=list)
    federated: FederatedScores | None = None
    personalized: Personalized | None = None
    survival: SurvivalFiles | None = None
    rounds: list[SummaryRound] = Field(default_factory=list)
    privacy: SummaryPrivacy | None = None
    #: one line per party whose own data or code failed (a hospital left out of every round,
    #: a baseline that could not train): the run wrote what it could and exited non-zero
    failures: list[str] = Field(default_factory=list)

    def round_metric(self, key: str) -> list[float]:
        """Metric ``key`` of the federated model on the pooled test rows, round by round."""
        return [r.metrics.get(key, math.nan) for r in self.rounds]

    @property
    def num_rounds(self) -> int | None:
        """The rounds the run was configured for (its config's ``num-server-rounds``)."""
        value = self.config.get("num-server-rounds")
        return value if isinstance(value, int) and not isinstance(value, bool) else None


def privacy_section(record: RunRecord, *, dp: str | None, level: str | None,
                    epsilon_budget: float | None, delta: float | None) -> SummaryPrivacy:
    """``summary.json``'s privacy section from a run record: each hospital's last epsilon."""
    return SummaryPrivacy(dp=dp, level=level, epsilon_budget=epsilon_budget, delta=delta,
                          per_site={site: SitePrivacy(epsilon=eps, round=rnd)
                                    for site, (eps, rnd) in record.spent_epsilon().items()})


def _read(path: Path) -> Any:
    try:
        return json.loads(path.read_text())
    except (OSError, ValueError) as e:
        raise ConfigError(f"{path} is not readable JSON ({e}). Received: {path}") from e


def _first_error(e: ValidationError) -> str:
    err = e.errors()[0]
    where = ".".join(str(p) for p in err["loc"]) or "(top level)"
    return f"{where}: {err['msg']} ({e.error_count()} problem(s) in all)"


# -- run kinds and the vertical run record ---------------------------------------------------------

#: What wrote a ``history.json``: a horizontal Flower run (`RunRecord`), a vertical one
#: (`VerticalRunRecord`), or ``fedsplit km`` / ``fedsplit cox`` (a status file without rounds
#: whose ``mode`` names the analysis: `SurvivalAnalysisRecord`).
RUN_KINDS = ("horizontal", "vertical", "survival-km", "survival-cox")
#: Keys of a vertical run's configuration (`protocol.vertical.config.VerticalConfig.to_flower`)
#: that a horizontal one never has: how a file written before ``kind`` existed is told apart.
_VERTICAL_CONFIG_KEYS = frozenset({"fusion-params", "site-files", "site-out-dirs"})


def run_kind(data: dict[str, Any]) -> str:
    """The kind of run a parsed ``history.json`` records (`RUN_KINDS`): its ``kind`` when written
    (since issue 34), else told from its keys (files written before)."""
    kind = data.get("kind")
    if isinstance(kind, str) and kind in RUN_KINDS:
        return kind
    config = data.get("config")
    if "overlap" in data or "psi_seconds" in data or (
            isinstance(config, dict) and _VERTICAL_CONFIG_KEYS & set(config)):
        return "vertical"
    mode = data.get("mode")
    if mode in ("km", "cox") and not data.get("rounds"):
        return f"survival-{mode}"
    return "horizontal"


class VerticalEvaluation(_Part):
    """The fused model scored on held-out (or validation) rows
    (`server.vertical.coordinator.VerticalCoordinator.evaluate`): ``metrics`` on all
    ``num_examples`` rows, ``complete_rows`` of which every site holds, and
    ``metrics_complete_rows`` on those when some rows lack a site (absent when none does)."""

    num_examples: int
    metrics: dict[str, Metric] = Field(default_factory=dict)
    complete_rows: int | None = None
    metrics_complete_rows: dict[str, Metric] | None = None


class VerticalRound(_Part):
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


class VerticalSelection(_Part):
    """The kept round of a vertical run: the rule (``best-val`` or ``last``), the metric, the
    round kept, its validation score and every round's (None: not scored)."""

    keep: str
    metric: str | None = None
    rounds_kept: int | None = None
    val_score: float | None = None
    val_metric: list[float | None] = Field(default_factory=list)


class SiteOverlap(_Part):
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


class ArrayShape(_Part):
    """An array a vertical message carried: its dtype and its width (shape after the rows)."""

    dtype: str
    width: list[int] = Field(default_factory=list)


class MessageInventory(_Part):
    """What one vertical message type carried in one direction (``"<type> to-site"`` /
    ``"<type> from-site"``): its arrays by name and its config keys, checked against
    `protocol.vertical.wire.ALLOWED`."""

    arrays: dict[str, ArrayShape] = Field(default_factory=dict)
    config: list[str] = Field(default_factory=list)


class VerticalRunRecord(_JsonFile):
    """``history.json`` of a vertical run (``fedsplit vertical simulate`` / the vertical
    coordinator, `server.vertical.app`), written after every phase.

    ``overlap``: each site's ID alignment (`SiteOverlap`); ``psi_seconds``; the label
    ``task``; the train, test and validation row counts; each site's ``input_widths``;
    ``rounds`` (`VerticalRound`); ``selection`` (`VerticalSelection`); where the kept round's
    site models (``site_models``) and the last round's (``last_site_models``) were saved; the
    message ``inventory`` (`MessageInventory` per message type and direction) and traffic. Files
    written before ``kind`` existed load unchanged.
    """

    _file: ClassVar[str] = "history.json"
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


#: The analyses ``fedsplit km`` / ``fedsplit cox`` run (`SurvivalAnalysisRecord.mode`).
SURVIVAL_MODES = ("km", "cox")


class SurvivalAnalysisRecord(_JsonFile):
    """``history.json`` of ``fedsplit km`` / ``fedsplit cox`` (`server.survival.app`): the status
    of the analysis whose result lies beside it (``km.json`` / ``cox.json``); no rounds.

    ``kind``: ``survival-km`` or ``survival-cox`` (written since issue 34; older files hold only
    ``status``, ``mode`` and on failure ``error``, and load unchanged); ``mode``: ``km`` or
    ``cox``; times are Unix seconds."""

    _file: ClassVar[str] = "history.json"
    _kind: ClassVar[str] = "survival analysis status"
    _fix: ClassVar[str] = " Run fedsplit km or fedsplit cox again."

    kind: str | None = None
    status: str
    mode: str
    error: str | None = None
    started_at: float | None = None
    finished_at: float | None = None

    @model_validator(mode="after")
    def _mode_and_kind_agree(self) -> Self:
        if self.mode not in SURVIVAL_MODES:
            raise ValueError(f"mode is one of {SURVIVAL_MODES}, got {self.mode!r}")
        if self.kind is not None and self.kind != f"survival-{self.mode}":
            raise ValueError(f"kind {self.kind!r} does not match mode {self.mode!r}")
        return self

    @classmethod
    def start(cls, mode: str, *, at: float) -> SurvivalAnalysisRecord:
        """The record of an analysis that has just started (kind, status ``running``, mode)."""
        return cls(kind=f"survival-{mode}", status="running", mode=mode, started_at=at)

    def end(self, status: str, *, at: float, error: str | None = None) -> None:
        """Mark the analysis ``finished`` or ``failed`` (with ``error``) at ``at``."""
        self.status = status
        self.finished_at = at
        if error is not None:
            self.error = error


AnyRunRecord = RunRecord | VerticalRunRecord | SurvivalAnalysisRecord


def load_run_record(path: str | Path) -> AnyRunRecord:
    """Read any run's ``history.json`` as the model of its kind (`run_kind`); `ConfigError`
    when it is unreadable or not a run record of that kind."""
    return run_record_from_json(_read(Path(path)), source=str(path))


def run_record_from_json(data: Any, *, source: str = HISTORY_FILE) -> AnyRunRecord:
    """Parsed ``history.json`` content as the model of its kind (`run_kind`); every kind has
    ``status`` and ``error``. `ConfigError` names what is wrong."""
    kind = run_kind(data) if isinstance(data, dict) else "horizontal"
    if kind == "vertical":
        return VerticalRunRecord.from_json(data, source=source)
    if kind in ("survival-km", "survival-cox"):
        return SurvivalAnalysisRecord.from_json(data, source=source)
    return RunRecord.from_json(data, source=source)


class VerticalScores(_Part):
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


class VerticalSummaryRound(_Part):
    """A round of the federation in ``summary.json``: its held-out ``metrics``, training loss,
    steps so far and validation scores (None without validation rows)."""

    round: int
    metrics: dict[str, Metric] = Field(default_factory=dict)
    train_loss: float | None = None
    steps: int | None = None
    val_metrics: dict[str, Metric] | None = None


class VerticalSummary(_JsonFile):
    """``summary.json`` of ``fedsplit vertical simulate`` (`orchestration.vertical.experiment`):
    the fused model (``federated``), the ``centralized`` baseline and each site alone
    (``local_only``), on the same test rows (``test_examples``); the run's ``task``, fusion
    ``params`` (`protocol.vertical.config.FusionParams` as a JSON object), ``dataset`` (a
    bundled name or the site files), ``sites``, ``fill``, each site's ``overlap``,
    ``psi_seconds``, ``train_rows``, the fused model's ``keep`` rule, each round
    (`VerticalSummaryRound`) and the message ``inventory``."""

    _file: ClassVar[str] = "summary.json"
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


class VerticalFills(_JsonFile):
    """``fills.json`` of ``fedsplit vertical compare-fills``: every fill on the same split."""

    _file: ClassVar[str] = "fills.json"
    _kind: ClassVar[str] = "vertical fill comparison"

    fills: list[VerticalFill] = Field(default_factory=list)
