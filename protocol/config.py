"""The run configuration the coordinator and every hospital agent read.

Flower delivers it as ``context.run_config`` (``[tool.flwr.app.config]`` plus ``flwr run
--run-config`` overrides); keys are kebab-case. One pydantic model validates it for both sides,
so a typo or an out-of-range value fails at start with a message that names the key. Its fields
come in groups (data, model, training, aggregation, server optimizer, privacy, federation, ...)
defined once in `protocol.run_settings` and shared with the survival and vertical run configs.
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any, ClassVar

from fedsplit.protocol.errors import ConfigError
from fedsplit.protocol.roster import read_roster
from fedsplit.protocol.run_settings import (
    AggregationSettings,
    DataSettings,
    FederationSettings,
    ModelSettings,
    PrivacySettings,
    RoundSettings,
    ServerOptimizerSettings,
    SimulationSettings,
    StartSettings,
    TrainingSettings,
    problems,
)
from fedsplit.protocol.schema import TableSettings
from fedsplit.protocol.tasks import LabelEncoding, declared, inferred_kind, label_encoding
from pydantic import ValidationError, model_validator


# the groups' fields come in the reverse order of the bases: the rounds first (dp reads them)
class RunConfig(SimulationSettings, ServerOptimizerSettings, AggregationSettings, TrainingSettings,
                ModelSettings, PrivacySettings, DataSettings, StartSettings, FederationSettings,
                RoundSettings):
    """Every knob of a horizontal federation: the groups of `protocol.run_settings`, each field
    documented once there, and the rules that tie fields of different groups together."""

    #: The fields a resumed run (same out-dir) may change (`server.history.find_resume_point`):
    #: none of them alters a trained round. ``min_count`` acts only on the survival summary after
    #: the last round, so a run whose summary published too little ("Lower min-count") is rerun
    #: with a lower one and only the summary is redone. ``site_roster`` is only where the names
    #: and fingerprints are kept: the coordinator compares them inline (`with_roster`).
    #: `resumable_keys` gives their run-config keys.
    RESUMABLE: ClassVar[tuple[str, ...]] = ("num_server_rounds", "round_timeout", "resume",
                                            "quorum", "min_nodes", "device", "keep", "min_count",
                                            "site_roster")

    @model_validator(mode="before")
    @classmethod
    def _event_means_survival(cls, data: Any) -> Any:
        if isinstance(data, dict) and data.get("event") and data.get("task", "auto") == "auto":
            return {**data, "task": inferred_kind(LabelEncoding.TIME_EVENT).name}
        return data

    @model_validator(mode="after")
    def _survival_fits(self) -> RunConfig:
        time_event = label_encoding(self.task) is LabelEncoding.TIME_EVENT
        if time_event and not self.event:
            raise ValueError(f"task={self.task} needs the event column: --time COLUMN --event "
                             f"COLUMN (target is the time column). Received: event={self.event!r}")
        if self.event and not time_event:
            raise ValueError(f"an event column makes the task survival; drop --event or use "
                             f"--task survival. Received: task={self.task!r}, "
                             f"event={self.event!r}")
        if self.event and self.event == self.target:
            raise ValueError(f"the time and event columns must differ. Received: both "
                             f"{self.event!r}")
        kind = declared(self.task)
        if self.penalizer and (kind is None or "penalizer" not in kind.recipe_settings):
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
    def table_settings(self) -> TableSettings:
        """How every site reads its table: target, id-column, ignore-columns, na-values."""
        return TableSettings(
            target=self.target, id_column=self.id_column,
            ignore_columns=self.ignored, na_values=self.missing_markers,
            min_category_count=self.min_category_count, event=self.event,
        )

    @classmethod
    def from_flower(cls, run_config: Mapping[str, Any]) -> RunConfig:
        """Validate Flower's ``context.run_config``; unknown keys and bad values raise `ConfigError`."""
        try:
            return cls.model_validate(dict(run_config))
        except ValidationError as e:
            known = (f" Known keys: "
                     f"{', '.join(sorted(f.alias or n for n, f in cls.model_fields.items()))}."
                     if any(err["type"] == "extra_forbidden" for err in e.errors()) else "")
            # a message that names what it received says enough; else the whole config
            received = ("" if all("Received:" in str(err["msg"]) for err in e.errors())
                        else f" Received: {dict(run_config)}")
            raise ConfigError(f"Invalid run configuration: {problems(cls, e)}.{known}{received}"
                              ) from e

    @classmethod
    def resumable_keys(cls) -> frozenset[str]:
        """The run-config keys (kebab-case) of `RESUMABLE`: what a resumed run may change."""
        return frozenset(cls.model_fields[name].alias or name for name in cls.RESUMABLE)

    def with_roster(self) -> RunConfig:
        """This config with its roster's site names and data fingerprint inline, as the
        coordinator records and compares a run (`protocol.roster`); itself without a roster."""
        if not self.site_roster:
            return self
        roster = read_roster(self.site_roster)
        return self.model_copy(update={"site_names": roster.names_value(),
                                       "data_fingerprint": roster.fingerprint_value()})

    def to_flower(self) -> dict[str, Any]:
        """Return the kebab-case dict Flower's ``--run-config`` and pyproject expect."""
        return self.model_dump(by_alias=True)
