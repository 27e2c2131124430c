"""The vertical writers build the protocol models and write the keys today's files have (issue 34,
item 2): the coordinator's ``history.json`` (`server.vertical.app.main`, run in-process over a
grid that hands each message to a `SiteAgent`), ``head.json`` and ``site.json``, and
``fedsplit vertical simulate``'s ``summary.json`` (`run_vertical`, its Flower run replaced by
the same in-process one). The reference files in ``tests/protocol/data`` were written by
``fedsplit vertical simulate --dataset breast-cancer --sites 2 --rounds 2 --steps 4
--overlap 0.8`` before the writers built the models.
"""

from __future__ import annotations

import json
from collections.abc import Iterator
from pathlib import Path
from types import SimpleNamespace
from typing import Any

import pytest
from fedsplit.client.vertical.site import SiteAgent, SiteState
from fedsplit.orchestration.vertical import experiment
from fedsplit.orchestration.vertical.experiment import VerticalInputs, run_vertical
from fedsplit.protocol.record.common import HISTORY_FILE
from fedsplit.protocol.record.kinds import load_run_record
from fedsplit.protocol.record.vertical import (
    SiteOverlap,
    VerticalRound,
    VerticalRunRecord,
    VerticalScores,
    VerticalSummary,
)
from fedsplit.protocol.vertical.config import FusionParams, VerticalConfig
from fedsplit.protocol.vertical.saved import HeadMeta, SiteModelMeta
from fedsplit.protocol.vertical.wire import from_record, to_record
from fedsplit.server.vertical.app import main
from flwr.supercore.task_identity import TaskIdentity

DATA = Path(__file__).parents[1] / "protocol" / "data"
PARAMS = FusionParams(steps_per_round=4)


def reference(name: str) -> Any:
    return json.loads((DATA / name).read_text())


def keys(value: Any) -> Any:
    """The key structure of parsed JSON: every object's keys, every list element's, no values."""
    if isinstance(value, dict):
        return {k: keys(v) for k, v in value.items()}
    if isinstance(value, list):
        return [keys(v) for v in value if isinstance(v, dict | list)]
    return None


class SiteGrid:
    """Flower's Grid as the vertical ServerApp uses it, each message answered in-process by the
    node's `SiteAgent` (what the vertical ClientApp does)."""

    def __init__(self, agents: dict[int, SiteAgent]) -> None:
        self.agents = agents
        self.states: dict[int, SiteState] = {}

    def get_node_ids(self) -> list[int]:
        return list(self.agents)

    def send_and_receive(self, messages: list[Any], timeout: float) -> Iterator[Any]:
        for msg in messages:
            node = msg.metadata.dst_node_id
            reply = self.agents[node].handle(msg.metadata.message_type, from_record(msg.content),
                                             self.states.setdefault(node, SiteState()))
            yield SimpleNamespace(has_error=lambda: False, content=to_record(reply),
                                  metadata=SimpleNamespace(src_node_id=node))


def in_process(cfg: VerticalConfig, num_sites: int) -> VerticalRunRecord:
    """What `experiment.run_flower` returns, with the ServerApp run in this process."""
    files, outs = json.loads(cfg.site_files), json.loads(cfg.site_out_dirs)
    agents = {10 + i: SiteAgent(files[i], cfg.id_column, f"site-{i}", outs[i])
              for i in range(num_sites)}
    main(SiteGrid(agents), SimpleNamespace(run_config=cfg.to_flower()))  # type: ignore[arg-type]
    return VerticalRunRecord.load(Path(cfg.out_dir) / HISTORY_FILE)


@pytest.fixture
def run(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> tuple[Path, VerticalSummary]:
    from fedsplit.orchestration.vertical.datasets import write_bundled

    files = write_bundled("breast-cancer", 2, tmp_path / "data", overlap=0.8, seed=0)
    for name in ("_run_id", "_node_id", "_task_id"):  # Flower builds Messages only inside an app
        monkeypatch.setattr(TaskIdentity, name, 1)
    monkeypatch.setattr(experiment, "run_flower",
                        lambda cfg, n, work, timeout=3600: in_process(cfg, n))
    out = tmp_path / "run"
    summary = run_vertical(VerticalInputs(files.sites, files.labels, files.id_column, files.target),
                           PARAMS, out, rounds=2, dataset="breast-cancer")
    return out, summary


def test_the_coordinator_writes_a_typed_history_with_todays_keys(run: tuple[Path, VerticalSummary]) -> None:
    out, _ = run
    path = out / "federation" / HISTORY_FILE
    record = load_run_record(path)
    assert isinstance(record, VerticalRunRecord) and record.status == "finished"
    assert record.overlap is not None and all(isinstance(o, SiteOverlap) for o in record.overlap)
    assert all(isinstance(r, VerticalRound) and r.complete_rows for r in record.rounds)
    written, old = json.loads(path.read_text()), reference("vertical-simulate-history-v1.json")
    assert keys(written) == keys(old)


def test_the_saved_models_meta_files_have_todays_keys(run: tuple[Path, VerticalSummary]) -> None:
    out, _ = run
    head = out / "federation" / "head" / "head.json"
    assert keys(json.loads(head.read_text())) == keys(reference("vertical-simulate-head-v1.json"))
    assert HeadMeta.load(head).sites == ["site-0", "site-1"]
    site = out / "sites" / "site-0" / "site.json"
    assert keys(json.loads(site.read_text())) == keys(reference("vertical-simulate-site-v1.json"))
    assert SiteModelMeta.load(site).branch.embedding_dim == PARAMS.embedding_dim


def test_simulate_writes_a_typed_summary_with_todays_keys(run: tuple[Path, VerticalSummary]) -> None:
    out, summary = run
    assert isinstance(summary.federated, VerticalScores)
    assert VerticalSummary.load(out / "summary.json") == summary
    written, old = json.loads((out / "summary.json").read_text()), reference(
        "vertical-simulate-summary-v1.json")
    assert keys(written) == keys(old)
    assert (out / "rounds.png").stat().st_size > 0
