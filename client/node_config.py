"""`NodeConfig`: what a hospital's SuperNode says about itself, read once per message.

Flower hands every ClientApp handler ``context.node_config``: the ``--node-config`` a hospital's
agent starts its SuperNode with (``fedsplit site run``: ``data-path``, ``site-name``, its own
``recipe``, ``policy``, ``state-dir``, ``coordinator``), or, in Flower's simulation engine, the
``partition-id`` and ``num-partitions`` of a simulated hospital. Each ClientApp (horizontal,
survival, vertical) reads it into this model where a message comes in and passes the model on;
no other code reads a node-config key.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from pathlib import Path
from typing import Any

from fedsplit.protocol.errors import ConfigError
from fedsplit.protocol.run_settings import Group, problems
from fedsplit.protocol.site_policy import NODE_COORDINATOR, NODE_POLICY, NODE_STATE_DIR
from pydantic import Field, ValidationError


class NodeConfig(Group):
    """One hospital's node config (kebab-case keys, as given to ``--node-config``)."""

    data_path: str = Field("", alias="data-path",
                           description="This hospital's data: a file, or a folder holding one.")
    site_name: str = Field("", alias="site-name", description="The hospital's name in reports.")
    partition_id: int | None = Field(None, ge=0, alias="partition-id",
                                     description="Flower's simulation engine: this node's partition.")
    num_partitions: int | None = Field(None, ge=1, alias="num-partitions",
                                       description="Flower's simulation engine: how many partitions.")
    recipe: str = Field("", description="The hospital's own recipe (it takes precedence over the run's).")
    recipe_params: str = Field("", alias="recipe-params", description="Its own recipe's parameters.")
    policy: str = Field("", alias=NODE_POLICY, description="The hospital's policy file (TOML).")
    state_dir: str = Field("", alias=NODE_STATE_DIR,
                           description="Where it keeps its privacy ledger and egress log.")
    coordinator: str = Field("", alias=NODE_COORDINATOR,
                             description="The SuperLink it serves, for its egress log.")
    out_dir: str = Field("", alias="out-dir", description="Vertical: where this site saves its branch.")

    @classmethod
    def from_flower(cls, node_config: Mapping[str, Any]) -> NodeConfig:
        """Read Flower's ``context.node_config``; an unknown key or a bad value is a
        `ConfigError` naming it and the known keys."""
        try:
            return cls.model_validate(dict(node_config), by_alias=True, by_name=False)
        except ValidationError as e:
            known = ", ".join(f.alias or n for n, f in cls.model_fields.items())
            raise ConfigError(f"Invalid node config: {problems(cls, e)}. Known keys: {known}. "
                              f"Received: {dict(node_config)}") from e

    @property
    def given(self) -> dict[str, Any]:
        """The keys the node config set (kebab-case), for a message's ``Received:``."""
        return self.model_dump(by_alias=True, exclude_unset=True)

    def name(self, node_id: int, names: Sequence[str] = ()) -> str:
        """The hospital's name for reports: ``site-name``, else ``names[partition-id]`` (the
        run's ``site-names``), else ``site-<partition-id>``, else ``node-<node_id>``."""
        if self.site_name:
            return self.site_name
        if self.partition_id is not None:
            pid = self.partition_id
            return str(names[pid]) if pid < len(names) else f"site-{pid}"
        return f"node-{node_id}"

    @property
    def simulated(self) -> bool:
        """A partition of Flower's simulation engine, without a data path of its own."""
        return self.partition_id is not None and not self.data_path

    def partition_folder(self, data_dir: str) -> Path | None:
        """``DATA_DIR/site-<partition-id>/`` of a partition, when the run names a data dir."""
        if self.partition_id is None or not data_dir:
            return None
        return Path(data_dir) / f"site-{self.partition_id}"
