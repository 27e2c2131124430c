"""Set-up in as few exchanges as the data allows (issue 32): ``query.setup`` carries the column
report and the statistics under each hospital's own schema; ``query.stats`` goes again only to
hospitals whose own schema is not the agreed one; the model set-up is the same either way.

The real hospital agent (`client.app`) answers in-process through a scripted Flower Grid.
"""

from __future__ import annotations

import json
from pathlib import Path

import numpy as np
import pandas as pd
import pytest
from fedsplit.client.app import app
from fedsplit.client.data import load_bundled
from fedsplit.protocol import RunConfig
from fedsplit.protocol import horizontal_wire as wire
from fedsplit.server import setup as coordinator_setup
from fedsplit.server.setup import prepare_model
from flwr.app import Context, Message, RecordDict
from flwr.supercore.task_identity import TaskIdentity


@pytest.fixture(autouse=True)
def task_identity():
    """Flower refuses to build Messages outside a running app unless this is set."""
    TaskIdentity.run_id, TaskIdentity.node_id, TaskIdentity.task_id = 1, 0, 1
    yield


class Agents:
    """A Flower Grid whose nodes run fedsplit's ClientApp in this process."""

    def __init__(self, files: dict[int, Path], cfg: RunConfig) -> None:
        self.contexts = {n: Context(run_id=1, node_id=n, node_config={
            "data-path": str(path), "site-name": f"h{n}"}, state=RecordDict(),
            run_config=cfg.to_flower()) for n, path in files.items()}
        self.exchanges: list[tuple[str, list[int]]] = []

    def get_node_ids(self) -> list[int]:
        return sorted(self.contexts)

    def send_and_receive(self, messages, *, timeout=None) -> list[Message]:
        messages = list(messages)
        self.exchanges.append((messages[0].metadata.message_type,
                               sorted(m.metadata.dst_node_id for m in messages)))
        return [app(m, self.contexts[m.metadata.dst_node_id]) for m in messages]


def hospitals(tmp_path: Path, wards: dict[int, list[str]] | None = None) -> dict[int, Path]:
    """Three breast-cancer hospitals (90 rows each); ``wards``: a text column per hospital."""
    data = load_bundled("breast-cancer")
    files = {}
    for n in (1, 2, 3):
        rows = slice((n - 1) * 90, n * 90)
        frame = pd.DataFrame(data.x[rows], columns=data.feature_names)
        if wards is not None:
            frame["ward"] = [wards[n][i % len(wards[n])] for i in range(90)]
        frame["diagnosis"] = data.y[rows]
        files[n] = tmp_path / f"h{n}.csv"
        frame.to_csv(files[n], index=False)
    return files


def setup_arrays(grid: Agents, cfg: RunConfig) -> dict[str, np.ndarray]:
    made = prepare_model(grid, grid.get_node_ids(), cfg)
    return {k: a.numpy() for k, a in made.arrays.items()}


def test_agreeing_hospitals_set_up_in_two_exchanges(tmp_path: Path, monkeypatch) -> None:
    cfg = RunConfig(target="diagnosis", min_nodes=3)
    grid = Agents(hospitals(tmp_path), cfg)
    arrays = setup_arrays(grid, cfg)
    assert [kind for kind, _ in grid.exchanges] == [wire.SETUP_QUERY, wire.INIT]
    # the same model as when every hospital is asked for its stats under the agreed schema
    monkeypatch.setattr(coordinator_setup.wire, "parse_setup_reply", lambda msg: wire.SetupReply(
        wire.parse_schema_reply(_as_schema_reply(msg)), None))
    again = Agents(hospitals(tmp_path), cfg)
    reference = setup_arrays(again, cfg)
    assert [kind for kind, _ in again.exchanges] == [wire.SETUP_QUERY, wire.STATS, wire.INIT]
    assert arrays.keys() == reference.keys()
    for name in arrays:
        np.testing.assert_array_equal(arrays[name], reference[name])


def test_only_hospitals_whose_own_schema_differs_are_asked_again(tmp_path: Path) -> None:
    """h3 has a ward the others lack: the agreed schema is h3's own, so only h1 and h2 send
    their statistics again, encoded with the agreed one-hot columns."""
    cfg = RunConfig(target="diagnosis", min_nodes=3)
    grid = Agents(hospitals(tmp_path, {1: ["a", "b"], 2: ["a", "b"], 3: ["a", "b", "c"]}), cfg)
    made = prepare_model(grid, grid.get_node_ids(), cfg)
    assert grid.exchanges == [(wire.SETUP_QUERY, [1, 2, 3]), (wire.STATS, [1, 2]),
                              (wire.INIT, [1, 2, 3])]
    features = [c["name"] for c in json.loads(made.schema)["columns"]]
    assert "ward" in features


def _as_schema_reply(msg: Message) -> Message:
    """A query.setup reply reduced to its column report (as a query.schema reply)."""
    content = RecordDict({wire.COLUMNS: msg.content.config_records[wire.COLUMNS]})
    return Message(content, reply_to=Message(RecordDict({}), dst_node_id=msg.metadata.src_node_id,
                                             message_type=wire.SCHEMA_QUERY))
