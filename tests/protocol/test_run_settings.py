"""The run configs are composed of groups defined once (protocol/run_settings.py); the wire form
stays Flower's flat run config, and saved configs stay readable."""

from __future__ import annotations

import json

import pytest
from fedsplit.protocol import run_settings as rs
from fedsplit.protocol.config import RunConfig
from fedsplit.protocol.errors import ConfigError
from fedsplit.protocol.survival import SurvivalRun
from fedsplit.protocol.vertical.config import VerticalConfig

GROUPS = [g for g in vars(rs).values()
          if isinstance(g, type) and issubclass(g, rs.Group) and g is not rs.Group]


def keys(model: type) -> set[str]:
    return {f.alias or name for name, f in model.model_fields.items()}


def test_each_setting_is_defined_by_one_group_and_the_run_kinds_share_them() -> None:
    owners: dict[str, set[str]] = {}
    for group in GROUPS:
        own = keys(group) - set().union(*(keys(b) for b in group.__bases__ if b is not rs.Group))
        for key in own:
            owners.setdefault(key, set()).add(group.__name__)
    assert {k: v for k, v in owners.items() if len(v) > 1} == {}
    # a horizontal run's config is its groups' fields, nothing of its own
    assert keys(RunConfig) == set().union(*(keys(g) for g in RunConfig.__mro__
                                             if isinstance(g, type) and g in GROUPS))
    assert len(keys(RunConfig)) == 51
    for model, shared in ((SurvivalRun, (rs.FederationSettings, rs.TableReading,
                                         rs.SecureSettings)),
                          (VerticalConfig, (rs.FederationSettings, rs.RoundSettings))):
        for group in shared:
            assert issubclass(model, group) and issubclass(RunConfig, group), (model, group)
    assert len(keys(SurvivalRun) - set().union(*(keys(g) for g in (
        rs.FederationSettings, rs.TableReading, rs.SecureSettings)))) == 5  # its own columns and fit


def test_the_wire_form_is_flat_and_reads_back() -> None:
    cfg = RunConfig(target="diagnosis", na_values=["chol=0", "?"], ignore_columns="note, x",
                    site_names=["east", "west"], secure_aggregation="on")
    flat = cfg.to_flower()
    assert all(not isinstance(v, dict | list | tuple) for v in flat.values())  # a ConfigRecord's
    assert flat["na-values"] == "chol=0,?" and flat["ignore-columns"] == "note, x"
    assert json.loads(flat["site-names"]) == ["east", "west"]
    again = RunConfig.from_flower(flat)
    assert again == cfg and again.table_settings.ignore_columns == ("note", "x")
    assert again.names == ["east", "west"]


def test_a_survival_config_saved_with_json_column_lists_still_reads() -> None:
    """km / cox runs wrote ignore-columns and na-values as JSON lists (and no
    min-category-count): read back, they are the comma lists every run kind now writes."""
    saved = {"mode": "cox", "time": "T", "event": "E", "out-dir": "/runs/cox", "data-dir": "",
             "id-column": "pid", "ignore-columns": '["age", "stage"]', "na-values": '["NA"]',
             "penalizer": 0.01, "secure-aggregation": "", "min-count": 5,
             "site-names": '["a", "b"]', "min-nodes": 2, "round-timeout": 300.0, "max-rounds": 15}
    run = SurvivalRun.from_flower(saved)
    assert (run.ignored, run.missing_markers, run.names) == (("age", "stage"), ("NA",), ["a", "b"])
    assert run.table_settings.ignore_columns == ("E", "age", "stage")
    assert SurvivalRun.from_flower(run.to_flower()) == run
    assert SurvivalRun(mode="km", time="t", event="e", secure_aggregation="none").secure_aggregation == ""
    with pytest.raises(ConfigError, match=r"Not a fedsplit survival run config: max-rounds: "):
        SurvivalRun.from_flower({**saved, "max-rounds": 0})
