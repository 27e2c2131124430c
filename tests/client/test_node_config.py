"""A hospital's node config is read into one model (client/node_config.py)."""

from __future__ import annotations

from pathlib import Path

import pytest
from fedsplit.client.node_config import NodeConfig
from fedsplit.protocol.errors import ConfigError


def test_flower_node_configs_read_into_the_model() -> None:
    agent = NodeConfig.from_flower({"data-path": "/data/north.csv", "site-name": "north",
                                    "policy": "/etc/policy.toml", "state-dir": "/var/state",
                                    "coordinator": "link:9092", "recipe": "pkg.mod:R",
                                    "recipe-params": '{"width": 4}'})
    assert (agent.data_path, agent.site_name, agent.policy, agent.state_dir, agent.coordinator,
            agent.recipe, agent.recipe_params) == ("/data/north.csv", "north", "/etc/policy.toml",
                                                   "/var/state", "link:9092", "pkg.mod:R",
                                                   '{"width": 4}')
    assert not agent.simulated and agent.name(7) == "north"
    assert agent.given["data-path"] == "/data/north.csv" and "out-dir" not in agent.given
    simulated = NodeConfig.from_flower({"partition-id": 1, "num-partitions": 3})  # Flower's engine
    assert simulated.simulated
    assert simulated.name(7, ["east", "west"]) == "west" and simulated.name(7) == "site-1"
    assert simulated.partition_folder("/runs/sites") == Path("/runs/sites/site-1")
    assert simulated.partition_folder("") is None and agent.partition_folder("/runs") is None
    assert NodeConfig().name(7) == "node-7"


def test_an_unknown_key_or_a_bad_value_names_it_and_the_known_keys() -> None:
    with pytest.raises(ConfigError, match=r"data_path: Extra inputs are not permitted.*Known keys: "
                                          r"data-path, site-name, partition-id"):
        NodeConfig.from_flower({"data_path": "/data/north.csv"})
    with pytest.raises(ConfigError, match=r"partition-id: Input should be greater than or equal "
                                          r"to 0.*Received: \{'partition-id': -1\}"):
        NodeConfig.from_flower({"partition-id": -1})
