"""Run configuration of the vertical Flower app (coordinator and feature sites read it)."""

from __future__ import annotations

import json
from collections.abc import Mapping
from typing import Any, Literal

from pydantic import BaseModel, ConfigDict, Field, ValidationError

from protocol.errors import ConfigError


class VerticalConfig(BaseModel):
    """Every knob of a vertical federation; kebab-case keys in ``[tool.flwr.app.config]``."""

    model_config = ConfigDict(populate_by_name=True, extra="forbid", frozen=True)

    num_server_rounds: int = Field(10, ge=1, alias="num-server-rounds", description="Flower rounds.")
    strategy_params: str = Field("{}", alias="strategy-params",
                                 description="vertical-fusion parameters as a JSON object string.")
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
    out_dir: str = Field("fedsplit-vertical", alias="out-dir",
                         description="Where the coordinator writes history.json and the head.")
    min_nodes: int = Field(2, ge=1, alias="min-nodes")
    round_timeout: float = Field(600.0, gt=0, alias="round-timeout")

    @property
    def params(self) -> dict[str, Any]:
        """``strategy_params`` parsed."""
        return dict(json.loads(self.strategy_params))

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
            problems = "; ".join(f"{'.'.join(str(p) for p in err['loc'])}: {err['msg']}"
                                 for err in e.errors())
            raise ConfigError(f"Invalid vertical run configuration: {problems}. "
                              f"Received: {dict(run_config)}") from e

    def to_flower(self) -> dict[str, Any]:
        """Kebab-case dict for the staged app's pyproject."""
        return self.model_dump(by_alias=True)
