"""The groups every run's settings are composed of, each field defined once.

A run kind's settings model is the union of the groups it uses (pydantic models inherit the
fields, validators and defaults of their bases): `protocol.config.RunConfig` (a horizontal
federation) uses them all; `protocol.survival.SurvivalRun` (``fedsplit km``/``cox``) uses
`TableReading`, `SecureSettings` and `FederationSettings`; `protocol.vertical.config.VerticalConfig`
uses `RoundSettings` and `FederationSettings`. A setting added to a group is therefore read,
validated and documented the same way by every run kind that holds the group.

Flower's run config (``context.run_config``, a ConfigRecord) is flat and kebab-case: every field
has its run-config key as alias, and a model is read from and written to that flat form
(``from_flower``/``to_flower``); lists travel as text (comma-separated column lists, JSON site
names), the form saved runs hold (``history.json``'s ``config``).
"""

from __future__ import annotations

import json
from typing import Any, Literal

from fedsplit.protocol.errors import ConfigError
from fedsplit.protocol.roster import read_roster
from fedsplit.protocol.tasks import check_task
from pydantic import BaseModel, ConfigDict, Field, ValidationError, ValidationInfo, field_validator


def json_object(value: str) -> str:
    """``value`` when it is a JSON object string; else the error names the fix."""
    try:
        parsed = json.loads(value)
    except json.JSONDecodeError as e:  # the value received, not the whole run config
        raise ValueError(f"must be a JSON object string, e.g. '{{\"beta\": 0.2}}' ({e}). "
                         f"Received: {value!r}") from e
    if not isinstance(parsed, dict):
        raise ValueError(f"must be a JSON object string, e.g. '{{\"beta\": 0.2}}'. "
                         f"Received: {value!r}")
    return value


def comma_list(value: Any) -> str:
    """A column list as the run config holds it: comma-separated text. Also reads a list, and
    the JSON list text earlier survival runs wrote."""
    if isinstance(value, str) and value.strip().startswith("["):
        try:
            value = json.loads(value)
        except json.JSONDecodeError as e:
            raise ValueError(f"must be comma-separated text or a JSON list ({e}). "
                             f"Received: {value!r}") from e
    if isinstance(value, list | tuple):
        return ",".join(str(v).strip() for v in value if str(v).strip())
    return value


def problems(model: type[BaseModel], error: ValidationError) -> str:
    """What ``error`` found wrong, each field named by its run-config key (an unknown key as
    it was given)."""
    def key(err: Any) -> str:
        loc = tuple(err["loc"])
        field = model.model_fields.get(str(loc[0]))
        if err["type"] == "extra_forbidden" or field is None:  # as it was given
            return ".".join(map(str, loc))
        return ".".join([field.alias or str(loc[0]), *map(str, loc[1:])])

    messages = (f"{key(err)}: {str(err['msg']).removeprefix('Value error, ')}"
                if err["loc"] else str(err["msg"]).removeprefix("Value error, ")
                for err in error.errors())
    return "; ".join(m.rstrip(".") for m in messages)


def split_list(value: str) -> tuple[str, ...]:
    """A comma-separated run-config list, blanks dropped."""
    return tuple(v.strip() for v in value.split(",") if v.strip())


class Group(BaseModel):
    """A group of settings: kebab-case aliases, unknown keys refused, frozen."""

    model_config = ConfigDict(populate_by_name=True, extra="forbid", frozen=True)


class FederationSettings(Group):
    """Where the coordinator writes, whom it waits for and how long (every run kind)."""

    out_dir: str = Field("fedsplit-run", alias="out-dir",
                         description="Where the coordinator writes its models and records.")
    min_nodes: int = Field(2, ge=1, alias="min-nodes",
                           description="Hospitals that must be connected before the first round.")
    round_timeout: float = Field(3600.0, gt=0, alias="round-timeout",
                                 description="Seconds to wait for replies in each phase of a round.")


class RoundSettings(Group):
    """How many rounds, and which round's model is kept (the trained run kinds)."""

    num_server_rounds: int = Field(3, ge=1, alias="num-server-rounds",
                                   description="Federation rounds to run.")
    keep: Literal["best-val", "last"] = Field(
        "best-val", description="Which round's model is kept (horizontal: global.h5; last.h5 is "
                                "always the last round's): best-val, the round whose federated "
                                "evaluation on validation rows scores best by the task metric "
                                "(ties to the later round; protocol/selection.py), or last (the "
                                "last round, for protocols that fix the round count).")


class TableReading(Group):
    """How and where each hospital reads its table (every run kind that reads tables)."""

    id_column: str = Field("", alias="id-column",
                           description="A patient ID column in site tables: never a feature, never sent.")
    ignore_columns: str = Field("", alias="ignore-columns",
                                description="Columns of site tables to leave out, comma-separated.")
    na_values: str = Field(
        "", alias="na-values",
        description="Extra cell values read as missing, comma-separated (besides empty, NA, N/A, NaN, "
                    "null, None and ?, any case): VALUE for every column, COLUMN=VALUE for one.")
    min_category_count: int = Field(
        5, ge=1, alias="min-category-count",
        description="A text category or class label held by fewer rows at a site is withheld from its "
                    "column report (protocol/schema.py; a hospital's policy may raise it): rows with "
                    "such a category encode as unseen, rows with such a label are dropped there, "
                    "unless another site reports it.")
    data_dir: str = Field("", alias="data-dir",
                          description="Simulation only: site i reads DATA_DIR/site-i/ (node config "
                                      "'data-path' takes precedence).")
    site_names: str = Field(
        "[]", alias="site-names",
        description="Simulation only: JSON list of hospital names by partition-id (written by the "
                    "simulation runners; node config 'site-name' takes precedence).")
    site_roster: str = Field(
        "", alias="site-roster",
        description="Simulation only, written by the runners: a roster file (protocol/roster.py) "
                    "holding site-names and data-fingerprint, so the run config, which travels "
                    "with every message, does not grow with the hospitals.")

    @field_validator("ignore_columns", "na_values", mode="before")
    @classmethod
    def _comma_list(cls, value: Any) -> Any:
        return comma_list(value)

    @field_validator("site_names", mode="before")
    @classmethod
    def _json_list(cls, value: Any) -> str:
        if isinstance(value, list | tuple):
            value = json.dumps(list(value))
        try:
            parsed = json.loads(value)
        except (TypeError, json.JSONDecodeError) as e:
            raise ValueError(f"must be a JSON list of names, e.g. '[\"cleveland\"]' ({e})") from e
        if not isinstance(parsed, list) or not all(isinstance(v, str) and v for v in parsed):
            raise ValueError("must be a JSON list of non-empty names, e.g. '[\"cleveland\"]'")
        return value

    @property
    def names(self) -> list[str]:
        """``site_names`` parsed; the roster's when the run names one instead."""
        if self.site_roster and self.site_names == "[]":
            return list(read_roster(self.site_roster).site_names)
        return list(json.loads(self.site_names))

    @property
    def ignored(self) -> tuple[str, ...]:
        """``ignore_columns`` parsed."""
        return split_list(self.ignore_columns)

    @property
    def missing_markers(self) -> tuple[str, ...]:
        """``na_values`` parsed."""
        return split_list(self.na_values)


class DataSettings(TableReading):
    """The table reading of a trained run, with its label columns."""

    target: str = Field("target", description="Target column in CSV/Parquet site files.")
    event: str = Field("", description="Survival: the event column (1/0, TRUE/FALSE, yes/no); "
                                       "'target' is then the follow-up time column.")


class SecureSettings(Group):
    """What the coordinator may see of the hospitals' sums (every run kind that sums)."""

    secure_aggregation: str = Field(
        "", alias="secure-aggregation",
        description="Secure aggregation (SecAgg+, protocol/privacy.py): '' = off, or "
                    "bound=B[,levels=L][,neighbours=K][,threshold=T] (each coordinate of a "
                    "hospital's change must lie in [-B, B]; docs/privacy.md).")
    min_count: int = Field(5, ge=1, alias="min-count",
                           description="Survival: the Kaplan-Meier curve and the Breslow baseline "
                                       "publish no cell resting on fewer events (docs/survival.md).")

    @field_validator("secure_aggregation")
    @classmethod
    def _secure_spec(cls, value: str) -> str:
        """Canonical: ``""`` when off (``''``, ``none``, ``off``), else `SecureSpec.to_spec`
        (``on``: the defaults)."""
        from fedsplit.protocol.privacy import SecureSpec

        spec = SecureSpec.parse(value)
        return spec.to_spec() if spec is not None else ""


class PrivacySettings(SecureSettings):
    """Secure aggregation and the minimum count, with differential privacy (trained runs)."""

    dp: str = Field("", description="Differential privacy (protocol/privacy.py): '' = off, or "
                    "level=patient|hospital,epsilon=E,delta=D[,clip=C],rounds=R (the budget and "
                    "the rounds it is planned for; docs/privacy.md).")

    @field_validator("dp")
    @classmethod
    def _dp_spec(cls, value: str, info: ValidationInfo) -> str:
        """Canonical: ``""`` when off, else `DPSpec.to_spec` with the planned rounds filled in
        from ``num-server-rounds`` when the spec names none."""
        from fedsplit.protocol.privacy import DPSpec

        spec = DPSpec.parse(value, rounds=info.data.get("num_server_rounds"))
        return spec.to_spec() if spec is not None else ""


class ModelSettings(Group):
    """What the hospitals train: the task, the built-in model's shape, or their recipe."""

    model: Literal["auto", "mlp", "cnn"] = Field(
        "auto", description="Architecture: mlp (tables), cnn (images), auto (by data file type).")
    hidden: str = Field("64-32", description="MLP hidden widths, dash-separated.")
    norm: Literal["none", "batch"] = Field(
        "none", description="Normalisation after each MLP hidden layer: none, or batch (BatchNorm1d; "
                            "part of the model id; MLP only; needs batch-size >= 2 and parallel=none).")
    task: str = Field(
        "auto", description="Learning task: a registered task kind (protocol/tasks.py: "
                            "classification, regression, survival, ...); auto infers it from the "
                            "target (survival when 'event' is set).")
    penalizer: float = Field(0.0, ge=0, description="Survival: the Cox model's ridge penalty in "
                             "lifelines' convention (n * P * ||w||^2 / 2).")
    num_classes: int = Field(0, ge=0, alias="num-classes",
                             description="Classes; 0 = one more than the largest label any site holds.")
    recipe: str = Field("", description="The hospitals' recipe (docs/recipes.md): package.module:Attribute "
                        "or an entry point of the fedsplit.recipes group; '' = the built-in "
                        "MLP or CNN by the data (model, hidden, norm). A hospital's node "
                        "config 'recipe' takes precedence.")
    recipe_params: str = Field("{}", alias="recipe-params",
                               description="The recipe's parameters as a JSON object string "
                                           "(validated by the recipe's Params model).")

    @field_validator("task")
    @classmethod
    def _task_kind(cls, value: str) -> str:
        return check_task(value)  # auto, or a registered kind (the error names them)

    @field_validator("norm", mode="before")
    @classmethod
    def _norm_name(cls, value: Any) -> Any:
        if value not in ("none", "batch"):
            raise ValueError(f"--norm is none or batch (BatchNorm1d after each MLP hidden "
                             f"layer). Received: {value!r}")
        return value

    @field_validator("recipe")
    @classmethod
    def _recipe_ref(cls, value: str) -> str:
        from fedsplit.protocol.recipe import parse_reference

        if value:
            try:
                parse_reference(value)
            except ConfigError as e:
                raise ValueError(str(e)) from e
        return value

    @field_validator("recipe_params")
    @classmethod
    def _params(cls, value: str) -> str:
        return json_object(value)

    @field_validator("hidden")
    @classmethod
    def _widths(cls, value: str) -> str:
        parts = value.split("-")
        if value == "none":  # no hidden layer: logistic (softmax) regression
            return value
        if not all(p.isdigit() and int(p) > 0 for p in parts):
            raise ValueError("must be positive widths joined by '-', e.g. '64-32', or 'none'")
        return value

    @property
    def hidden_widths(self) -> tuple[int, ...]:
        """``hidden`` parsed (``none``: no hidden layer)."""
        return () if self.hidden == "none" else tuple(int(p) for p in self.hidden.split("-"))


class TrainingSettings(Group):
    """Each hospital's local training per round."""

    local_epochs: int = Field(1, ge=1, alias="local-epochs",
                              description="Epochs each hospital trains per round.")
    local_steps: int = Field(
        0, ge=0, alias="local-steps",
        description="Mini-batches each hospital trains per round; 0 = local-epochs epochs, but at least "
                    "MIN_LOCAL_STEPS (10) mini-batches (client/train.py: local_steps_per_round).")
    lr: float = Field(0.01, gt=0, description="Adam learning rate of local training.")
    batch_size: int = Field(32, ge=1, alias="batch-size", description="Local mini-batch size.")
    proximal_mu: float = Field(0.0, ge=0, alias="proximal-mu",
                               description="FedProx term mu/2*||w-w_global||^2 (0 = plain FedAvg).")
    seed: int = Field(0, description="Seed for the initial model, local shuffling and splits.")
    val_fraction: float = Field(0.2, ge=0.05, lt=1, alias="val-fraction",
                                description="Share of each site's rows held out for local evaluation.")
    device: str = Field("auto", description="auto (cuda if present), cpu or cuda[:N].")
    parallel: str = Field("none", description="How each hospital splits its own training: none, "
                          "data:replicas=R, model:map=..., pipeline:stages=S,microbatches=M "
                          "(docs/site-parallel.md).")


class AggregationSettings(Group):
    """How the coordinator merges the hospitals' updates, and which it takes."""

    strategy: str = Field("fedavg", description="Aggregation strategy name (`fedsplit strategies`).")
    strategy_params: str = Field("{}", alias="strategy-params",
                                 description="Strategy parameters as a JSON object string.")
    fraction_train: float = Field(1.0, gt=0, le=1, alias="fraction-train",
                                  description="Share of connected hospitals sampled per round.")
    quorum: int = Field(0, ge=0,
                        description="Fewest hospitals a round needs (k of n): it starts once k are "
                                    "connected and updates the global model only from at least k valid "
                                    "training replies received within round-timeout; a short round is "
                                    "recorded in the history and the run goes on. 0 = min-nodes.")
    cohort_caps: str = Field("{}", alias="cohort-caps",
                             description="Registered cohort size per site as a JSON object "
                                         "('{\"site-0\": 1200}'); a claimed count above it is clipped "
                                         "or refused (cap-policy) and flagged.")
    cap_policy: Literal["clip", "refuse"] = Field("clip", alias="cap-policy",
                                                  description="What a count above its cohort cap gets.")

    @field_validator("strategy_params", "cohort_caps")
    @classmethod
    def _objects(cls, value: str) -> str:
        return json_object(value)

    @property
    def params(self) -> dict[str, Any]:
        """``strategy_params`` parsed."""
        return json.loads(self.strategy_params)

    @property
    def caps(self) -> dict[str, int]:
        """``cohort_caps`` parsed."""
        return {str(k): int(v) for k, v in json.loads(self.cohort_caps).items()}


class StartSettings(Group):
    """What a trained run starts from: a weight file, or the unfinished run in its out-dir."""

    initial_weights: str = Field("", alias="initial-weights",
                                 description="Optional weight file to start from instead of a fresh model.")
    resume: bool = Field(True,
                         description="If out-dir holds an unfinished run (history.json + global.h5), "
                                     "continue after its last completed round instead of starting over.")


class ServerOptimizerSettings(Group):
    """The server optimizer applied to what the strategy aggregated."""

    server_opt: Literal["none", "adam", "yogi", "adagrad", "avgm"] = Field(
        "none", alias="server-opt",
        description="Server optimizer applied to the pseudo-gradient (aggregate - global) of whatever "
                    "the strategy aggregated (Reddi et al. 2021; avgm: server momentum, Hsu et al. 2019).")
    server_lr: float = Field(0.0, ge=0, alias="server-lr",
                             description="Server learning rate; 0 = the optimizer's default "
                                         "(adam/yogi/adagrad 0.01, avgm 1.0).")
    server_beta1: float = Field(0.9, ge=0, lt=1, alias="server-beta1",
                                description="First-moment decay of adam/yogi (also adagrad's momentum).")
    server_beta2: float = Field(0.99, ge=0, lt=1, alias="server-beta2",
                                description="Second-moment decay of adam/yogi.")
    server_tau: float = Field(1e-3, gt=0, alias="server-tau",
                              description="Adaptivity tau of adam/yogi/adagrad (denominator sqrt(v) + tau).")
    server_momentum: float = Field(0.9, ge=0, lt=1, alias="server-momentum",
                                   description="Momentum of avgm.")


class SimulationSettings(Group):
    """What only a simulation sets: hostile sites and the simulated sites' data fingerprint."""

    attack: str = Field("none", description="Simulation only: how hostile sites behave: signflip[:K], "
                        "scale:K, gaussian:SIGMA, nan, labelflip (client/attacks.py).")
    attackers: int = Field(0, ge=0,
                           description="Simulation only: how many sites (the last ones) are hostile.")
    data_fingerprint: str = Field(
        "{}", alias="data-fingerprint",
        description="Written by the simulation runners, not by hand: a JSON object site -> {rows, "
                    "columns, sha256} of each simulated site's files; resuming an out-dir whose sites "
                    "hold other data is refused.")

    @field_validator("data_fingerprint")
    @classmethod
    def _fingerprint(cls, value: str) -> str:
        return json_object(value)
