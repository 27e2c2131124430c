"""Vertical training in one process: the same coordinator and site code, direct calls for messages.

Used for the baselines of ``fedsplit vertical simulate`` (each site alone, centralized: trained
to the federation's steps, stopped at the round a validation cut of their training rows picks),
for
``fedsplit vertical compare-fills`` and by the tests. `LocalTransport` still converts every
payload to Flower records and back and checks it against `protocol.vertical.wire.ALLOWED`,
so what is exchanged is exactly what the Flower app exchanges.
"""

from __future__ import annotations

import tempfile
from collections.abc import Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import numpy as np
from fedsplit.client.vertical.site import SiteAgent, SiteState
from fedsplit.orchestration.selection import BestRound, selection_metric
from fedsplit.protocol.vertical.config import FusionParams
from fedsplit.protocol.vertical.table import id_column_values, read_frame
from fedsplit.protocol.vertical.wire import Payload, check_payload, from_record, to_record
from fedsplit.server.vertical.coordinator import LabelTable, VerticalCoordinator, split_rows

#: Share of a baseline's training rows cut off to choose how many rounds it keeps.
BASELINE_VAL_FRACTION = 0.2


@dataclass
class LocalTransport:
    """Delivers payloads to in-process `SiteAgent`s; optionally keeps every record sent."""

    agents: dict[int, SiteAgent]
    keep: bool = False
    states: dict[int, SiteState] = field(default_factory=dict)
    log: list[tuple[str, str, int, Any]] = field(default_factory=list)

    def __call__(self, message_type: str, payloads: dict[int, Payload]) -> dict[int, Payload]:
        out = {}
        for node, payload in payloads.items():
            check_payload(message_type, payload, reply=False)
            record = to_record(payload)
            reply = self.agents[node].handle(message_type, from_record(record),
                                             self.states.setdefault(node, SiteState()))
            reply_record = to_record(reply)
            if self.keep:
                self.log.append((message_type, "to-site", node, record))
                self.log.append((message_type, "from-site", node, reply_record))
            out[node] = from_record(reply_record)
        return out


def local_coordinator(labels: LabelTable, site_files: Sequence[str | Path], id_column: str,
                      params: FusionParams, *, seed: int = 0, test_fraction: float = 0.2,
                      keep: bool = False, out_dirs: Sequence[str] = ()) -> tuple[VerticalCoordinator,
                                                                                 LocalTransport]:
    """A coordinator over in-process sites ``site_files`` (node ids 0..K-1, names site-i)."""
    agents = {i: SiteAgent(str(p), id_column, f"site-{i}", out_dirs[i] if out_dirs else "")
              for i, p in enumerate(site_files)}
    transport = LocalTransport(agents, keep=keep)
    coordinator = VerticalCoordinator(labels, params, list(agents), transport, seed=seed,
                                      test_fraction=test_fraction)
    return coordinator, transport


def train_local(labels: LabelTable, site_files: Sequence[str | Path], id_column: str,
                params: FusionParams, rounds: int, *, seed: int = 0,
                test_fraction: float = 0.2) -> dict[str, Any]:
    """Align, prepare, train ``rounds`` rounds and evaluate; return the final evaluation."""
    coordinator, _ = local_coordinator(labels, site_files, id_column, params, seed=seed,
                                       test_fraction=test_fraction)
    coordinator.align()
    coordinator.prepare()
    per_round = []
    for _ in range(rounds):
        coordinator.train_round()
        per_round.append(coordinator.evaluate()["metrics"])
    final = coordinator.evaluate()
    final["train_rows"] = len(coordinator.train_rows)
    final["per_round"] = per_round
    return final


def joined_table(site_files: Sequence[str | Path], id_column: str, folder: Path) -> Path:
    """All sites' columns joined on the ID (patients every site holds): the centralized table."""
    frames = []
    for i, path in enumerate(site_files):
        frame = read_frame(path)
        frame[id_column] = id_column_values(frame, id_column, path)
        frames.append(frame.rename(columns={c: f"s{i}:{c}" for c in frame.columns if c != id_column}))
    joined = frames[0]
    for frame in frames[1:]:
        joined = joined.merge(frame, on=id_column, how="inner")
    folder.mkdir(parents=True, exist_ok=True)
    path = folder / "centralized.csv"
    joined.to_csv(path, index=False)
    return path


def validation_cut(train_rows: np.ndarray, seed: int,
                   val_fraction: float = BASELINE_VAL_FRACTION) -> tuple[np.ndarray, np.ndarray]:
    """(rows to train on, validation rows): a seeded ``val_fraction`` of ``train_rows``."""
    keep, val = split_rows(len(train_rows), val_fraction, seed + 7)
    return train_rows[keep], train_rows[val]


def best_round(labels: LabelTable, site_files: Sequence[str | Path], id_column: str,
               params: FusionParams, rounds: int, *, seed: int = 0, test_fraction: float = 0.2,
               val_fraction: float = BASELINE_VAL_FRACTION) -> dict[str, Any]:
    """Train on the training rows minus a validation cut; the round that scores best on it.

    The cut is ``val_fraction`` of the training rows (a seeded draw; never held-out rows). The
    score is the task's metric (accuracy, or r2: the squared error), ties going to the later
    round (`orchestration.selection`, the horizontal baselines' rule). Returns ``round``
    (1-based), ``val_metric`` per round and ``val_rows``.
    """
    coordinator, _ = local_coordinator(labels, site_files, id_column, params, seed=seed,
                                       test_fraction=test_fraction)
    coordinator.align()
    coordinator.prepare()
    keep, val_rows = validation_cut(coordinator.train_rows, seed, val_fraction)
    if len(keep) < 2:
        return {"round": rounds, "val_metric": [], "val_rows": 0}  # too few rows to cut: all rounds
    coordinator.train_rows = keep
    key = selection_metric(labels.task)
    picker = BestRound()
    for _ in range(rounds):
        coordinator.train_round()
        picker.offer(coordinator.evaluate(val_rows)["metrics"][key])
    return {"round": picker.round, "val_metric": picker.scores, "val_rows": len(val_rows)}


def train_baseline(labels: LabelTable, site_files: Sequence[str | Path], id_column: str,
                   params: FusionParams, rounds: int, *, seed: int = 0,
                   test_fraction: float = 0.2) -> dict[str, Any]:
    """A baseline trained to the federation's budget, stopped at the round a validation cut picks.

    First `best_round` picks, on a validation cut of the training rows, the round (of
    ``rounds``) that scores best; then the model is trained on all training rows, and the one
    after that round is kept (``metrics``; ``per_round`` still shows every round). So a
    baseline loses to the federation neither by under- nor by over-training.
    """
    chosen = best_round(labels, site_files, id_column, params, rounds, seed=seed,
                        test_fraction=test_fraction)
    result = train_local(labels, site_files, id_column, params, rounds, seed=seed,
                         test_fraction=test_fraction)
    return {"num_examples": result["train_rows"], "test_examples": result["num_examples"],
            "metrics": result["per_round"][chosen["round"] - 1], "rounds_kept": chosen["round"],
            "val_rows": chosen["val_rows"], "val_metric": chosen["val_metric"],
            "final_metrics": result["metrics"], "per_round": result["per_round"]}


def baselines(labels: LabelTable, site_files: Sequence[str | Path], id_column: str,
              params: FusionParams, rounds: int, *, seed: int = 0,
              test_fraction: float = 0.2) -> dict[str, Any]:
    """Each site alone (its columns with the labels) and one model on all columns pooled.

    Same optimiser, batch size and number of steps as the federation, each stopped at the
    round a validation cut of its training rows picks (`train_baseline`). The centralized model
    is one branch over every column (width K x embedding) and the same head.
    """
    alone_params = params.model_copy(update={"min_overlap": 0.0, "fill": "drop"})
    local_only = [
        {"site": f"site-{i}", **train_baseline(labels, [path], id_column, alone_params, rounds,
                                               seed=seed, test_fraction=test_fraction)}
        for i, path in enumerate(site_files)]
    k = len(site_files)
    central_params = alone_params.model_copy(update={
        "embedding_dim": params.embedding_dim * k, "branch_hidden": params.branch_hidden * k})
    with tempfile.TemporaryDirectory() as tmp:
        joined = joined_table(site_files, id_column, Path(tmp))
        central = train_baseline(labels, [joined], id_column, central_params, rounds, seed=seed,
                                 test_fraction=test_fraction)
    return {"local_only": local_only, "centralized": central}
