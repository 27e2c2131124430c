"""Every command-line option more than one command takes, defined once, in groups.

A group is a frozen dataclass whose fields carry their typer option (``Annotated[type,
typer.Option(...)]``). A command takes a group as one parameter (``data: DataOptions``) and is
registered through `grouped`, which gives the command the group's fields as its own options and
hands it the group built from them: ``fedsplit simulate`` and ``fedsplit up`` read their data
options from the same `DataOptions`, so an option added to it exists wherever a table is read
(tests/cli/test_shared_options.py compares the commands' options). A command that takes only
some of a group's options (``km``, ``cox``) uses the same field definitions one by one
(`IdColumn`, `IgnoreColumn`, `NaValues`, ...).

Each group turns its values into the run configuration's keys (`protocol.config.RunConfig`) in
one method, so no command spells a key out.
"""

from __future__ import annotations

import dataclasses
import functools
import inspect
import json
from collections.abc import Callable
from dataclasses import dataclass
from typing import Annotated, Any, TypeVar, get_type_hints

import typer
from fedsplit.protocol import tasks

# --- how a hospital reads its table (every command that reads data) --------------------------
Target = Annotated[str, typer.Option(help="Target column of the hospitals' tables.")]
Time = Annotated[str, typer.Option("--time", help="Survival: the follow-up time column "
                                                  "(positive; the target). Needs --event.")]
Event = Annotated[str, typer.Option("--event", help="Survival: the event column (1/0, TRUE/FALSE, "
                                                    "yes/no; 1 = event observed, 0 = censored).")]
IdColumn = Annotated[str, typer.Option(help="Patient ID column of the hospitals' tables (never a "
                                            "feature, never sent).")]
IgnoreColumn = Annotated[list[str] | None, typer.Option(
    "--ignore-column", help="A column of the hospitals' tables to leave out (repeatable; or "
                            "comma-separated).")]
NaValues = Annotated[list[str] | None, typer.Option(
    "--na-values", help="Extra missing-value markers (besides empty, NA, N/A, NaN, null, None, ?): "
                        "VALUE for every column, COLUMN=VALUE for one (e.g. chol=0); repeatable "
                        "or comma-separated.")]
MinCategoryCount = Annotated[int, typer.Option(
    min=1, help="A text category or class label held by fewer rows at a hospital is withheld "
                "from its column report.")]
# --- the model ---------------------------------------------------------------------------------
Task = Annotated[str, typer.Option(help=f"auto, or a task kind: {', '.join(tasks.BUILTIN)} "
                                        "(survival with --time and --event; docs/survival.md) "
                                        "or one a package registers (docs/architecture.md, "
                                        "'Task kinds').")]
Hidden = Annotated[str | None, typer.Option(
    help="MLP hidden widths, e.g. 64-32 (the default), or none (logistic or linear regression; "
         "for survival the linear Cox model, its default).")]
Norm = Annotated[str, typer.Option(help="Normalisation after each MLP hidden layer: none or batch "
                                        "(BatchNorm1d).")]
Penalizer = Annotated[float | None, typer.Option(
    min=0.0, help="Survival: the Cox model's ridge penalty (lifelines' convention; default 0, "
                  "tcga-brca 0.01).")]
Recipe = Annotated[str, typer.Option(
    help="The hospitals' own model, loss and metrics (docs/recipes.md): package.module:Attribute "
         "or an installed fedsplit.recipes entry point; default: the built-in MLP (tables) or "
         "CNN (images).")]
RecipeParams = Annotated[str, typer.Option(help="The recipe's parameters, a JSON object "
                                                "(validated by the recipe).")]
# --- local training ------------------------------------------------------------------------
LocalEpochs = Annotated[int, typer.Option(min=1, help="Local epochs per round (at least 10 "
                                                      "mini-batches).")]
LocalSteps = Annotated[int, typer.Option(min=0, help="Mini-batches per hospital per round instead "
                                                     "of epochs (0 = use --local-epochs).")]
Lr = Annotated[float, typer.Option(min=0.0, help="Adam learning rate.")]
BatchSize = Annotated[int, typer.Option(min=1, help="Local batch size.")]
ProximalMu = Annotated[float, typer.Option(min=0.0, help="FedProx mu (0 = off).")]
Seed = Annotated[int, typer.Option(help="Seed for partitions, splits and initial weights.")]
# --- aggregation and its server optimizer --------------------------------------------------
Strategy = Annotated[str, typer.Option(help="Aggregation strategy (`fedsplit strategies`).")]
Param = Annotated[list[str] | None, typer.Option("--param", help="Strategy parameter key=value "
                                                                 "(repeatable).")]
ServerOpt = Annotated[str, typer.Option(help="Server optimizer on the aggregate's pseudo-gradient: "
                                             "none, adam, yogi, adagrad, avgm.")]
ServerLr = Annotated[float, typer.Option(min=0.0, help="Server learning rate (0 = the optimizer's "
                                                       "default).")]
ServerBeta1 = Annotated[float, typer.Option(min=0.0, max=0.9999, help="Server beta1.")]
ServerBeta2 = Annotated[float, typer.Option(min=0.0, max=0.9999, help="Server beta2.")]
ServerTau = Annotated[float, typer.Option(min=1e-12, help="Server adaptivity tau.")]
ServerMomentum = Annotated[float, typer.Option(min=0.0, max=0.9999, help="avgm's server momentum.")]
# --- privacy ----------------------------------------------------------------------------------
SecureAggregation = Annotated[str, typer.Option(
    help="Secure aggregation (SecAgg+): on, or bound=B[,levels=L][,neighbours=K][,threshold=T]; "
         "the coordinator sees only the sum of the count-weighted changes and the total count "
         "(docs/privacy.md). none = off.")]
MinCount = Annotated[int, typer.Option(min=1, help="Survival: the pooled Kaplan-Meier curve and "
                                                   "Breslow baseline publish no cell of fewer "
                                                   "events (docs/survival.md).")]
# --- the run ---------------------------------------------------------------------------------
Rounds = Annotated[int, typer.Option(min=1, help="Federation rounds.")]
Resume = Annotated[bool, typer.Option(help="Continue an unfinished run in the output folder after "
                                           "its last completed round (refused if its config or "
                                           "site data differ); --no-resume starts over.")]
Keep = Annotated[str, typer.Option(
    help="Which round's federated model is kept (global.h5): best-val, the round that scores "
         "best on the hospitals' validation rows (the baselines' rule, ties to the later round), "
         "or last (the last round, for protocols that fix the round count).",
    metavar="best-val|last")]


def split_values(values: list[str] | None) -> list[str]:
    """A repeatable option's values, each also split at commas, blanks dropped."""
    return [v.strip() for value in values or [] for v in value.split(",") if v.strip()]


@dataclass(frozen=True)
class DataOptions:
    """How every hospital reads its table: the same options wherever data is read."""

    target: Target = "target"
    time: Time = ""
    event: Event = ""
    id_column: IdColumn = ""
    ignore_column: IgnoreColumn = None
    na_values: NaValues = None
    min_category_count: MinCategoryCount = 5

    def run_keys(self) -> dict[str, Any]:
        """The run config's keys of the table reading (the label columns: `ModelOptions`)."""
        return {"ignore_columns": ",".join(split_values(self.ignore_column)),
                "na_values": ",".join(split_values(self.na_values)),
                "min_category_count": self.min_category_count}


@dataclass(frozen=True)
class ModelOptions:
    """What the hospitals train: the task, the built-in model's shape, or their own recipe."""

    task: Task = "auto"
    hidden: Hidden = None
    norm: Norm = "none"
    penalizer: Penalizer = None
    recipe: Recipe = ""
    recipe_params: RecipeParams = "{}"

    def run_keys(self, dataset: str | None, data: DataOptions) -> dict[str, Any]:
        """The run config's label and model keys: a bundled dataset's own columns and task
        (`orchestration.datasets.table_keys`, which refuses a conflicting option), the recipe."""
        from fedsplit.orchestration.datasets import table_keys
        from fedsplit.protocol.recipe import parse_params

        parse_params(self.recipe_params)  # not JSON: one line naming --recipe-params and the value
        return {**table_keys(dataset, target=data.target, time=data.time, event=data.event,
                             id_column=data.id_column, task=self.task, hidden=self.hidden,
                             penalizer=self.penalizer),
                "norm": self.norm, "recipe": self.recipe, "recipe_params": self.recipe_params}


@dataclass(frozen=True)
class TrainingOptions:
    """Each hospital's local training per round."""

    local_epochs: LocalEpochs = 1
    local_steps: LocalSteps = 0
    lr: Lr = 0.01
    batch_size: BatchSize = 32
    proximal_mu: ProximalMu = 0.0
    seed: Seed = 0

    def run_keys(self) -> dict[str, Any]:
        """The run config's keys: the fields by name."""
        return dataclasses.asdict(self)


@dataclass(frozen=True)
class AggregationOptions:
    """How the coordinator merges the hospitals' updates, and its server optimizer."""

    strategy: Strategy = "fedavg"
    param: Param = None
    server_opt: ServerOpt = "none"
    server_lr: ServerLr = 0.0
    server_beta1: ServerBeta1 = 0.9
    server_beta2: ServerBeta2 = 0.99
    server_tau: ServerTau = 1e-3
    server_momentum: ServerMomentum = 0.9

    def run_keys(self) -> dict[str, Any]:
        """The run config's keys (``--param`` pairs: ``strategy_params``, a JSON object)."""
        from fedsplit import aggregation

        keys = {k: v for k, v in dataclasses.asdict(self).items() if k != "param"}
        return {**keys, "strategy_params": json.dumps(aggregation.parse_param_pairs(self.param or []))}


@dataclass(frozen=True)
class RunOptions:
    """The federation's rounds, what it keeps, its privacy."""

    rounds: Rounds = 10
    resume: Resume = True
    keep: Keep = "best-val"
    secure_aggregation: SecureAggregation = "none"
    min_count: MinCount = 5

    def run_keys(self) -> dict[str, Any]:
        """The run config's keys (``--rounds``: ``num_server_rounds``)."""
        return {"num_server_rounds": self.rounds, "resume": self.resume, "keep": self.keep,
                "secure_aggregation": self.secure_aggregation, "min_count": self.min_count}


#: every group a command may take
GROUPS = (DataOptions, ModelOptions, TrainingOptions, AggregationOptions, RunOptions)

Command = TypeVar("Command", bound=Callable[..., Any])


def grouped(command: Command) -> Command:
    """``command`` with each parameter typed as a group replaced by the group's fields (its
    options, named as the fields), and called with the group built from their values: what typer
    reads to build the command's options (its signature) and what it then calls. A group
    parameter's default, when given (``run: RunOptions = RunOptions(rounds=3)``), holds the
    command's own defaults of the group's options."""
    hints = get_type_hints(command, include_extras=True)
    groups: dict[str, type] = {}
    params: list[inspect.Parameter] = []
    for param in inspect.signature(command).parameters.values():
        kind = hints.get(param.name, param.annotation)
        if kind in GROUPS:
            groups[param.name] = kind
            fields = get_type_hints(kind, include_extras=True)
            defaults = param.default if isinstance(param.default, kind) else kind()
            params += [inspect.Parameter(f.name, inspect.Parameter.KEYWORD_ONLY,
                                         default=getattr(defaults, f.name),
                                         annotation=fields[f.name])
                       for f in dataclasses.fields(kind)]
        else:
            params.append(param.replace(annotation=kind, kind=inspect.Parameter.KEYWORD_ONLY))
    names = [p.name for p in params]
    if len(set(names)) != len(names):
        raise TypeError(f"{command.__name__}: an option is named twice: "
                        f"{sorted({n for n in names if names.count(n) > 1})}")

    @functools.wraps(command)
    def call(**values: Any) -> Any:
        for name, kind in groups.items():
            values[name] = kind(**{f.name: values.pop(f.name) for f in dataclasses.fields(kind)})
        return command(**values)

    call.__signature__ = inspect.Signature(params)  # type: ignore[attr-defined]
    call.__annotations__ = {p.name: p.annotation for p in params}
    del call.__wrapped__  # typer reads the signature above, not the command's own
    return call  # type: ignore[return-value]
