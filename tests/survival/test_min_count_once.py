"""``min-count`` is parsed once, with the rest of the run config (`protocol.config.RunConfig`), and
the survival summary after training reads that parsed value, never Flower's raw run config
(issue 34, item 7)."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import pytest
from fedsplit.protocol.config import RunConfig
from fedsplit.protocol.errors import ConfigError
from fedsplit.server.survival import summary as summary_mod


class _Stop(Exception):
    """Raised by the stubbed km exchange: the summary got as far as the minimum-count rule."""


def test_run_config_parses_min_count_and_refuses_what_the_rule_cannot_use() -> None:
    assert RunConfig.from_flower({}).min_count == 5
    assert RunConfig.from_flower({"min-count": 3}).min_count == 3
    for bad in (0, -2, 2.5, "many"):
        with pytest.raises(ConfigError, match="min-count"):
            RunConfig.from_flower({"min-count": bad})


def test_the_survival_summary_uses_the_parsed_min_count(tmp_path: Path,
                                                        monkeypatch: pytest.MonkeyPatch) -> None:
    (tmp_path / summary_mod.MODEL_FILE).write_bytes(b"not read: the weights reader is stubbed")
    seen: dict[str, Any] = {}

    class Weights:
        model = "recipe-id"

    def fake_pooled_km(coord: Any, min_count: int, inputs: Any = None) -> Any:
        seen["min_count"] = min_count
        raise _Stop

    monkeypatch.setattr(summary_mod.ss, "file_sha256", lambda path: "digest")
    monkeypatch.setattr(summary_mod, "read_weights", lambda path: Weights())
    monkeypatch.setattr(summary_mod, "read_schema", lambda path: "{}")
    monkeypatch.setattr(summary_mod, "uses_newton", lambda cfg, model: False)
    monkeypatch.setattr(summary_mod, "wait_for_nodes", lambda grid, n, timeout: [1, 2])
    monkeypatch.setattr(summary_mod, "Coordinator", lambda grid, nodes, cfg: object())
    monkeypatch.setattr(summary_mod, "pooled_km", fake_pooled_km)
    cfg = RunConfig.from_flower({"out-dir": str(tmp_path), "min-count": 3})
    # Flower's raw config disagrees (and is malformed): only the parsed value counts
    with pytest.raises(_Stop):
        summary_mod.run_summary(grid=None, cfg=cfg, run_config={"min-count": "garbage"})
    assert seen["min_count"] == 3
    with pytest.raises(_Stop):
        summary_mod.run_summary(None, RunConfig.from_flower({"out-dir": str(tmp_path)}))
    assert seen["min_count"] == 5
