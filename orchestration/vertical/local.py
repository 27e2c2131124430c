"""Vertical training in one process: the same coordinator and site code, direct calls for messages.

Used for the baselines of ``fedsplit vertical simulate`` (each site alone, centralized: trained
to the federation's steps and kept by the federation's rule, the round that scores best on
validation rows cut from the label holder's training rows: `train_kept`), for
``fedsplit vertical compare-fills`` and by the tests. `LocalTransport` still converts every
payload to Flower records and back and checks it against `protocol.vertical.wire.ALLOWED`,
so what is exchanged is exactly what the Flower app exchanges.
"""

from __future__ import annotations

import math
import tempfile
from collections.abc import Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from fedsplit.client.vertical.site import SiteAgent, SiteState
from fedsplit.protocol.record.vertical import VerticalFill, VerticalScores
from fedsplit.protocol.vertical.config import FusionParams
from fedsplit.protocol.vertical.table import id_column_values, read_frame
from fedsplit.protocol.vertical.wire import Payload, check_payload, from_record, to_record
from fedsplit.server.vertical.coordinator import VAL_FRACTION, LabelTable, VerticalCoordinator
from fedsplit.server.vertical.coordinator import validation_cut as validation_cut  # re-exported

#: Share of the training label rows cut off as validation rows (the round kept).
BASELINE_VAL_FRACTION = VAL_FRACTION


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
                      keep: bool = False, out_dirs: Sequence[str] = (),
                      val_fraction: float = 0.0) -> tuple[VerticalCoordinator, LocalTransport]:
    """A coordinator over in-process sites ``site_files`` (node ids 0..K-1, names site-i)."""
    agents = {i: SiteAgent(str(p), id_column, f"site-{i}", out_dirs[i] if out_dirs else "")
              for i, p in enumerate(site_files)}
    transport = LocalTransport(agents, keep=keep)
    coordinator = VerticalCoordinator(labels, params, list(agents), transport, seed=seed,
                                      test_fraction=test_fraction, val_fraction=val_fraction)
    return coordinator, transport


def train_local(labels: LabelTable, site_files: Sequence[str | Path], id_column: str,
                params: FusionParams, rounds: int, *, seed: int = 0,
                test_fraction: float = 0.2) -> VerticalFill:
    """Align, prepare, train ``rounds`` rounds and evaluate on the held-out rows: the result
    under ``params.fill`` (``fills.json``'s entry), with the training rows."""
    coordinator, _ = local_coordinator(labels, site_files, id_column, params, seed=seed,
                                       test_fraction=test_fraction)
    coordinator.align()
    coordinator.prepare()
    for _ in range(rounds):
        coordinator.train_round()
    final = coordinator.evaluate()
    return VerticalFill(fill=params.fill, **final.model_dump(exclude_unset=True),
                        train_rows=len(coordinator.train_rows))


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


def _scored(value: float) -> float | None:
    return None if math.isnan(value) else value  # NaN: the round was not scored


def train_kept(labels: LabelTable, site_files: Sequence[str | Path], id_column: str,
               params: FusionParams, rounds: int, *, seed: int = 0, test_fraction: float = 0.2,
               keep: str = "best-val", val_fraction: float = VAL_FRACTION) -> VerticalScores:
    """Train ``rounds`` rounds and keep one by the rule every model follows.

    With ``keep="best-val"`` a seeded ``val_fraction`` of the training label rows becomes
    validation rows (`validation_cut`: never held-out rows, never trained on), and the round
    whose model scores best on them by the task metric is kept, ties to the later round
    (`protocol.selection`); ``keep="last"`` trains on every training row and keeps the last
    round. The same code (`VerticalCoordinator.train_and_keep`) runs in the Flower app.
    Returns (`VerticalScores`) the training rows (``num_examples``), the kept round's held-out
    ``metrics`` (on ``test_examples`` rows), ``rounds_kept``, ``val_metric`` (per round; None:
    not scored) and ``val_rows``, ``final_metrics`` and ``per_round`` (every round's held-out
    metrics).
    """
    coordinator, _ = local_coordinator(labels, site_files, id_column, params, seed=seed,
                                       test_fraction=test_fraction,
                                       val_fraction=val_fraction if keep == "best-val" else 0.0)
    coordinator.align()
    coordinator.prepare()
    rule, entries = coordinator.train_and_keep(rounds, keep)
    per_round = [dict(e.metrics) for e in entries]
    kept = entries[rule.round - 1]
    scores = VerticalScores(
        num_examples=len(coordinator.train_rows), test_examples=kept.num_examples,
        metrics=dict(kept.metrics), rounds_kept=rule.round, keep=rule.keep,
        val_rows=len(coordinator.val_rows), val_metric=[_scored(v) for v in rule.scores],
        final_metrics=per_round[-1], per_round=per_round)
    if kept.metrics_complete_rows is not None:
        scores.metrics_complete_rows = kept.metrics_complete_rows
    return scores


def best_round(labels: LabelTable, site_files: Sequence[str | Path], id_column: str,
               params: FusionParams, rounds: int, *, seed: int = 0, test_fraction: float = 0.2,
               val_fraction: float = VAL_FRACTION) -> VerticalScores:
    """What `train_kept` keeps with ``keep="best-val"``: ``rounds_kept`` (1-based),
    ``val_metric`` per round, ``val_rows`` (and the kept round's scores)."""
    return train_kept(labels, site_files, id_column, params, rounds, seed=seed,
                      test_fraction=test_fraction, val_fraction=val_fraction)


def train_baseline(labels: LabelTable, site_files: Sequence[str | Path], id_column: str,
                   params: FusionParams, rounds: int, *, seed: int = 0,
                   test_fraction: float = 0.2, keep: str = "best-val") -> VerticalScores:
    """A baseline trained to the federation's steps and kept by the federation's rule
    (`train_kept`): it loses to the federation neither by under- nor by over-training."""
    return train_kept(labels, site_files, id_column, params, rounds, seed=seed,
                      test_fraction=test_fraction, keep=keep)


@dataclass
class Baselines:
    """Each site alone (``local_only``, in site order, each with its ``site``) and the
    centralized model on every column (``centralized``)."""

    local_only: list[VerticalScores]
    centralized: VerticalScores


def baselines(labels: LabelTable, site_files: Sequence[str | Path], id_column: str,
              params: FusionParams, rounds: int, *, seed: int = 0,
              test_fraction: float = 0.2, keep: str = "best-val") -> Baselines:
    """Each site alone (its columns with the labels) and one model on all columns pooled.

    Same optimiser, batch size and number of steps as the federation, each kept by the
    federation's rule (``keep``; `train_kept`), on the same validation label rows. The centralized model
    is one branch over every column (width K x embedding) and the same head.
    """
    alone_params = params.model_copy(update={"min_overlap": 0.0, "fill": "drop"})
    local_only = []
    for i, path in enumerate(site_files):
        alone = train_baseline(labels, [path], id_column, alone_params, rounds, seed=seed,
                               test_fraction=test_fraction, keep=keep)
        alone.site = f"site-{i}"
        local_only.append(alone)
    k = len(site_files)
    central_params = alone_params.model_copy(update={
        "embedding_dim": params.embedding_dim * k, "branch_hidden": params.branch_hidden * k})
    with tempfile.TemporaryDirectory() as tmp:
        joined = joined_table(site_files, id_column, Path(tmp))
        central = train_baseline(labels, [joined], id_column, central_params, rounds, seed=seed,
                                 test_fraction=test_fraction, keep=keep)
    return Baselines(local_only=local_only, centralized=central)
