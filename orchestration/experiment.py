"""A simulated federation end to end: data, sites, Flower run, baselines, summary, plot.

`run_experiment` is what ``fedsplit simulate`` (and ``compare-strategies``) call. Each hospital
(`SiteTable`: a name, its training rows and its own held-out test patients) comes from a
``--site NAME=PATH`` file (a test split is cut from it, or ``NAME=TRAIN:TEST`` gives one), from
a bundled dataset partitioned across ``--sites`` (a test split cut from each site's share), or
from ``heart-disease``, split by its four real hospitals. `stage_sites` writes each hospital's
training rows, as they came, into its own folder and their names and fingerprints into the
simulation's roster (`protocol.roster`; resuming an unfinished run on other data is refused
before Flower starts), and checks the schema merge the hospitals will run (a conflict stops
here, with the same error). The
federation runs in Flower's simulation engine; then the federated model, the centralized model
and each hospital-alone model (the same model, trained to the same optimizer-step budget:
`baseline_steps`, keeping the round that scores best by the task metric on the hospitals'
held-out evaluation rows, ties to the later round: `orchestration.selection`) are scored
on every hospital's test patients (``per_site``), their mean (``mean_per_site``, FLamby's
convention) and the pooled test rows (``metrics``). With ``personalize`` > 0 (mini-batches) or
``"alone"`` (each hospital's hospital-alone step budget), every hospital also fine-tunes the
final global model on its own training rows (`orchestration.personalize`), scored on its own
test patients (``personalized``); with ``"prior"`` each hospital refits the final bias instead,
when a likelihood-ratio test on its own rows says its label mix differs.
"""

from __future__ import annotations

import multiprocessing
import os
import shutil
from collections.abc import Callable, Mapping, Sequence
from concurrent.futures import ProcessPoolExecutor
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import numpy as np
from fedsplit.client.data import (
    HEART,
    HEART_HOSPITALS,
    HEART_ID,
    HEART_TARGET,
    Dataset,
    encode_table,
    load_bundled,
    load_heart_disease,
    load_site_file,
    partition,
    read_local_state,
    read_table,
    read_with_recipe,
    split_indices,
    write_staged,
)
from fedsplit.client.failures import hospital_stage
from fedsplit.client.models import SiteModel, build_model, load_model, recipe_of
from fedsplit.client.node_config import NodeConfig
from fedsplit.client.policy.paths import STATE_FOLDER
from fedsplit.client.recipes import ModelInputs
from fedsplit.client.site import (
    effective_recipe,
    recipe_line,
    site_recipe,
    split_site,
    task_recipe,
)
from fedsplit.client.survival import tcga
from fedsplit.client.train import (
    fit_steps,
    local_steps_per_round,
    score,
    set_statistics,
    step_batch_size,
)
from fedsplit.orchestration.certs import site_names
from fedsplit.orchestration.datasets import table_keys
from fedsplit.orchestration.fingerprint import data_fingerprint
from fedsplit.orchestration.flower_runtime import check_ray_address, simulation
from fedsplit.orchestration.personalize import ALONE, PRIOR, parse_budget, personalize, resolve_scope
from fedsplit.orchestration.plots import plot_rounds
from fedsplit.orchestration.selection import BestRound
from fedsplit.orchestration.site_files import SiteSource, check_site_files, parse_site
from fedsplit.orchestration.survival_baselines import exact_baseline, fitted_exactly
from fedsplit.orchestration.tables import SITE_TABLE_FILE, write_site_table
from fedsplit.orchestration.task_kinds import draw_task_plots
from fedsplit.protocol.column_sets import check_table_columns
from fedsplit.protocol.config import RunConfig
from fedsplit.protocol.errors import ConfigError, HospitalFailure
from fedsplit.protocol.privacy import DPSpec
from fedsplit.protocol.record.common import HISTORY_FILE, SUMMARY_FILE
from fedsplit.protocol.record.horizontal import RunRecord, SiteEntry
from fedsplit.protocol.record.summary import (
    AttackSummary,
    Baseline,
    FederatedScores,
    RecipeSummary,
    RunSummary,
    SchemaSummary,
    Scores,
    ServerOptSettings,
    SummaryRound,
)
from fedsplit.protocol.roster import write_roster
from fedsplit.protocol.schema import Schema, column_report, merge_reports
from fedsplit.protocol.stats import combine_moments, moments
from fedsplit.protocol.tasks import AUTO, BASELINES, CENTRALIZED, LOCAL, task_kind
from fedsplit.protocol.update import arrays_to_state_dict
from fedsplit.protocol.weights import read_schema
from fedsplit.server.compose import check_composition
from fedsplit.server.history import find_resume_point

#: Up to this many hospitals, each hospital-alone model is also scored on every other
#: hospital's test patients (the Models table's row per hospital alone: its mean over every
#: hospital and the pooled test). Above, each is scored on its own test patients only, so the
#: closing scores N models on N test sets, not N x N (1,000 hospitals: a million scorings, the
#: quadratic closing of issue 43), and the Models table shows one row, "each hospital alone":
#: the mean of the hospitals' own scores (no pooled score: no one model scores every row).
CROSS_SCORED_SITES = 20


def parse_baselines(text: str) -> tuple[str, ...] | None:
    """``--baselines``: ``auto`` (None: the task kind's, `protocol.tasks`), ``none`` (an empty
    tuple) or a comma list of `protocol.tasks.BASELINES`; anything else is a `ConfigError`."""
    names = [n.strip() for n in text.split(",") if n.strip()]
    if names == [AUTO]:
        return None
    if names == ["none"]:
        return ()
    if not names or any(n not in BASELINES for n in names):
        raise ConfigError(f"--baselines is auto (the task kind's), none, or a comma list of "
                          f"{', '.join(BASELINES)}, e.g. --baselines centralized. Received: "
                          f"{text!r}")
    return tuple(dict.fromkeys(names))


@dataclass
class SiteTable:
    """One simulated hospital: its training rows and its own held-out test patients.

    ``train``/``test`` are raw tables (DataFrames, cells as read) or, for images, `Dataset`s.
    """

    name: str
    train: Any
    test: Any

    def __len__(self) -> int:
        return len(self.train)

    @property
    def is_table(self) -> bool:
        """Whether the hospital holds a table (else images)."""
        return not isinstance(self.train, Dataset)


@dataclass
class Experiment:
    """What to simulate; `RunConfig` holds the federation's own knobs.

    Constructing one checks the fields against each other and against the run config
    (`__post_init__`), so a bad combination fails before any data is read or process started.
    """

    cfg: RunConfig
    out: Path
    dataset: str | None = None
    site_files: Sequence[Path | str | SiteSource] = ()
    #: hospitals to split ``dataset`` across; None: 3, or heart-disease's own four hospitals
    num_sites: int | None = None
    partition: str = "iid"
    test_fraction: float = 0.2
    leave_out: Sequence[int] = ()
    #: > 0: every hospital fine-tunes the final global model for this many mini-batches on its
    #: own training rows (`orchestration.personalize`); ``"alone"``: for its hospital-alone
    #: step budget (`baseline_steps`); ``"prior"``: a tested refit of the final bias; 0: off
    personalize: int | str = 0
    #: what personalization fine-tunes: ``all`` weights or the final layer's ``bias``; ``auto``:
    #: ``all`` for a step budget, ``bias`` for ``prior``
    personalize_scope: str = "auto"
    #: the baselines trained beside the federation (`protocol.tasks.BASELINES`); None: the task
    #: kind's, () none (`parse_baselines`)
    baselines: Sequence[str] | None = None
    #: an existing Ray cluster (its head's ``HOST:PORT``) that runs the simulated hospitals
    #: (`orchestration.flower_runtime.simulation`); None: Ray on this machine
    ray_address: str | None = None

    def __post_init__(self) -> None:
        """Cross-field checks (each a `ConfigError` that says how to fix it); fills ``num_sites``."""
        if self.dataset == tcga.DATASET:
            if self.num_sites not in (None, len(tcga.REGIONS)) or self.partition != "iid":
                raise ConfigError(
                    f"--dataset {tcga.DATASET} is split by FLamby's {len(tcga.REGIONS)} regions "
                    f"with FLamby's train/test split; drop --sites and --partition. Received: "
                    f"sites={self.num_sites}, partition={self.partition!r}")
            self.num_sites = len(tcga.REGIONS)
        elif self.dataset == HEART:
            if (self.num_sites not in (None, len(HEART_HOSPITALS))
                    or self.partition != "iid"):
                raise ConfigError(
                    f"--dataset {HEART} is split by its {len(HEART_HOSPITALS)} real hospitals; "
                    f"drop --sites and --partition. Received: sites={self.num_sites}, "
                    f"partition={self.partition!r}")
            self.num_sites = len(HEART_HOSPITALS)
        elif self.num_sites is None:
            self.num_sites = len(self.site_files) if self.site_files else 3
        if bool(self.dataset) == bool(self.site_files):
            raise ConfigError(
                "Give either --dataset NAME (split bundled data across --sites) or one --site FILE "
                f"per hospital, not both or neither. Received: dataset={self.dataset!r}, "
                f"{len(self.site_files)} --site")
        cfg = self.cfg
        # a bad strategy name or value, or a rule the privacy wrappers cannot wrap, fails here
        check_composition(cfg)
        from fedsplit.client.parallel import ParallelConfig

        ParallelConfig.parse(cfg.parallel)
        joined = (len(self.site_files) if self.site_files else self.num_sites) - len(
            set(self.leave_out))
        check_attack(cfg.attack, cfg.attackers, joined)
        resolve_scope(parse_budget(self.personalize) or 1, self.personalize_scope)
        if self.baselines is not None:
            check_baselines(self.baselines, cfg.task)
        if self.ray_address:  # a cluster that does not answer: refused before any data is read
            check_ray_address(self.ray_address)
        if cfg.recipe or task_recipe(cfg):  # a recipe that cannot be imported or refuses
            # its params fails here
            recipe = effective_recipe(NodeConfig(), cfg, "mlp")
            dp = DPSpec.parse(cfg.dp) if cfg.dp else None
            if dp is not None and dp.level == "patient" and not recipe.per_sample_loss:
                raise ConfigError(  # the hospitals refuse it too; say so before Flower starts
                    f"Patient-level DP (DP-SGD) clips each patient's gradient, so the loss must be "
                    f"a sum over patients; recipe {recipe.name}'s loss is not (per_sample_loss = "
                    f"False: e.g. a Cox partial likelihood couples the patients of a risk set). "
                    f"Use --dp ...,level=hospital, or train without --dp. Received: --dp {cfg.dp}")


def check_baselines(chosen: Sequence[str], task: str) -> tuple[str, ...]:
    """``chosen``, each one a baseline of `protocol.tasks.BASELINES` the task kind ``task``
    declares (``auto``: not known before the data decides; checked again after the run)."""
    declared = BASELINES if task == AUTO else task_kind(task).baselines
    if any(b not in declared for b in chosen):
        raise ConfigError(f"Task kind {task} trains the baselines {', '.join(declared) or 'none'}"
                          f"; choose among them or --baselines none. Received: {list(chosen)}")
    return tuple(chosen)


def _concat(parts: Sequence[Dataset]) -> Dataset:
    ref = parts[0]
    return Dataset(np.concatenate([p.x for p in parts]), np.concatenate([p.y for p in parts]),
                   ref.task, ref.kind, ref.feature_names, ref.schema)


def _frame(data: Dataset, target: str) -> Any:
    """A bundled numeric dataset as a raw table (features + target)."""
    import pandas as pd

    frame = pd.DataFrame(data.x, columns=data.feature_names)
    frame[target] = data.y
    return frame


def _read_site(source: SiteSource, cfg: RunConfig) -> tuple[Any, Any]:
    """A ``--site`` hospital's rows (and its test file's), read as its agent reads them: the
    recipe's own reader first (image folders, signal files), else a table or NPZ. Any failure
    is named with the hospital (`HospitalFailure`, stage "reading its data")."""
    recipe = site_recipe(NodeConfig(), cfg)  # a recipe's own reader (image folders, arrays) comes first
    with hospital_stage(source.name, "reading its data"):
        if (train := read_with_recipe(recipe, source.train)) is not None:
            return train, (load_site_file(source.test, target="y", recipe=recipe)
                           if source.test else None)
        suffix = source.train.suffix.lower()
        if suffix == ".npz" or suffix not in (".csv", ".parquet", ".pq"):
            return load_site_file(source.train, target="y"), (
                load_site_file(source.test, target="y") if source.test else None)
        return read_table(source.train), read_table(source.test) if source.test else None


def _cut(rows: Any, fraction: float, seed: int) -> tuple[Any, Any]:
    keep, test = split_indices(len(rows), fraction, seed)
    if isinstance(rows, Dataset):
        return rows.subset(keep), rows.subset(test)
    return rows.iloc[keep].reset_index(drop=True), rows.iloc[test].reset_index(drop=True)


def prepare_tables(exp: Experiment) -> list[SiteTable]:
    """Every hospital's training rows and own test patients, reproducibly from the seed."""
    cfg = exp.cfg
    if exp.dataset == HEART:
        if cfg.target not in ("target", HEART_TARGET) or cfg.id_column not in ("", HEART_ID):
            raise ConfigError(f"--dataset {HEART} has target {HEART_TARGET!r} and ID column "
                              f"{HEART_ID!r}; leave --target and --id-column unset. Received: "
                              f"target={cfg.target!r}, id-column={cfg.id_column!r}")
        hospitals = load_heart_disease()
        return [SiteTable(name, *_cut(rows, exp.test_fraction, cfg.seed + i))
                for i, (name, rows) in enumerate(hospitals.items())]
    if exp.dataset == tcga.DATASET:  # FLamby's regions and split: its test patients are FLamby's
        given = {"target": cfg.target, "event": cfg.event, "id_column": cfg.id_column,
                 "task": cfg.task}
        if {k: v for k, v in table_keys(tcga.DATASET, **given).items() if k in given} != given:
            raise ConfigError(f"--dataset {tcga.DATASET} needs the run config's target {tcga.TIME!r}, "
                              f"event {tcga.EVENT!r}, id-column {tcga.ID!r} and task survival "
                              f"(`table_keys`). Received: target={cfg.target!r}, "
                              f"event={cfg.event!r}, id-column={cfg.id_column!r}, task={cfg.task!r}")
        return [SiteTable(name, train, test)
                for name, (train, test) in tcga.load_tcga_brca().items()]
    if exp.dataset:
        data = load_bundled(exp.dataset)
        parts = partition(data.y, exp.num_sites, exp.partition, cfg.seed)
        tables = []
        for i, part in enumerate(parts):
            name = f"site-{i}"
            rows = data.subset(part)
            train, test = _cut(rows, exp.test_fraction, cfg.seed + i)
            if data.kind != "cnn":
                train, test = _frame(train, cfg.target), _frame(test, cfg.target)
            tables.append(SiteTable(name, train, test))
        return _checked(tables)
    if not exp.site_files:
        raise ConfigError("Give --dataset NAME or at least one --site FILE. Received: neither")
    # every hospital's file present and readable, all named in one line, before any is read
    sources = check_site_files(exp.site_files)
    names = [s.name for s in sources]
    if len(set(names)) != len(names):
        raise ConfigError(f"Every hospital needs its own name; name them with --site NAME=PATH. "
                          f"Received: {names}")
    tables = []
    for i, source in enumerate(sources):
        train, test = _read_site(source, cfg)
        if test is None:
            train, test = _cut(train, exp.test_fraction, cfg.seed + i)
        tables.append(SiteTable(source.name, train, test))
    return _checked(tables)


def _checked(tables: list[SiteTable]) -> list[SiteTable]:
    small = [f"{t.name} ({len(t.train)})" for t in tables if len(t.train) < 2]
    if small:
        raise ConfigError(
            f"Each hospital needs at least 2 training rows after its test patients are cut (one "
            f"to train, one for its own evaluation); use fewer sites, other sizes or a smaller "
            f"--test-fraction. Received: {', '.join(small)}"
        )
    kinds = {t.is_table for t in tables}
    if len(kinds) > 1:
        raise ConfigError("Mix of table and image (NPZ) site files: one federation trains one "
                          f"model on one kind of data. Received: {[t.name for t in tables]}")
    return tables


def check_schema(tables: Sequence[SiteTable], cfg: RunConfig) -> tuple[Schema, list[str]] | None:
    """The schema the hospitals will agree on (the same merge the coordinator runs), or None
    for images; a conflict raises `ConfigError` here, before any Flower process starts."""
    if not tables or not tables[0].is_table:
        return None
    task = cfg.task
    # hospitals whose columns differ: the odd one(s) against the majority, both sides named
    check_table_columns({t.name: list(t.train.columns) for t in tables}, cfg.table_settings)
    if cfg.event:  # every hospital's time and event columns (its whole file: training and
        # test rows), all problems in one refusal
        import pandas as pd
        from fedsplit.protocol.survival import check_hospitals

        check_hospitals({t.name: pd.concat([t.train, t.test], ignore_index=True)
                         for t in tables}, cfg.target, cfg.event, cfg.table_settings.na_values)
    reports = []
    for t in tables:
        keep, _ = split_indices(len(t.train), cfg.val_fraction, cfg.seed)
        reports.append(column_report(t.name, t.train.iloc[keep], cfg.table_settings))
    merged = merge_reports(reports, cfg.table_settings, task=task)
    return merged.schema, merged.warnings


def encode_sites(tables: Sequence[SiteTable], schema: Schema | None) -> list[tuple[Dataset, Dataset]]:
    """(train, test) `Dataset`s of every hospital, encoded with the federation's schema."""
    if schema is None:
        return [(t.train, t.test) for t in tables]
    return [(encode_table(schema, t.train, source=f"{t.name} (training rows)"),
             encode_table(schema, t.test, source=f"{t.name} (test rows)")) for t in tables]


def prepare_sites(exp: Experiment) -> tuple[list[Dataset], Dataset]:
    """Return (per-site training rows, pooled test rows) as `Dataset`s, encoded with the schema
    the hospitals would agree on (for tools that need encoded data: benches, tests)."""
    tables = prepare_tables(exp)
    checked = check_schema(tables, exp.cfg)
    pairs = encode_sites(tables, checked[0] if checked else None)
    return [train for train, _ in pairs], _concat([test for _, test in pairs])


def write_site(site: Dataset | Any, folder: Path, target: str) -> Path:
    """Write one simulated hospital's rows where only its agent reads them (a raw table as it
    came, a numeric `Dataset` as CSV, images as NPZ)."""
    import pandas as pd

    folder.mkdir(parents=True, exist_ok=True)
    for stale in folder.glob("data.*"):  # a previous run's file of the other kind: one file per site
        stale.unlink()
    # a simulated hospital is made anew by every run: its ledger and egress log too
    shutil.rmtree(folder / STATE_FOLDER, ignore_errors=True)
    if isinstance(site, Dataset) and (site.kind != "mlp" or np.ndim(site.y) > 1):  # images, arrays,
        # and targets of several columns (survival: time and event): exactly the arrays the
        # coordinator's scoring and baselines use (`client.data.write_staged`)
        return write_staged(site, folder / "data.npz")
    if isinstance(site, Dataset):
        frame = pd.DataFrame(site.x, columns=site.feature_names)
        frame[target] = site.y
    else:
        frame = site
    path = folder / "data.csv"
    frame.to_csv(path, index=False)
    return path


def _fresh_model(train: Dataset, num_outputs: int, cfg: RunConfig) -> SiteModel:
    """The federation's model (its recipe: `client.site.effective_recipe`), freshly built with
    ``train``'s standardisation statistics."""
    recipe = effective_recipe(NodeConfig(), cfg, train.kind)
    spec = recipe.model_spec(ModelInputs(train.task, tuple(train.x.shape[1:]), num_outputs))
    model = build_model(spec, seed=cfg.seed, recipe=recipe)
    flat = train.x.reshape(len(train.x), -1)
    mean, std = combine_moments([moments(flat.reshape(-1, 1) if train.kind != "mlp" else flat)])
    y = train.y.astype(np.float64)
    set_statistics(model, mean, std, float(y.mean()), float(y.std()))
    return model


def steps_per_round(rows: int, cfg: RunConfig, recipe: object | None = None) -> int:
    """Optimizer steps a hospital with ``rows`` training rows takes per round (as the agent),
    of `client.train.step_batch_size` rows each (``recipe``: the federation's; None: a loss
    that is a sum over rows, ``batch-size`` rows)."""
    batch = cfg.batch_size if recipe is None else step_batch_size(recipe, rows, cfg.batch_size)
    return local_steps_per_round(rows, local_steps=cfg.local_steps, local_epochs=cfg.local_epochs,
                                 batch_size=batch)


def baseline_steps(site_rows: Sequence[int], cfg: RunConfig, recipe: object | None = None
                   ) -> tuple[int, list[int]]:
    """The step budgets: (centralized, [each hospital alone]).

    A hospital alone trains ``rounds x`` its own steps per round; the centralized model
    ``rounds x`` the sum over hospitals, i.e. as many optimizer steps as the whole federation
    took, each of `client.train.step_batch_size` rows on its own rows (`fit_steps`): for a loss
    that couples rows (``recipe``'s ``per_sample_loss`` False) every step of the federation,
    of a hospital alone and of the centralized model is a full-batch step on its rows (up to
    ``risk_set_rows``), so none of them trains on risk sets cut to a mini-batch.
    """
    per_site = [cfg.num_server_rounds * steps_per_round(n, cfg, recipe) for n in site_rows]
    return sum(per_site), per_site


def train_baseline(train: Dataset, val: Dataset | Sequence[Dataset], num_outputs: int,
                   cfg: RunConfig, steps: int) -> tuple[SiteModel, BestRound]:
    """Train the federation's model on ``train`` alone for ``steps`` optimizer steps.

    The steps run in ``rounds`` chunks (like the federation's rounds); the model kept is the
    chunk that scores best on ``val`` by the task metric (accuracy or r2, ties to the later
    chunk: `orchestration.selection`), ``val`` being the same held-out rows the hospitals
    evaluate on, never test rows: one hospital's, or each hospital's (a sequence, for the
    centralized model), scored as the federation scores them (`validation_score`). So a
    baseline loses neither by under- nor by over-training.
    Returns the kept model and the selection (``round`` kept, ``scores`` per round).
    """
    import copy

    vals = [val] if isinstance(val, Dataset) else list(val)
    model = _fresh_model(train, num_outputs, cfg)
    key = recipe_of(model).selection_metric(model.spec.task)
    rounds = cfg.num_server_rounds
    picker, best = BestRound(), copy.deepcopy(model.state_dict())
    for r in range(rounds):
        chunk = steps // rounds + (1 if r < steps % rounds else 0)
        if chunk:
            fit_steps(model, train.x, train.y, steps=chunk, lr=cfg.lr, batch_size=cfg.batch_size,
                      seed=cfg.seed * 100_003 + r + 1)
        if picker.offer(validation_score(model, vals, key)):
            best = copy.deepcopy(model.state_dict())
    model.load_state_dict(best)
    return model, picker


def validation_score(model: SiteModel, vals: Sequence[Dataset], key: str) -> float:
    """A baseline's score on the validation rows ``vals`` (one per hospital), by the rule the
    federation's round selection applies to the hospitals' evaluations
    (`server.selection.metrics_score`): a survival ``c_index`` is Harrell's C over the hospitals'
    **summed** concordant and comparable pairs (each hospital's pairs among its own patients,
    from its `protocol.survival.pair_rates`; never a pair of patients of two hospitals), else
    the count-weighted mean of their C-indices; any other metric is scored on the pooled rows
    (accuracy: the same as the federation's count-weighted mean)."""
    from fedsplit.server.selection import metrics_score

    vals = [v for v in vals if len(v)]
    if not vals:
        raise ConfigError("A baseline needs validation rows to pick its round; every hospital's "
                          "were empty. Raise val-fraction. Received: 0 validation rows")
    if key == "c_index":
        scored = [(len(v), score(model, v.x, v.y)) for v in vals]
        total = sum(n for n, _ in scored)
        names = set.intersection(*(set(m) for _, m in scored))
        mean = {k: sum(n * m[k] for n, m in scored) / total for k in names}
        value = metrics_score(mean, key)
        if value is not None:
            return value
    rows = vals[0] if len(vals) == 1 else _concat(vals)
    return score(model, rows.x, rows.y)[key]


def kept_round(history: RunRecord, fed_dir: Path, federated: FederatedScores) -> FederatedScores:
    """``federated`` with the federated model's selection, as the baselines report theirs
    (`server.selection`): ``keep``, ``rounds_kept``, ``val_metric`` (per candidate round,
    ``val_rounds``), ``val_examples`` (the kept round's validation rows) and ``last_model``."""
    chosen = history.selection
    if chosen is not None:
        kept = next((s for s in chosen.val_metric if s.round == chosen.rounds_kept), None)
        federated.keep = chosen.keep
        federated.rounds_kept = chosen.rounds_kept
        federated.val_metric = [s.score for s in chosen.val_metric]
        federated.val_rounds = [s.round for s in chosen.val_metric]
        federated.val_examples = kept.examples if kept is not None else None
    federated.last_model = str(fed_dir / "last.h5")
    return federated


def evaluate(model: SiteModel, tests: Sequence[tuple[str, Dataset]],
             local: Mapping[str, Mapping[str, np.ndarray]] | None = None) -> Scores:
    """``metrics`` on the pooled test rows, ``per_site`` on each hospital's, ``mean_per_site``.

    ``local``: each hospital's own tensors that never travel (FedBN's BatchNorm layers, a local
    head: `client.data.read_local_state`); a hospital that has any is scored with the global
    model plus its own tensors, as it uses the model, and the pooled metrics are then each
    hospital's weighted by its test rows (no single model predicts every row)."""
    own = {name: _with_local(model, local.get(name, {})) for name, _ in tests} if local else {}
    per_site = {name: score(own.get(name) or model, t.x, t.y) for name, t in tests}
    keys = sorted({k for m in per_site.values() for k in m})
    mean = {k: float(np.mean([m[k] for m in per_site.values()])) for k in keys}
    if any(own.values()):
        rows = {name: len(t) for name, t in tests}
        pooled = {k: float(sum(per_site[n][k] * rows[n] for n in rows) / sum(rows.values()))
                  for k in keys}
        return Scores(metrics=pooled, per_site=per_site, mean_per_site=mean,
                      site_models=sorted(n for n, m in own.items() if m is not None))
    rows_all = _concat([t for _, t in tests])
    return Scores(metrics=score(model, rows_all.x, rows_all.y), per_site=per_site,
                  mean_per_site=mean)


def _with_local(model: SiteModel, tensors: Mapping[str, np.ndarray]) -> SiteModel | None:
    """A copy of ``model`` with a hospital's own floating-point tensors put back (counters do
    not change a score), or None when it has none."""
    import copy

    state = model.state_dict()
    own = {k: v for k, v in tensors.items() if k in state and state[k].is_floating_point()
           and tuple(state[k].shape) == tuple(np.shape(v))}
    if not own:
        return None
    mine = copy.deepcopy(model)
    mine.load_state_dict({**state, **arrays_to_state_dict(own, like=state)})
    return mine


def check_attack(attack: str, attackers: int, num_sites: int) -> list[int]:
    """Validate --attack/--attackers together; return the hostile site indices."""
    from fedsplit.client.attacks import hostile_sites, parse_attack

    parsed = parse_attack(attack)
    hostile = hostile_sites(num_sites, attackers)
    if (parsed is None) != (not hostile):
        raise ConfigError(
            "--attack and --attackers go together: name the attack and how many sites play it "
            f"(e.g. --attack signflip --attackers 1). Received: --attack {attack} --attackers {attackers}"
        )
    return hostile


def stage_sites(exp: Experiment, on_phase: Callable[[str], None] | None = None,
                ) -> tuple[RunConfig, list[SiteTable], list[SiteTable]]:
    """Write each joining hospital's training rows under OUT/sites/site-i; return the run config
    (with the hospitals' names and their data's fingerprint), the hospitals that join and all
    hospitals (left-out ones keep their test patients, scored like the others').

    The schema merge the hospitals will run is checked first (a conflict raises `ConfigError`).
    With ``resume`` on, an unfinished run in OUT/federation whose configuration or site data
    differ is refused here (`ResumeMismatchError`), before any Flower process starts.
    ``on_phase`` gets the name of each step before Flower as it starts (`PHASES`).
    """
    phase = on_phase or (lambda _name: None)
    phase(PHASES[0])
    out = exp.out.resolve()
    cfg = exp.cfg
    if exp.dataset == HEART:
        cfg = cfg.model_copy(update={"target": HEART_TARGET, "id_column": HEART_ID})
        exp = Experiment(**{**exp.__dict__, "cfg": cfg})
    tables = prepare_tables(exp)
    bad = [k for k in exp.leave_out if not 0 <= k < len(tables)]
    if bad or len(set(exp.leave_out)) >= len(tables):
        raise ConfigError(
            f"--leave-out names sites 0..{len(tables) - 1} to partition but not run, and at least "
            f"one site must remain. Received: {list(exp.leave_out)}"
        )
    # Left-out sites keep their share of the partition (the others' rows are unchanged) but
    # do not join: the federation as it would have been without them.
    joined = [t for k, t in enumerate(tables) if k not in set(exp.leave_out)]
    if cfg.norm != "none" and not joined[0].is_table:
        raise ConfigError(f"--norm {cfg.norm} adds BatchNorm after the MLP's hidden layers; this "
                          f"data trains the cnn, which has none. Use --norm none. "
                          f"Received: norm={cfg.norm!r}, model cnn")
    phase(PHASES[1])
    check_schema(joined, cfg)
    phase(PHASES[2])
    files = {t.name: write_site(t.train, out / "sites" / f"site-{i}", cfg.target)
             for i, t in enumerate(joined)}
    # the names and fingerprints in a roster file, not the run config every message carries
    roster = write_roster(out / "sites", [t.name for t in joined], data_fingerprint(files))
    cfg = cfg.model_copy(update={
        "data_dir": str(out / "sites"), "out_dir": str(out / "federation"),
        "site_names": "[]", "data_fingerprint": "{}", "site_roster": str(roster),
        # every simulated hospital is connected before round 1; a round then needs one usable
        # update (the strategy enforces its own minimum, e.g. Krum's 2f+3), so an excluded
        # hostile site does not void the round
        "min_nodes": len(joined), "quorum": exp.cfg.quorum or 1,
    })
    resuming = (cfg.resume
                and find_resume_point(Path(cfg.out_dir), cfg.with_roster().to_flower()) is not None)
    if not resuming:  # the hospitals' own tensors of an earlier run in this folder are not theirs
        for i in range(len(joined)):
            shutil.rmtree(out / "sites" / f"site-{i}" / "local", ignore_errors=True)
    return cfg, joined, tables


#: What `fedsplit simulate` does before Flower starts, step by step (its progress bar's status):
#: reading every hospital's file, the schema merge the hospitals will run (a conflict stops
#: here), writing each hospital's rows where its agent reads them; then Flower starts.
PHASES = ("reading the hospitals' files", "schema agreement (before Flower)",
          "writing each hospital's rows", "starting Flower")


def run_experiment(
    exp: Experiment,
    *,
    on_progress: Callable[[RunRecord], None] | None = None,
    on_stage: Callable[[str], None] | None = None,
    on_phase: Callable[[str], None] | None = None,
) -> RunSummary:
    """Run the federation and the baselines; write summary.json (`RunSummary`), per_site.csv
    (`orchestration.tables.write_site_table`) and rounds.png into ``exp.out``; return the
    summary.

    ``on_progress`` gets the coordinator's run record each time it is rewritten; ``on_stage``
    a line for each stage; ``on_phase`` the name of each step before Flower (`PHASES`), then
    of each step of the closing analyses as it starts (encoding, scoring round R, each
    baseline: ``hospital-alone baselines: K of N``, writing the files)."""
    stage = on_stage or (lambda _msg: None)
    phase = on_phase or (lambda _name: None)
    budget = parse_budget(exp.personalize)  # a bad value stops before Flower starts
    scope = resolve_scope(budget or 1, exp.personalize_scope)
    out = exp.out.resolve()
    out.mkdir(parents=True, exist_ok=True)
    cfg, joined, everyone = stage_sites(exp, on_phase)
    if on_phase is not None:
        on_phase(PHASES[3])
    stage(f"federation: {len(joined)} hospitals ({_names([t.name for t in joined])}), "
          f"{recipe_line(cfg, 'mlp' if joined[0].is_table else joined[0].train.kind)}, "
          f"{cfg.strategy}{'' if cfg.server_opt == 'none' else ' + ' + cfg.server_opt}, "
          f"{cfg.num_server_rounds} rounds")
    fed_dir = out / "federation"
    progress = None if on_progress is None else (
        lambda raw: on_progress(RunRecord.from_json(raw, source=str(fed_dir / HISTORY_FILE))))
    history = RunRecord.from_json(simulation(cfg, len(joined), out / "flower", on_progress=progress,
                                             ray_address=exp.ray_address),
                                  source=str(fed_dir / HISTORY_FILE))
    schema_text = read_schema(fed_dir / "global.h5")
    schema = Schema.from_json(schema_text) if schema_text else None
    phase(f"encoding {len(everyone)} hospitals' rows with the federation's schema")
    data = dict(zip([t.name for t in everyone], encode_sites(everyone, schema), strict=True))
    tests = [(name, test) for name, (_, test) in data.items()]

    stage("scoring the federated model per round on every hospital's test patients")
    rounds = []
    for entry in history.model_rounds:
        phase(f"scoring round {entry.round}'s model on {len(tests)} hospitals")
        scored = evaluate(load_model(fed_dir / str(entry.model)), tests,
                          local_states(out, joined, entry.round))
        rounds.append(SummaryRound(round=entry.round, **scored.fields(), site_evaluation=dict(
            entry.evaluate.metrics) if entry.evaluate else {}))
    if not rounds:
        raise ConfigError("The federation produced no global model (every round failed); see "
                          f"{fed_dir / 'history.json'}. Received: 0 models")
    final = load_model(fed_dir / "global.h5")
    num_outputs = final.spec.num_outputs
    # the task kind's figures after the last round (survival: the coordinator's summary, the
    # pooled Kaplan-Meier curve and the kept model's Breslow baseline, from the hospitals' sums)
    drawn = draw_task_plots(cfg.task, fed_dir)

    declared = task_kind(final.spec.task).baselines  # the task kind's (`protocol.tasks`)
    wanted = declared if exp.baselines is None else check_baselines(exp.baselines,
                                                                     final.spec.task)
    stage("baselines: none (--baselines none)" if not wanted else "baselines: " + " and ".join(
        ["centralized (scored on every hospital's test patients)"] * (CENTRALIZED in wanted)
        + [f"each hospital alone (scored on "
           f"{'every' if len(tests) <= CROSS_SCORED_SITES else 'its own'} hospital's test "
           f"patients)"] * (LOCAL in wanted)) + "; same model, same optimizer steps")
    # the rows each agent trains on: its file minus its own held-out evaluation rows
    splits = {t.name: split_site(data[t.name][0], cfg.val_fraction, cfg.seed) for t in joined}
    trains = {name: train for name, (train, _) in splits.items()}
    recipe = recipe_of(final)  # its loss decides the rows of a step (`step_batch_size`)
    exact = fitted_exactly(history) and schema is not None  # the exact Cox fit's baselines
    centralized, local_only, failures = train_baselines(
        wanted, splits, tests, cfg, num_outputs, recipe,
        exact_schema=schema.to_json() if exact and schema is not None else None, on_phase=phase)
    # rows behind the kept model: excluded (e.g. hostile) sites do not count
    kept = history.round(history.selection.rounds_kept or 0) if history.selection else None
    fed_examples = (kept.aggregation.num_examples if kept is not None and kept.aggregation
                    else history.final_examples)
    personalized = None
    if budget:
        own = {name: split_site(data[name][0], cfg.val_fraction, cfg.seed)[0] for name, _ in tests}
        # ALONE: each hospital's own alone budget (for a left-out hospital, the one it would get)
        steps = dict(zip(own, baseline_steps([len(t) for t in own.values()], cfg, recipe)[1],
                         strict=True)) if budget == ALONE else budget
        stage("personalization: each hospital tests and refits the global model's final bias "
              "on its own training rows" if budget == PRIOR else
              f"personalization: each hospital fine-tunes the global model for "
              f"{'its hospital-alone step budget' if budget == ALONE else budget} mini-batches "
              f"on its own training rows")
        personalized = personalize(final, own, tests, cfg, steps, scope)
        personalized.steps, personalized.num_examples = budget, fed_examples  # set: written
    names = [t.name for t in joined]
    hostile = names[len(names) - cfg.attackers:] if cfg.attackers else []
    summary = RunSummary(
        task=final.spec.task,
        recipe=RecipeSummary(**final.spec.identity.model_dump()),
        metric_names=list(recipe_of(final).metric_names(final.spec.task)),
        selection_metric=recipe_of(final).selection_metric(final.spec.task),
        attack=AttackSummary(kind=cfg.attack, hostile_sites=hostile) if hostile else None,
        dataset=exp.dataset or [str(parse_site(s).train) for s in exp.site_files],
        strategy=cfg.strategy,
        strategy_params=cfg.params,
        server_opt=None if cfg.server_opt == "none" else ServerOptSettings(
            name=cfg.server_opt, lr=cfg.server_lr, beta1=cfg.server_beta1,
            beta2=cfg.server_beta2, tau=cfg.server_tau, momentum=cfg.server_momentum),
        sites=len(joined),
        site_names=names,
        partition=exp.partition if exp.dataset and exp.dataset != HEART else "files"
        if not exp.dataset else "hospitals",
        left_out=list(exp.leave_out),
        model_id=final.spec.to_id(),
        table_schema=None if schema is None else SchemaSummary(
            digest=schema.digest(), columns=len(schema.columns),
            features=len(schema.feature_names), labels=list(schema.labels),
            warnings=list(history.schema_warnings)),
        test_examples=sum(len(t) for _, t in tests),
        test_examples_per_site={name: len(t) for name, t in tests},
        steps_per_round={name: steps_per_round(len(t), cfg, recipe)
                         for name, t in trains.items()},
        step_rows={name: step_batch_size(recipe, len(t), cfg.batch_size)
                   for name, t in trains.items()},
        config=cfg.with_roster().to_flower(),
        centralized=centralized,
        local_only=local_only,
        federated=kept_round(history, fed_dir, FederatedScores(
            **evaluate(final, tests, local_states(
                out, joined, history.selection.rounds_kept if history.selection else None)
                       ).fields(),
            num_examples=fed_examples, model=str(fed_dir / "global.h5"))),
        personalized=personalized,
        rounds=rounds,
        failures=_left_out(history, [t.name for t in joined]) + failures,
        **drawn,
    )
    summary.save(out / SUMMARY_FILE)
    phase(f"writing {SITE_TABLE_FILE} and rounds.png")
    write_site_table(summary, out / SITE_TABLE_FILE)
    plot_rounds(summary, out / "rounds.png")
    if summary.failures:  # written and plotted; the command still says what failed, and fails
        first, *more = summary.failures
        raise HospitalFailure.from_line(
            first + (f" (and {len(more)} more failure(s))" if more else "")
            + f". The federated model and summary were written to {out}; see its 'failures'")
    return summary


def train_baselines(
    wanted: Sequence[str],
    splits: Mapping[str, tuple[Dataset, Dataset]],
    tests: Sequence[tuple[str, Dataset]],
    cfg: RunConfig,
    num_outputs: int,
    recipe: object | None = None,
    *,
    exact_schema: str | None = None,
    on_phase: Callable[[str], None] | None = None,
) -> tuple[Baseline | None, list[Baseline], list[str]]:
    """The baselines ``wanted`` (`protocol.tasks.BASELINES`): the centralized model (or None)
    and each hospital alone, trained on ``splits`` (each joined hospital's (training,
    validation) rows) to the step budgets of `baseline_steps`, and one line per party whose own
    code failed (`HospitalFailure`; that baseline is then missing).

    Scoring is O(hospitals): the centralized model on every hospital's test patients
    (``tests``), a hospital alone on its own, and also on the others' up to
    `CROSS_SCORED_SITES` hospitals. ``exact_schema``: the schema (JSON) of an exact Cox fit,
    whose baselines are fitted exactly too (`orchestration.survival_baselines`). ``on_phase``
    gets a line as each baseline starts."""
    phase = on_phase or (lambda _name: None)
    own_tests = dict(tests)
    cross = len(tests) <= CROSS_SCORED_SITES
    trains = {name: train for name, (train, _) in splits.items()}
    vals = {name: val for name, (_, val) in splits.items()}
    central_steps, site_steps = baseline_steps([len(t) for t in trains.values()], cfg, recipe)
    failures: list[str] = []

    def baseline(who: str, train: Dataset, own_vals: Sequence[Dataset], steps: int,
                 site: str | None = None,
                 fitted: Callable[[], tuple[SiteModel, BestRound]] | None = None
                 ) -> Baseline | None:
        """A baseline's record, or None (its failure named in ``failures``): the recipe's
        own code runs here too, and may raise on the pooled rows or one hospital's.
        ``own_vals``: the validation rows of each hospital whose rows it trains on;
        ``fitted``: the model already trained elsewhere (`_train_beside`)."""
        val = own_vals[0] if len(own_vals) == 1 else _concat(list(own_vals))

        def trained() -> tuple[SiteModel, BestRound]:
            if fitted is not None:
                return fitted()
            return train_baseline(train, own_vals, num_outputs, cfg, steps)

        try:
            with hospital_stage(who, "training"):
                model, chosen = (exact_baseline(_fresh_model(train, num_outputs, cfg), train, val,
                                                exact_schema, trained)
                                 if exact_schema is not None else trained())
                scored = evaluate(model, tests if site is None or cross
                                  else [(site, own_tests[site])])
        except HospitalFailure as e:
            failures.append(str(e))
            return None
        done = Baseline(num_examples=len(train), steps=steps, rounds_kept=chosen.round,
                        val_metric=chosen.scores, val_examples=len(val), **scored.fields())
        if site is not None:  # the centralized baseline has no site key
            done.site = site
        return done

    centralized, beside = None, None
    central = "the centralized baseline"
    if CENTRALIZED in wanted:
        pooled, pooled_vals = _concat(list(trains.values())), list(vals.values())
        if beside_locals(wanted, len(trains), exact_schema):
            phase(f"centralized baseline: {central_steps} steps on {len(trains)} hospitals' rows, "
                  f"on another core beside the hospital-alone baselines")
            pool = ProcessPoolExecutor(1, mp_context=multiprocessing.get_context("spawn"))
            beside = pool.submit(_train_beside, central, pooled, pooled_vals, num_outputs, cfg,
                                 central_steps)
            pool.shutdown(wait=False)  # the worker ends with its one task
        else:
            phase(f"centralized baseline: {central_steps} steps on {len(trains)} hospitals' rows")
            centralized = baseline(central, pooled, pooled_vals, central_steps)
    local_only = []
    for k, ((name, train), steps) in enumerate(zip(trains.items(), site_steps, strict=True)):
        if LOCAL not in wanted:
            break
        phase(f"hospital-alone baselines: {k + 1} of {len(trains)}")
        entry = baseline(f"hospital {name} alone (baseline)", train, [vals[name]], steps,
                         site=name)
        if entry is not None:
            local_only.append(entry)
    if beside is not None:
        phase("centralized baseline: waiting for its other core")
        trained_there = beside.result()
        if isinstance(trained_there, tuple) and len(trained_there) == 4:
            failures.append(str(HospitalFailure(*trained_there)))
        else:
            state, chosen = trained_there

            def fetched() -> tuple[SiteModel, BestRound]:
                import torch

                model = _fresh_model(pooled, num_outputs, cfg)
                model.load_state_dict({k: torch.from_numpy(v) for k, v in state.items()})
                return model, chosen

            centralized = baseline(central, pooled, pooled_vals, central_steps, fitted=fetched)
    return centralized, local_only, failures


#: Below this many hospitals the closing's baselines take a second or two: starting a process
#: for the centralized one would cost more than it saves.
BESIDE_MIN_SITES = CROSS_SCORED_SITES


def beside_locals(wanted: Sequence[str], sites: int, exact_schema: str | None) -> bool:
    """Whether the centralized baseline trains in a process of its own while the hospital-alone
    baselines train here: both wanted, many hospitals, a second core, no exact Cox fit (it
    fits in closed form). The two take as many optimizer steps each (`baseline_steps`), so at
    1,000 hospitals this halves the closing's training time on two cores."""
    return (CENTRALIZED in wanted and LOCAL in wanted and exact_schema is None
            and sites > BESIDE_MIN_SITES and (os.cpu_count() or 1) > 1)


def _train_beside(who: str, train: Dataset, vals: Sequence[Dataset], num_outputs: int,
                  cfg: RunConfig, steps: int
                  ) -> tuple[dict[str, np.ndarray], BestRound] | tuple[str, str, str, str]:
    """`train_baseline` in a spawned worker (never forked: this process may hold threads),
    torch at one thread: the kept weights and the selection, or the failure's parts
    (`HospitalFailure` does not pickle: its arguments are not its message)."""
    import torch

    torch.set_num_threads(1)
    try:
        with hospital_stage(who, "training"):
            model, chosen = train_baseline(train, vals, num_outputs, cfg, steps)
    except HospitalFailure as e:
        return e.site, e.stage, e.cause, e.fix
    return {k: v.detach().cpu().numpy() for k, v in model.state_dict().items()}, chosen


def _names(names: Sequence[str], shown: int = 8) -> str:
    """The hospitals' names for a progress line: all of a few, else the first ``shown``."""
    return ", ".join(names) if len(names) <= shown else (
        f"{', '.join(names[:shown])}, ... {len(names) - shown} more")


def local_states(out: Path, joined: Sequence[SiteTable], server_round: int | None
                 ) -> dict[str, dict[str, np.ndarray]]:
    """Each simulated hospital's tensors that never travel, as it held them after
    ``server_round`` (written by its agent in OUT/sites/site-i/local/)."""
    return {t.name: state for i, t in enumerate(joined)
            if (state := read_local_state(out / "sites" / f"site-{i}", server_round))}


def _left_out(history: RunRecord, names: Sequence[str]) -> list[str]:
    """The hospitals whose own data or code failed in every round they were asked to train:
    the federation trained without them (one line each, as the hospital reported it). A
    hospital that withheld an update outside the secure-aggregation range did what the
    protocol asks (the round goes on without it, docs/privacy.md): that is no failure here."""
    reports: dict[str, list[SiteEntry]] = {}  # each hospital's reports, in round order: O(N x R)
    for r in history.rounds:
        for s in r.train.sites if r.train else []:
            reports.setdefault(s.site, []).append(s)
    lines = []
    for name in names:
        entries = reports.get(name, [])
        own = f"hospital {name},"
        if entries and all(s.excluded and s.reason and s.reason.startswith(own)
                           and not s.reason.startswith(f"{own} secure aggregation:")
                           for s in entries):
            lines.append(f"{entries[-1].reason} (in every round: the federation trained "
                         f"without it)")
    return lines


def load_summary(path: Path) -> RunSummary:
    """Read a summary.json written by `run_experiment` (`RunSummary.load`)."""
    return RunSummary.load(path)


def prepare_partitions(out: Path, dataset: str, sites: int, partition: str = "iid",
                       seed: int = 0) -> dict[str, Path]:
    """Write hospital-i/data.* under ``out`` (each folder holds one hospital's rows only).

    Returns hospital name -> its data file (for `orchestration.fingerprint.data_fingerprint`).
    """
    cfg = RunConfig(seed=seed)
    if dataset == HEART:  # its own four hospitals; the run config's default target and no ID
        tables = prepare_tables(Experiment(cfg=cfg, out=out, dataset=dataset))
        for t in tables:
            t.train = t.train.drop(columns=[HEART_ID]).rename(columns={HEART_TARGET: cfg.target})
        return {t.name: write_site(t.train, out / t.name, cfg.target) for t in tables}
    tables = prepare_tables(Experiment(cfg=cfg, out=out, dataset=dataset, num_sites=sites,
                                       partition=partition))
    return {name: write_site(t.train, out / name, cfg.target)
            for name, t in zip(site_names(len(tables)), tables, strict=True)}


def run_simulation(
    exp: Experiment,
    *,
    on_progress: Callable[[RunRecord], None] | None = None,
    on_stage: Callable[[str], None] | None = None,
    on_phase: Callable[[str], None] | None = None,
) -> RunSummary:
    """``fedsplit simulate``: `run_experiment` with one torch thread per process (the cores are
    shared with the simulated hospitals); under ``dp``, then the summary's privacy section and
    the membership-inference audit (`orchestration.privacy_audit.add_privacy`)."""
    import torch

    torch.set_num_threads(1)
    summary = run_experiment(exp, on_progress=on_progress, on_stage=on_stage, on_phase=on_phase)
    if exp.cfg.dp:
        from fedsplit.orchestration.privacy_audit import add_privacy

        if on_stage is not None:
            on_stage("privacy: spent epsilon per hospital and membership-inference audit")
        summary = add_privacy(exp.out, audit=True)
    return summary
