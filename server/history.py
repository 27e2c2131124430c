"""The coordinator's round history and saved global models, written after every round.

``OUT/history.json`` is the run record, `protocol.record.horizontal.RunRecord` (fields described in
docs/run-record.md): the run configuration, the model id, the agreed table schema
(``schema``, `protocol.schema.Schema` as JSON, and ``schema_warnings``), the kept round
(``selection``) and per round: every site's count and metrics, the aggregation report, the
server optimizer's step (``server_opt``), the privacy accounting (``privacy``), the federated
evaluation (per site: ``evaluate.sites[].metrics``), and timings. `RunHistory` writes it only
through those models.
``OUT/models/round-NNN.h5`` (+ ``.report.json``) hold each round's global model in the fedsplit
weight-file format, with the schema as its ``schema`` attribute; ``OUT/last.h5`` is the last
round's, ``OUT/global.h5`` the kept round's: with run config ``keep=best-val`` (the default) the
round whose federated evaluation on the hospitals' validation rows scores best by the task
metric, ties to the later round; with ``keep=last`` the last round's (`server.selection`;
``selection`` in the history records the choice, and a resumed run recomputes it from the
recorded rounds);
``OUT/models/round-NNN.opt.h5`` holds the server optimizer's state after that round (its
``m.<param>`` and ``v.<param>`` arrays, ``num_examples`` = steps taken), so a resumed run
continues the optimizer where it stopped. Every file is replaced atomically, so a reader (the CLI's
progress bar, an operator, a restarted coordinator) never sees a half-written one.
"""

from __future__ import annotations

import json
import shutil
import time
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING, Any

import numpy as np
from fedsplit.aggregation.base import AggregateResult
from fedsplit.aggregation.server_optimizers import ServerOptimizer
from fedsplit.protocol.atomic import atomic_path, write_json_atomic
from fedsplit.protocol.config import RunConfig
from fedsplit.protocol.errors import ConfigError, ResumeMismatchError
from fedsplit.protocol.record.common import HISTORY_FILE
from fedsplit.protocol.record.horizontal import Phase, Resume, RunRecord, ServerOptStep, SiteEntry
from fedsplit.protocol.schema import Schema
from fedsplit.protocol.selection import check_keep
from fedsplit.protocol.update import Update
from fedsplit.protocol.weights import read_weights, write_weights
from fedsplit.server.selection import select

if TYPE_CHECKING:
    from flwr.app import ArrayRecord

#: Run-config keys a resumed run (same out-dir) may change: none of them alters a trained round
#: (declared once, `protocol.config.RunConfig.RESUMABLE`, where each is explained).
RESUMABLE_CHANGES = RunConfig.resumable_keys()
FINGERPRINT_KEY = "data-fingerprint"
START_OVER = ("use a new out-dir (--out), or start over in this one with run config resume=false "
              "(`fedsplit simulate --no-resume`, `fedsplit up --no-resume`)")


class RunHistory:
    """Accumulates what happened in each round and persists it: ``record``, a `RunRecord`."""

    def __init__(self, out_dir: Path, config: dict[str, Any],
                 previous: RunRecord | Mapping[str, Any] | None = None) -> None:
        self.out_dir = out_dir
        self.path = out_dir / HISTORY_FILE
        if previous is None:
            self.record = RunRecord(status="running", config=config, model_id=None,
                                    started_at=time.time(), rounds=[])
        else:  # a restarted coordinator continues the same history
            if not isinstance(previous, RunRecord):
                previous = RunRecord.from_json(dict(previous), source=str(self.path))
            done = previous.completed_rounds
            # everything but the ending (status, error, finished_at) carries over
            kept = previous.to_json()
            for key in ("status", "error", "finished_at"):
                kept.pop(key, None)
            self.record = RunRecord.model_validate(kept)
            self.record.status = "running"
            self.record.config = config
            self.record.rounds = [r for r in self.record.rounds if r.round <= done]
            self.record.resumed = [*self.record.resumed, Resume(after_round=done, at=time.time())]
        self.schema: str | None = (Schema.from_json(self.record.table_schema).to_json()
                                   if self.record.table_schema else None)
        self.keep = keep_rule(config)
        if previous is not None:
            self._keep()
        self.save()

    @property
    def data(self) -> dict[str, Any]:
        """The record as the JSON written to ``history.json`` (a copy: write through `record`)."""
        return self.record.to_json()

    def set_schema(self, schema: str | None, warnings: list[str]) -> None:
        """Record the agreed table schema (stored with every model written) and its warnings."""
        self.schema = schema
        self.record.table_schema = json.loads(schema) if schema else None
        self.record.schema_warnings = list(warnings)
        self.save()

    def save(self) -> None:
        """Persist the history (atomically)."""
        self.record.save(self.path)

    def set_model(self, model_id: str, federated: Sequence[str] | None = None) -> None:
        """Record the architecture every site trains and the tensors that travel (None: all)."""
        self.record.model_id = model_id
        if federated is not None:
            self.record.federated = list(federated)
        self.save()

    def record_train(
        self,
        server_round: int,
        result: AggregateResult | None,
        sites: Sequence[SiteEntry],
        metrics: dict[str, float],
        error: str | None = None,
        *,
        arrays: dict[str, np.ndarray] | None = None,
        server_opt: ServerOptimizer | None = None,
        train_seconds: float | None = None,
        seconds: float | None = None,
    ) -> None:
        """Record a round's training replies (one `SiteEntry` per hospital), the rule's
        aggregation report and the saved model. The report is recorded as the rule built it: the
        same object is history.json's round ``aggregation`` and ``models/round-NNN.report.json``.

        ``arrays``: the new global model when it is not the rule's aggregate (a server
        optimizer stepped it, or the aggregate covers only the tensors that travel and the
        rest was kept); ``server_opt``: that optimizer, whose state is saved first.
        ``train_seconds``: from the round's start to its model saved; ``seconds``: the round's
        whole time, when it ends here (each as the round loop measured it; None: not recorded).
        """
        entry = self.record.round_entry(server_round)
        entry.train = Phase(sites=list(sites), metrics=metrics)
        if error is not None:
            entry.error = error
        if result is not None:
            model_path = self.out_dir / "models" / f"round-{server_round:03d}.h5"
            if server_opt is not None:
                write_weights(Update(arrays=server_opt.state_arrays(),
                                     num_examples=max(server_opt.step_count, 1),
                                     round=server_round, model=f"server-opt/{server_opt.name}",
                                     site="coordinator"), optimizer_state_path(model_path))
                moved = {k: float(np.linalg.norm(arrays[k].astype(np.float64)
                                                 - result.arrays[k].astype(np.float64)))
                         for k in result.arrays} if arrays is not None else {}
                entry.server_opt = ServerOptStep(
                    name=server_opt.name, lr=server_opt.lr, step=server_opt.step_count,
                    distance_from_aggregate=float(np.sqrt(sum(v * v for v in moved.values()))))
            update = (Update(arrays=arrays, num_examples=result.num_examples)
                      if arrays is not None else result.to_update())
            write_weights(
                Update(arrays=update.arrays, num_examples=update.num_examples, round=server_round,
                       model=self.record.model_id, site="global"),
                model_path, schema=self.schema,
            )
            entry.aggregation = result.report
            write_json_atomic(model_path.with_suffix(".report.json"), result.report.to_json())
            with atomic_path(self.out_dir / "last.h5") as tmp:
                shutil.copyfile(model_path, tmp)
            entry.model = str(model_path.relative_to(self.out_dir))
            self._keep()
        if train_seconds is not None:
            entry.train_seconds = train_seconds
        if seconds is not None:
            entry.seconds = seconds
        self.save()

    def record_evaluate(
        self, server_round: int, sites: Sequence[SiteEntry], metrics: dict[str, float],
        *, seconds: float | None = None,
    ) -> None:
        """Record the federated evaluation of a round's global model (with one message per
        round it arrives with the next round's replies, or the closing exchange's).
        ``seconds``: the round's whole time, when this evaluation ends it (None: unchanged)."""
        entry = self.record.round_entry(server_round)
        entry.evaluate = Phase(sites=list(sites), metrics=metrics)
        if seconds is not None:
            entry.seconds = seconds
        self._keep()
        self.save()

    def record_privacy(self, server_round: int, *, level: str, epsilon_budget: float,
                       delta: float, run_epsilon: float | None = None) -> None:
        """Record a round's privacy accounting (`RunRecord.record_privacy`) and persist it."""
        if self.record.record_privacy(server_round, level=level, epsilon_budget=epsilon_budget,
                                      delta=delta, run_epsilon=run_epsilon):
            self.save()

    def _keep(self) -> None:
        """Choose the kept round from the recorded ones; copy its model to global.h5 when the
        choice moved (or global.h5 is missing)."""
        chosen = select(self.record.rounds, self.keep, self.record.model_id)
        before = self.record.selection.rounds_kept if self.record.selection else None
        self.record.selection = chosen
        target = self.out_dir / "global.h5"
        kept = self.record.round(chosen.rounds_kept) if chosen.rounds_kept else None
        if kept is not None and kept.model and (chosen.rounds_kept != before or not target.exists()):
            with atomic_path(target) as tmp:
                shutil.copyfile(self.out_dir / kept.model, tmp)

    def finish(self, status: str = "finished", error: str | None = None) -> None:
        """Mark the run as over."""
        self.record.status = status
        if error:
            self.record.error = error
        self.record.finished_at = time.time()
        self.save()


def keep_rule(config: dict[str, Any]) -> str:
    """The run config's ``keep`` (``best-val`` when absent); a bad value is a `ConfigError`."""
    try:
        return check_keep(str(config.get("keep", "best-val")))
    except ValueError as e:
        raise ConfigError(f"Run config: {e}") from e


def latest_model(out_dir: Path, history: RunRecord) -> Path:
    """The newest global model of a run, which the next round starts from: the last recorded
    round's saved model, else ``last.h5``, else ``global.h5`` (runs written before last.h5)."""
    for entry in sorted(history.rounds, key=lambda r: r.round, reverse=True):
        if entry.model and (out_dir / entry.model).exists():
            return out_dir / entry.model
    return out_dir / "last.h5" if (out_dir / "last.h5").exists() else out_dir / "global.h5"


def optimizer_state_path(model_path: Path) -> Path:
    """Where the server optimizer's state after a round is kept: beside its model."""
    return model_path.with_name(model_path.stem + ".opt.h5")


def completed_rounds(history: RunRecord) -> int:
    """The last round whose training phase was recorded (its model, if any, is in last.h5)."""
    return history.completed_rounds


@dataclass(frozen=True)
class ResumePoint:
    """Where an unfinished run in an out-dir stopped.

    ``global_model``: the run's ``global.h5`` (the kept round's model); ``start_model``: the
    last round's model, which the next round continues from (`latest_model`).
    """

    history: RunRecord
    last_round: int
    model_id: str
    global_model: Path
    start_model: Path | None = None

    def arrays(self) -> ArrayRecord:
        """The last round's global model (the one training continues from) as an ``ArrayRecord``."""
        return read_weights(self.start_model or self.global_model).to_array_record()

    @property
    def schema(self) -> str | None:
        """The agreed table schema (JSON) of the run, if it has one."""
        raw = self.history.table_schema
        return Schema.from_json(raw).to_json() if raw else None

    def restore_optimizer(self, optimizer: ServerOptimizer) -> None:
        """Load the server optimizer's state saved after the last completed round.

        Raises `ResumeMismatchError` when the run saved none (it ran without that optimizer, or
        the state file is gone): continuing with a fresh state would not be the same run.
        """
        path = optimizer_state_path(self.global_model.parent / "models" /
                                    f"round-{self.last_round:03d}.h5")
        if not path.exists():
            raise ResumeMismatchError(
                f"The unfinished run in {self.global_model.parent} has no server-optimizer state "
                f"for round {self.last_round} ({path.name}), so server-opt={optimizer.name} cannot "
                f"continue it: {START_OVER}. Received: {path} missing"
            )
        saved = read_weights(path)
        if saved.model != f"server-opt/{optimizer.name}":
            raise ResumeMismatchError(
                f"{path} holds the state of {saved.model}, not server-opt/{optimizer.name}: "
                f"{START_OVER}. Received: {saved.model!r}"
            )
        optimizer.load_state(saved.arrays, saved.num_examples)


def _fingerprint(config: dict[str, Any]) -> dict[str, Any]:
    """The ``data-fingerprint`` of a run config, parsed (an unreadable one counts as none)."""
    try:
        value = json.loads(config.get(FINGERPRINT_KEY) or "{}")
    except (TypeError, json.JSONDecodeError):
        return {}
    return value if isinstance(value, dict) else {}


def data_changes(before: dict[str, Any], after: dict[str, Any]) -> list[str]:
    """How each site's data differs between two fingerprints (site -> {rows, columns, sha256}).

    One line per changed site, e.g. ``site-1: rows 120 -> 118``; empty when nothing changed.
    """
    if before == after:
        return []
    if not before:
        return ["the saved run recorded no data fingerprint, so its site data cannot be checked"]
    if not after:
        return ["this run states no data fingerprint, so its site data cannot be checked"]
    changes = []
    for site in sorted(set(before) | set(after)):
        old, new = before.get(site), after.get(site)
        if old == new:
            continue
        if old is None:
            changes.append(f"{site}: new site ({new.get('rows', '?')} rows)")
            continue
        if new is None:
            changes.append(f"{site}: no longer in the run (held {old.get('rows', '?')} rows)")
            continue
        parts = [f"{key} {old.get(key)} -> {new.get(key)}" for key in ("rows", "columns")
                 if old.get(key) != new.get(key)]
        if not parts:
            parts.append(f"content changed (sha256 {str(old.get('sha256'))[:12]} -> "
                         f"{str(new.get('sha256'))[:12]})")
        changes.append(f"{site}: {', '.join(parts)}")
    return changes


def find_resume_point(out_dir: Path, config: dict[str, Any]) -> ResumePoint | None:
    """Return where to continue an unfinished run in ``out_dir``, or None to start over.

    A run is resumable when history.json is not ``finished``, records at least one completed
    round, and its last round's model exists (`latest_model`). Its configuration must match
    ``config`` except for the keys in `RESUMABLE_CHANGES`, and its sites must hold the same
    data (``data-fingerprint``); anything else raises `ResumeMismatchError` rather than
    continuing the old model on other data.
    """
    path = out_dir / HISTORY_FILE
    model = out_dir / "global.h5"
    if not path.exists():
        return None
    try:
        history = RunRecord.load(path)
    except ConfigError as e:
        raise ConfigError(f"{e} The run there cannot be resumed: move {path.name} away or set "
                          f"resume=false.") from e
    last = history.completed_rounds
    start = latest_model(out_dir, history.model_copy(
        update={"rounds": [r for r in history.rounds if r.round <= last]}))
    if history.status == "finished" or last == 0 or not start.exists() or not history.model_id:
        return None
    before = history.config
    changed = data_changes(_fingerprint(before), _fingerprint(config))
    differs = sorted(k for k in set(before) | set(config)
                     if k not in RESUMABLE_CHANGES | {FINGERPRINT_KEY} and before.get(k) != config.get(k))
    if changed:
        also = f"; the configuration differs too, in {differs}" if differs else ""
        raise ResumeMismatchError(
            f"{out_dir} holds an unfinished run ({last} rounds done) trained on other site data, so "
            f"it cannot be resumed (another partition, seed or site file?){also}: {START_OVER}. "
            f"Received: {'; '.join(changed)}"
        )
    if differs:
        raise ResumeMismatchError(
            f"{out_dir} holds an unfinished run ({last} rounds done) with a different configuration, "
            f"so it cannot be resumed: {START_OVER}. Received: differing keys {differs}"
        )
    return ResumePoint(history, last, str(history.model_id), model, start)
