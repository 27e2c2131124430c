"""The vertical coordinator: a Flower ServerApp that holds the labels and the fusion head.

It runs `server.vertical.coordinator.VerticalCoordinator` over Flower's Grid: PSI alignment,
preparation, ``num-server-rounds`` rounds of ``steps_per_round`` split-training steps (one
message to and from each site per step), evaluation after each round on the label holder's
validation rows (cut from its training rows) and held-out rows, and the kept round's model
saved: with run config ``keep=best-val`` (the default) the round that scores best on the
validation rows by the task metric, ties to the later (`protocol.selection`, the baselines'
rule): the sites save its branches (``query.save``) and the coordinator its head (``OUT/head``)
whenever a round becomes the kept one; the last round's are saved at the end (the sites'
``last/`` folder, ``OUT/last/head``). With ``keep=last`` no validation rows are cut and the
last round is kept. ``OUT/history.json`` records the overlap report, every round, the
``selection`` (rule, metric, ``rounds_kept``, ``val_metric`` per round), and an inventory of
what crossed the network (array names, dtypes and widths per message type), checked against
`protocol.vertical.wire.ALLOWED`.
"""

from __future__ import annotations

import logging
import time
from collections.abc import Callable
from pathlib import Path

from fedsplit.protocol.errors import FedsplitError
from fedsplit.protocol.record.common import HISTORY_FILE
from fedsplit.protocol.record.vertical import (
    ArrayShape,
    MessageInventory,
    VerticalRound,
    VerticalRunRecord,
    VerticalSelection,
)
from fedsplit.protocol.selection import BestRound, selection_metric
from fedsplit.protocol.vertical.config import VerticalConfig
from fedsplit.protocol.vertical.wire import Payload, check_payload, from_record, to_record
from fedsplit.server.exchange import collect_all
from fedsplit.server.setup import wait_for_nodes
from fedsplit.server.vertical.coordinator import VAL_FRACTION, VerticalCoordinator, read_label_file
from flwr.app import Context, Message
from flwr.serverapp import Grid, ServerApp

log = logging.getLogger(__name__)

app = ServerApp()


class GridTransport:
    """Sends payloads to sites through Flower's Grid; checks and inventories every message."""

    def __init__(self, grid: Grid, timeout: float) -> None:
        self.grid = grid
        self.timeout = timeout
        self.inventory: dict[str, MessageInventory] = {}
        self.messages = 0
        self.bytes_up = 0
        self.bytes_down = 0

    def _note(self, message_type: str, direction: str, payload: Payload) -> None:
        entry = self.inventory.setdefault(f"{message_type} {direction}",
                                          MessageInventory(arrays={}, config=[]))
        for name, arr in payload.arrays.items():
            entry.arrays[name] = ArrayShape(dtype=str(arr.dtype), width=list(arr.shape[1:]))
        entry.config = sorted(set(entry.config) | set(payload.config))

    def __call__(self, message_type: str, payloads: dict[int, Payload]) -> dict[int, Payload]:
        msgs = []
        for node, payload in payloads.items():
            check_payload(message_type, payload, reply=False)
            self._note(message_type, "to-site", payload)
            self.bytes_down += payload.nbytes()
            msgs.append(Message(to_record(payload), dst_node_id=node, message_type=message_type))
        replies = collect_all(self.grid, msgs, timeout=self.timeout, what=message_type,
                              who="site")
        self.messages += len(msgs) + len(replies)
        out = {}
        for r in replies:
            payload = from_record(r.content)
            check_payload(message_type, payload, reply=True)
            self._note(message_type, "from-site", payload)
            self.bytes_up += payload.nbytes()
            out[int(r.metadata.src_node_id)] = payload
        return out


def selection_record(rule: BestRound, metric: str) -> VerticalSelection:
    """``history.json``'s ``selection``: the rule, metric, kept round and validation scores."""
    def number(value: float | None) -> float | None:
        return None if value is None or value != value else value  # NaN: not scored

    return VerticalSelection(keep=rule.keep, metric=metric, rounds_kept=rule.round,
                             val_score=number(rule.score), val_metric=[number(v) for v in rule.scores])


def train_and_save(coordinator: VerticalCoordinator, rounds: int, keep: str, out: Path,
                   history: VerticalRunRecord, write: Callable[[], None]) -> BestRound:
    """Train ``rounds`` rounds and save the kept round's model and the last one's.

    The head goes to ``out/head`` and each site's branch to its output folder whenever a round
    becomes the kept one (``keep=best-val``; with ``last`` once, at the end), and the last
    round's to ``out/last/head`` and the sites' ``last/`` folders. ``history`` gains each round,
    ``selection``, ``site_models`` and ``last_site_models``; ``write()`` persists it after
    every round.
    """
    metric = selection_metric(coordinator.labels.task)

    def save(slot: str) -> list[str]:
        assert coordinator.head is not None
        coordinator.head.save(out / slot / "head" if slot else out / "head", coordinator.head_meta())
        return coordinator.save_sites(tag=str(out), slot=slot)

    def after_round(entry: VerticalRound, rule: BestRound) -> None:
        history.rounds.append(entry)
        if rule.keep == "best-val" and rule.round == entry.round:
            history.site_models = save("")  # the kept round's model, as it is now
        history.selection = selection_record(rule, metric)
        write()

    rule, _ = coordinator.train_and_keep(rounds, keep, on_round=after_round)
    if rule.keep == "last":
        history.site_models = save("")
    history.last_site_models = save("last")
    write()
    return rule


@app.main()
def main(grid: Grid, context: Context) -> None:
    """Align, prepare, train, evaluate, save; history.json after every phase."""
    cfg = VerticalConfig.from_flower(context.run_config)
    out = Path(cfg.out_dir)
    history = VerticalRunRecord(kind="vertical", status="running", config=cfg.to_flower(), rounds=[],
                                started_at=time.time())
    path = out / HISTORY_FILE
    history.save(path)
    transport = GridTransport(grid, cfg.round_timeout)
    try:
        params = cfg.params
        labels = read_label_file(cfg.labels_path, cfg.id_column, cfg.target,
                                 None if cfg.task == "auto" else cfg.task)
        nodes = wait_for_nodes(grid, cfg.min_nodes, cfg.round_timeout)
        coordinator = VerticalCoordinator(labels, params, nodes, transport, seed=cfg.seed,
                                          test_fraction=cfg.test_fraction,
                                          val_fraction=VAL_FRACTION if cfg.keep == "best-val" else 0.0)
        t0 = time.monotonic()
        history.overlap = coordinator.align()
        history.psi_seconds = round(time.monotonic() - t0, 2)
        coordinator.prepare()
        history.task, history.input_widths = labels.task, coordinator.input_widths
        history.train_rows, history.test_rows = len(coordinator.train_rows), len(coordinator.test_rows)
        history.val_rows = len(coordinator.val_rows)
        history.save(path)

        def write() -> None:
            history.inventory = transport.inventory
            history.save(path)

        train_and_save(coordinator, cfg.num_server_rounds, cfg.keep, out, history, write)
    except FedsplitError as e:
        history.status, history.error = "failed", f"{type(e).__name__}: {e}"
        history.inventory, history.finished_at = transport.inventory, time.time()
        history.save(path)
        raise
    history.status, history.inventory = "finished", transport.inventory
    history.messages, history.bytes_to_sites = transport.messages, transport.bytes_down
    history.bytes_from_sites, history.finished_at = transport.bytes_up, time.time()
    history.save(path)

