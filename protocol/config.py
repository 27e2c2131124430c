"""The run configuration the coordinator and every hospital agent read.

Flower delivers it as ``context.run_config`` (``[tool.flwr.app.config]`` plus ``flwr run
--run-config`` overrides); keys are kebab-case. One pydantic model validates it for both sides,
so a typo or an out-of-range value fails at start with a message that names the key.
"""

from __future__ import annotations

import json
from collections.abc import Mapping
from typing import Any, ClassVar, Literal

from fedsplit.protocol.errors import ConfigError
from fedsplit.protocol.schema import TableSettings
from pydantic import (
    BaseModel,
    ConfigDict,
    Field,
    ValidationError,
    ValidationInfo,
    field_validator,
    model_validator,
)


class RunConfig(BaseModel):
    """Every knob of a horizontal federation, documented once."""

    model_config = ConfigDict(populate_by_name=True, extra="forbid", frozen=True)

    #: The fields a resumed run (same out-dir) may change (`server.history.find_resume_point`):
    #: none of them alters a trained round. ``min_count`` acts only on the survival summary after
    #: the last round, so a run whose summary published too little ("Lower min-count") is rerun
    #: with a lower one and only the summary is redone. `resumable_keys` gives their run-config keys.
    RESUMABLE: ClassVar[tuple[str, ...]] = ("num_server_rounds", "round_timeout", "resume",
                                            "quorum", "min_nodes", "device", "keep", "min_count")

    num_server_rounds: int = Field(3, ge=1, alias="num-server-rounds",
                                   description="Federation rounds to run.")
    strategy: str = Field("fedavg", description="Aggregation strategy name (`fedsplit strategies`).")
    strategy_params: str = Field("{}", alias="strategy-params",
                                 description="Strategy parameters as a JSON object string.")
    local_epochs: int = Field(1, ge=1, alias="local-epochs",
                              description="Epochs each hospital trains per round.")
    lr: float = Field(0.01, gt=0, description="Adam learning rate of local training.")
    batch_size: int = Field(32, ge=1, alias="batch-size", description="Local mini-batch size.")
    proximal_mu: float = Field(0.0, ge=0, alias="proximal-mu",
                               description="FedProx term mu/2*||w-w_global||^2 (0 = plain FedAvg).")
    model: Literal["auto", "mlp", "cnn"] = Field(
        "auto", description="Architecture: mlp (tables), cnn (images), auto (by data file type).")
    hidden: str = Field("64-32", description="MLP hidden widths, dash-separated.")
    norm: Literal["none", "batch"] = Field(
        "none", description="Normalisation after each MLP hidden layer: none, or batch (BatchNorm1d; "
                            "part of the model id; MLP only; needs batch-size >= 2 and parallel=none).")
    task: Literal["auto", "classification", "regression", "survival"] = Field(
        "auto", description="Learning task; auto infers it from the target (survival when "
                            "'event' is set).")
    event: str = Field("", description="Survival: the event column (1/0, TRUE/FALSE, yes/no); "
                                       "'target' is then the follow-up time column.")
    penalizer: float = Field(0.0, ge=0, description="Survival: the Cox model's ridge penalty in "
                             "lifelines' convention (n * P * ||w||^2 / 2).")
    min_count: int = Field(5, ge=1, alias="min-count",
                           description="Survival: the Kaplan-Meier curve and the Breslow baseline "
                                       "publish no cell resting on fewer events (docs/survival.md).")
    recipe: str = Field("", description="The hospitals' recipe (docs/recipes.md): package.module:Attribute "
                        "or an entry point of the fedsplit.recipes group; '' = the built-in "
                        "MLP or CNN by the data (model, hidden, norm). A hospital's node "
                        "config 'recipe' takes precedence.")
    recipe_params: str = Field("{}", alias="recipe-params",
                               description="The recipe's parameters as a JSON object string "
                                           "(validated by the recipe's Params model).")
    num_classes: int = Field(0, ge=0, alias="num-classes",
                             description="Classes; 0 = one more than the largest label any site holds.")
    target: str = Field("target", description="Target column in CSV/Parquet site files.")
    seed: int = Field(0, description="Seed for the initial model, local shuffling and splits.")
    val_fraction: float = Field(0.2, ge=0.05, lt=1, alias="val-fraction",
                                description="Share of each site's rows held out for local evaluation.")
    data_dir: str = Field("", alias="data-dir",
                          description="Simulation only: site i reads DATA_DIR/site-i/ (node config "
                                      "'data-path' takes precedence).")
    out_dir: str = Field("fedsplit-run", alias="out-dir",
                         description="Where the coordinator writes global models and history.json.")
    initial_weights: str = Field("", alias="initial-weights",
                                 description="Optional weight file to start from instead of a fresh model.")
    min_nodes: int = Field(2, ge=1, alias="min-nodes",
                           description="Hospitals that must be connected before round 1.")
    fraction_train: float = Field(1.0, gt=0, le=1, alias="fraction-train",
                                  description="Share of connected hospitals sampled per round.")
    round_timeout: float = Field(3600.0, gt=0, alias="round-timeout",
                                 description="Seconds to wait for replies in each phase of a round.")
    device: str = Field("auto", description="auto (cuda if present), cpu or cuda[:N].")
    parallel: str = Field("none", description="How each hospital splits its own training: none, "
                          "data:replicas=R, model:map=..., pipeline:stages=S,microbatches=M "
                          "(docs/site-parallel.md).")
    cohort_caps: str = Field("{}", alias="cohort-caps",
                             description="Registered cohort size per site as a JSON object "
                                         "('{\"site-0\": 1200}'); a claimed count above it is clipped "
                                         "or refused (cap-policy) and flagged.")
    cap_policy: Literal["clip", "refuse"] = Field("clip", alias="cap-policy",
                                                  description="What a count above its cohort cap gets.")
    attack: str = Field("none", description="Simulation only: how hostile sites behave: signflip[:K], "
                        "scale:K, gaussian:SIGMA, nan, labelflip (client/attacks.py).")
    attackers: int = Field(0, ge=0,
                           description="Simulation only: how many sites (the last ones) are hostile.")
    quorum: int = Field(0, ge=0,
                        description="Fewest hospitals a round needs (k of n): it starts once k are "
                                    "connected and updates the global model only from at least k valid "
                                    "training replies received within round-timeout; a short round is "
                                    "recorded in the history and the run goes on. 0 = min-nodes.")
    data_fingerprint: str = Field(
        "{}", alias="data-fingerprint",
        description="Written by the simulation runners, not by hand: a JSON object site -> {rows, "
                    "columns, sha256} of each simulated site's files; resuming an out-dir whose sites "
                    "hold other data is refused.")
    site_names: str = Field(
        "[]", alias="site-names",
        description="Simulation only: JSON list of hospital names by partition-id (written by the "
                    "simulation runners; node config 'site-name' takes precedence).")
    na_values: str = Field(
        "", alias="na-values",
        description="Extra cell values read as missing, comma-separated (besides empty, NA, N/A, NaN, "
                    "null, None and ?, any case): VALUE for every column, COLUMN=VALUE for one.")
    id_column: str = Field("", alias="id-column",
                           description="A patient ID column in site tables: never a feature, never sent.")
    ignore_columns: str = Field("", alias="ignore-columns",
                                description="Columns of site tables to leave out, comma-separated.")
    min_category_count: int = Field(
        5, ge=1, alias="min-category-count",
        description="A text category or class label held by fewer rows at a site is withheld from its "
                    "column report (protocol/schema.py; a hospital's policy may raise it): rows with "
                    "such a category encode as unseen, rows with such a label are dropped there, "
                    "unless another site reports it.")
    local_steps: int = Field(
        0, ge=0, alias="local-steps",
        description="Mini-batches each hospital trains per round; 0 = local-epochs epochs, but at least "
                    "MIN_LOCAL_STEPS (10) mini-batches (client/train.py: local_steps_per_round).")
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
    resume: bool = Field(True,
                         description="If out-dir holds an unfinished run (history.json + global.h5), "
                                     "continue after its last completed round instead of starting over.")
    keep: Literal["best-val", "last"] = Field(
        "best-val", description="Which round's global model is kept as global.h5: best-val, the round "
                                "whose federated evaluation on the hospitals' validation rows scores "
                                "best by the task metric (ties to the later round; "
                                "protocol/selection.py), or last (the last round, for protocols "
                                "that fix the round count). last.h5 is always the last round's.")
    dp: str = Field("", description="Differential privacy (protocol/privacy.py): '' = off, or "
                    "level=patient|hospital,epsilon=E,delta=D[,clip=C],rounds=R (the budget and "
                    "the rounds it is planned for; docs/privacy.md).")

    secure_aggregation: str = Field(
        "", alias="secure-aggregation",
        description="Secure aggregation (SecAgg+, protocol/privacy.py): '' = off, or "
                    "bound=B[,levels=L][,neighbours=K][,threshold=T] (each coordinate of a "
                    "hospital's change must lie in [-B, B]; docs/privacy.md).")

    @field_validator("dp")
    @classmethod
    def _dp_spec(cls, value: str, info: ValidationInfo) -> str:
        """Canonical: ``""`` when off, else `DPSpec.to_spec` with the planned rounds filled in
        from ``num-server-rounds`` when the spec names none."""
        from fedsplit.protocol.privacy import DPSpec

        spec = DPSpec.parse(value, rounds=info.data.get("num_server_rounds"))
        return spec.to_spec() if spec is not None else ""

    @field_validator("secure_aggregation")
    @classmethod
    def _secure_spec(cls, value: str) -> str:
        """Canonical: ``""`` when off, else `SecureSpec.to_spec` (``on``: the defaults)."""
        from fedsplit.protocol.privacy import SecureSpec

        spec = SecureSpec.parse(value)
        return spec.to_spec() if spec is not None else ""

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

    @field_validator("strategy_params", "cohort_caps", "data_fingerprint", "recipe_params")
    @classmethod
    def _json_object(cls, value: str) -> str:
        try:
            parsed = json.loads(value)
        except json.JSONDecodeError as e:  # the value received, not the whole run config
            raise ValueError(f"must be a JSON object string, e.g. '{{\"beta\": 0.2}}' ({e}). "
                             f"Received: {value!r}") from e
        if not isinstance(parsed, dict):
            raise ValueError(f"must be a JSON object string, e.g. '{{\"beta\": 0.2}}'. "
                             f"Received: {value!r}")
        return value

    @field_validator("site_names")
    @classmethod
    def _json_list(cls, value: str) -> str:
        try:
            parsed = json.loads(value)
        except json.JSONDecodeError as e:
            raise ValueError(f"must be a JSON list of names, e.g. '[\"cleveland\"]' ({e})") from e
        if not isinstance(parsed, list) or not all(isinstance(v, str) and v for v in parsed):
            raise ValueError("must be a JSON list of non-empty names, e.g. '[\"cleveland\"]'")
        return value

    @field_validator("hidden")
    @classmethod
    def _widths(cls, value: str) -> str:
        parts = value.split("-")
        if value == "none":  # no hidden layer: logistic (softmax) regression
            return value
        if not all(p.isdigit() and int(p) > 0 for p in parts):
            raise ValueError("must be positive widths joined by '-', e.g. '64-32', or 'none'")
        return value

    @model_validator(mode="before")
    @classmethod
    def _event_means_survival(cls, data: Any) -> Any:
        if isinstance(data, dict) and data.get("event") and data.get("task", "auto") == "auto":
            return {**data, "task": "survival"}
        return data

    @model_validator(mode="after")
    def _survival_fits(self) -> RunConfig:
        if self.task == "survival" and not self.event:
            raise ValueError("task=survival needs the event column: --time COLUMN --event COLUMN "
                             f"(target is the time column). Received: event={self.event!r}")
        if self.event and self.task != "survival":
            raise ValueError(f"an event column makes the task survival; drop --event or use "
                             f"--task survival. Received: task={self.task!r}, "
                             f"event={self.event!r}")
        if self.event and self.event == self.target:
            raise ValueError(f"the time and event columns must differ. Received: both "
                             f"{self.event!r}")
        if self.penalizer and self.task != "survival":
            raise ValueError(f"penalizer is the Cox model's ridge penalty (task=survival). "
                             f"Received: penalizer={self.penalizer}, task={self.task!r}")
        return self

    @model_validator(mode="after")
    def _norm_fits(self) -> RunConfig:
        if self.norm == "batch" and self.parallel.split(":", 1)[0].strip() != "none":
            raise ValueError(
                "norm=batch needs parallel=none: BatchNorm's statistics depend on the batch, so "
                "shards, micro-batches or split layers would not train the same model"
            )
        if self.norm == "batch" and self.batch_size < 2:
            raise ValueError("norm=batch needs batch-size >= 2 (BatchNorm cannot normalise one row)")
        if self.norm == "batch" and self.hidden == "none":
            raise ValueError("norm=batch adds BatchNorm after hidden layers; hidden=none has none")
        if self.local_steps and self.local_epochs != 1:
            raise ValueError(
                "local-steps and local-epochs both set the local work per round: give one "
                f"(local-steps={self.local_steps}, local-epochs={self.local_epochs})")
        return self

    @model_validator(mode="after")
    def _privacy_fits(self) -> RunConfig:
        """dp and secure-aggregation against the rest (`protocol.privacy.check_run`); whether
        the strategy can run under them is the rule's to say (`server.compose`)."""
        from fedsplit.protocol.privacy import check_run

        check_run(dp=self.dp, secure=self.secure_aggregation, attack=self.attack, norm=self.norm,
                  proximal_mu=self.proximal_mu, parallel=self.parallel)
        return self

    @property
    def params(self) -> dict[str, Any]:
        """``strategy_params`` parsed."""
        return json.loads(self.strategy_params)

    @property
    def caps(self) -> dict[str, int]:
        """``cohort_caps`` parsed."""
        return {str(k): int(v) for k, v in json.loads(self.cohort_caps).items()}

    @property
    def hidden_widths(self) -> tuple[int, ...]:
        """``hidden`` parsed (``none``: no hidden layer)."""
        return () if self.hidden == "none" else tuple(int(p) for p in self.hidden.split("-"))

    @property
    def names(self) -> list[str]:
        """``site_names`` parsed."""
        return list(json.loads(self.site_names))

    @property
    def table_settings(self) -> TableSettings:
        """How every site reads its table: target, id-column, ignore-columns, na-values."""
        return TableSettings(
            target=self.target, id_column=self.id_column,
            ignore_columns=tuple(c.strip() for c in self.ignore_columns.split(",") if c.strip()),
            na_values=tuple(v.strip() for v in self.na_values.split(",") if v.strip()),
            min_category_count=self.min_category_count, event=self.event,
        )

    @classmethod
    def from_flower(cls, run_config: Mapping[str, Any]) -> RunConfig:
        """Validate Flower's ``context.run_config``; unknown keys and bad values raise `ConfigError`."""
        try:
            return cls.model_validate(dict(run_config))
        except ValidationError as e:
            messages = [
                f"{'.'.join(str(p) for p in err['loc'])}: "
                f"{str(err['msg']).removeprefix('Value error, ')}" if err["loc"]
                else str(err["msg"]).removeprefix("Value error, ")
                for err in e.errors()
            ]
            problems = "; ".join(m.rstrip(".") for m in messages)
            known = (f" Known keys: "
                     f"{', '.join(sorted(f.alias or n for n, f in cls.model_fields.items()))}."
                     if any(err["type"] == "extra_forbidden" for err in e.errors()) else "")
            # a message that names what it received says enough; else the whole config
            received = ("" if all("Received:" in m for m in messages)
                        else f" Received: {dict(run_config)}")
            raise ConfigError(f"Invalid run configuration: {problems}.{known}{received}") from e

    @classmethod
    def resumable_keys(cls) -> frozenset[str]:
        """The run-config keys (kebab-case) of `RESUMABLE`: what a resumed run may change."""
        return frozenset(cls.model_fields[name].alias or name for name in cls.RESUMABLE)

    def to_flower(self) -> dict[str, Any]:
        """Return the kebab-case dict Flower's ``--run-config`` and pyproject expect."""
        return self.model_dump(by_alias=True)


def parse_min_count(value: Any) -> int:
    """``min-count`` (the minimum-count rule's K: a whole number >= 1) read by the one parse of it,
    `RunConfig.min_count`, for the run configs that are not a `RunConfig` (``fedsplit km`` /
    ``cox``: `protocol.survival.SurvivalRun`); a `ConfigError` naming ``min-count`` otherwise."""
    return RunConfig.from_flower({"min-count": value}).min_count
