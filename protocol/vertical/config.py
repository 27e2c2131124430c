"""Run configuration of the vertical Flower app, and the split-training parameters.

`VerticalConfig` is what the coordinator and the feature sites read from Flower's run config;
its ``fusion-params`` key carries a `FusionParams` as a JSON object string.
"""

from __future__ import annotations

import json
from collections.abc import Mapping
from typing import Any, Literal

from fedsplit.protocol.errors import ConfigError
from fedsplit.protocol.run_settings import FederationSettings, RoundSettings
from pydantic import BaseModel, ConfigDict, Field, ValidationError

Fill = Literal["nearest", "mean", "zero", "drop"]


def _problems(e: ValidationError) -> str:
    return "; ".join(f"{'.'.join(str(p) for p in err['loc'])}: {err['msg']}" for err in e.errors())


class FusionParams(BaseModel):
    """Split-training knobs; every site's branch and the head use the same optimiser settings."""

    model_config = ConfigDict(extra="forbid", frozen=True)

    embedding_dim: int = Field(16, ge=1, le=4096, description="Width of each site's embedding.")
    branch_hidden: int = Field(0, ge=0, le=4096,
                               description="Hidden width inside each branch (0 = one layer).")
    head_hidden: int = Field(16, ge=0, le=4096,
                             description="Hidden width of the head (0 = linear head).")
    lr: float = Field(0.01, gt=0, le=1, description="Adam learning rate of head and branches.")
    batch_size: int = Field(64, ge=1, le=1_000_000, description="Aligned rows per step.")
    steps_per_round: int = Field(20, ge=1, le=100_000, description="Mini-batch steps per Flower round.")
    fill: Fill = Field("nearest", description="Missing views: nearest (borrow the closest linked "
                                              "patient's row), mean, zero or drop.")
    min_overlap: float = Field(0.2, ge=0, le=1, description="Refuse when a site shares fewer than "
                                                             "this share of the label holder's IDs.")

    @classmethod
    def parse(cls, values: Mapping[str, Any]) -> FusionParams:
        """Validate ``values``; unknown keys and out-of-range values raise `ConfigError`."""
        try:
            return cls.model_validate(dict(values))
        except ValidationError as e:
            raise ConfigError(
                f"Invalid vertical fusion parameters: {_problems(e)}. Known: "
                f"{', '.join(cls.model_fields)}. Received: {dict(values)}"
            ) from e


class VerticalConfig(FederationSettings, RoundSettings):
    """Every knob of a vertical federation; kebab-case keys in ``[tool.flwr.app.config]``: the
    shared rounds and federation groups (`protocol.run_settings`) and the split training's own."""

    fusion_params: str = Field("{}", alias="fusion-params",
                               description="`FusionParams` as a JSON object string.")
    id_column: str = Field("id", alias="id-column", description="ID column in every file.")
    target: str = Field("target", description="Target column in the label file.")
    labels_path: str = Field("", alias="labels-path", description="The label holder's file.")
    task: Literal["auto", "classification", "regression"] = Field("auto")
    site_files: str = Field("[]", alias="site-files",
                            description="Simulation: JSON list, node i reads entry i (node config "
                                        "'data-path' takes precedence).")
    site_out_dirs: str = Field("[]", alias="site-out-dirs",
                               description="Simulation: JSON list of where node i saves its branch "
                                           "(node config 'out-dir' takes precedence).")
    seed: int = Field(0)
    test_fraction: float = Field(0.2, ge=0.05, le=0.9, alias="test-fraction")

    @property
    def params(self) -> FusionParams:
        """``fusion_params`` parsed and validated."""
        try:
            values = json.loads(self.fusion_params)
        except json.JSONDecodeError as e:
            raise ConfigError(f"fusion-params must be a JSON object string ({e}). "
                              f"Received: {self.fusion_params!r}") from e
        if not isinstance(values, dict):
            raise ConfigError(f"fusion-params must be a JSON object string. Received: {self.fusion_params!r}")
        return FusionParams.parse(values)

    def site_entry(self, key: str, index: int) -> str:
        """Entry ``index`` of the JSON list ``site_files`` or ``site_out_dirs``."""
        values = json.loads(self.site_files if key == "site-files" else self.site_out_dirs)
        return str(values[index]) if 0 <= index < len(values) else ""

    @classmethod
    def from_flower(cls, run_config: Mapping[str, Any]) -> VerticalConfig:
        """Validate Flower's ``context.run_config``."""
        try:
            return cls.model_validate(dict(run_config))
        except ValidationError as e:
            raise ConfigError(f"Invalid vertical run configuration: {_problems(e)}. "
                              f"Received: {dict(run_config)}") from e

    def to_flower(self) -> dict[str, Any]:
        """Kebab-case dict for the staged app's pyproject."""
        return self.model_dump(by_alias=True)
