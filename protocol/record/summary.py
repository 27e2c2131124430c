"""``summary.json`` of ``fedsplit simulate`` (`orchestration.experiment`): the `Scores` of the
centralized and hospital-alone `Baseline` models, of the federated model per round
(`SummaryRound`) and at the end (`FederatedScores`), the personalized copies, the run's settings
and the privacy section (`protocol.record.privacy.SummaryPrivacy`). Read and written only
through these classes (conventions: `protocol.record.common`).
"""

from __future__ import annotations

import math
from typing import Any, ClassVar

from fedsplit.protocol.aggregation_report import RecordPart
from fedsplit.protocol.record.common import SUMMARY_FILE, JsonFile, Metric
from fedsplit.protocol.record.horizontal import RunRecord
from fedsplit.protocol.record.privacy import SitePrivacy, SummaryPrivacy
from pydantic import Field


class Scores(RecordPart):
    """A model scored on the held-out test rows: pooled (``metrics``), on each hospital's
    (``per_site``) and their unweighted mean (``mean_per_site``)."""

    metrics: dict[str, float] = Field(default_factory=dict)
    per_site: dict[str, dict[str, float]] = Field(default_factory=dict)
    mean_per_site: dict[str, float] = Field(default_factory=dict)
    #: hospitals scored with their own tensors that never travel (FedBN): ``metrics`` is then
    #: each hospital's weighted by its test rows
    site_models: list[str] = Field(default_factory=list)

    def fields(self) -> dict[str, Any]:
        """The scores as set, for a model that extends them (`Baseline`, `SummaryRound`,
        `FederatedScores`): ``Baseline(..., **scores.fields())``."""
        return self.model_dump(exclude_unset=True)


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


class PriorTest(RecordPart):
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



class ServerOptSettings(RecordPart):
    """The server optimizer a run used (``--server-opt`` and its settings)."""

    name: str
    lr: float | None = None
    beta1: float | None = None
    beta2: float | None = None
    tau: float | None = None
    momentum: float | None = None


class SchemaSummary(RecordPart):
    """The agreed table schema in brief: its digest, column and feature counts, the labels and
    the warnings raised while agreeing on it."""

    digest: str | None = None
    columns: int | None = None
    features: int | None = None
    labels: list[str] = Field(default_factory=list)
    warnings: list[str] = Field(default_factory=list)


class RecipeSummary(RecordPart):
    """The recipe every hospital trained (`protocol.recipe.RecipeIdentity`): name, version and
    validated parameters."""

    name: str | None = None
    version: str | None = None
    params: dict[str, Any] = Field(default_factory=dict)


class AttackSummary(RecordPart):
    """A simulated attack (``--attack``, ``--attackers``): its kind and the hostile hospitals."""

    kind: str | None = None
    hostile_sites: list[str] = Field(default_factory=list)


class SurvivalFiles(RecordPart):
    """A survival run's summary files (paths as written): the pooled
    Kaplan-Meier curve (``km``, JSON; ``km_plot``, PNG) and the kept model's Breslow
    ``baseline``."""

    km: str | None = None
    km_plot: str | None = None
    baseline: str | None = None


class RunSummary(JsonFile):
    """``summary.json`` of ``fedsplit simulate``: baselines and the federated model's scores.

    The run: ``task``, ``recipe``, ``dataset`` (a bundled name, or each ``--site`` file),
    ``partition``, the hospitals (``sites``, ``site_names``, ``left_out``: indices partitioned
    but not run), ``attack``. ``metric_names``: what the recipe scores; ``selection_metric``: the
    metric models are kept and compared by; ``test_examples`` and ``test_examples_per_site``:
    the held-out test rows, pooled and per hospital; ``steps_per_round`` and ``step_rows``: each
    hospital's optimizer steps per round and rows per step; ``survival``: a survival run's files.
    """

    _file: ClassVar[str] = SUMMARY_FILE
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


class ComparedRun(RecordPart):
    """One federation of ``fedsplit compare-strategies``: its strategy and parameters, the
    compared metric of its kept model (``final``), of each round's model and of the centralized
    baseline on the same test rows (each from the run's `RunSummary`)."""

    strategy: str | None = None
    strategy_params: dict[str, Any] = Field(default_factory=dict)
    final: float | None = None
    per_round: list[float] = Field(default_factory=list)
    centralized: float | None = None


class StrategyComparison(JsonFile):
    """``comparison.json`` of ``fedsplit compare-strategies`` (`orchestration.comparison`): the
    ``dataset``, ``sites``, ``partition``, the ``attack`` and its ``hostile_sites``, the
    ``rounds``, the compared ``metric`` and each run (`ComparedRun`) by its label."""

    _file: ClassVar[str] = "comparison.json"
    _kind: ClassVar[str] = "strategy comparison"

    dataset: str | None = None
    sites: int | None = None
    partition: str | None = None
    attack: str | None = None
    hostile_sites: list[str] = Field(default_factory=list)
    rounds: int | None = None
    metric: str | None = None
    runs: dict[str, ComparedRun] = Field(default_factory=dict)

