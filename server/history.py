"""The coordinator's round history and saved global models, written after every round.

``OUT/history.json`` holds the run configuration, the model id and per round: every site's
count and metrics, the aggregation report, the federated evaluation, and timings.
``OUT/models/round-NNN.h5`` (+ ``.report.json``) and ``OUT/global.h5`` hold the global model in
the fedsplit weight-file format. Every file is replaced atomically, so a reader (the CLI's
progress bar, an operator, a restarted coordinator) never sees a half-written one.
"""

from __future__ import annotations

import json
import os
import shutil
import tempfile
import time
from pathlib import Path
from typing import Any

from aggregation.base import AggregateResult
from protocol.weights import write_weights


def write_json_atomic(path: Path, data: Any) -> None:
    """Write ``data`` as JSON to ``path`` via a temp file and rename."""
    path.parent.mkdir(parents=True, exist_ok=True)
    fd, tmp = tempfile.mkstemp(prefix=f".{path.name}.", suffix=".tmp", dir=path.parent)
    try:
        with os.fdopen(fd, "w") as fh:
            json.dump(data, fh, indent=2, default=float)
            fh.flush()
            os.fsync(fh.fileno())
        os.replace(tmp, path)
    except BaseException:
        Path(tmp).unlink(missing_ok=True)
        raise


class RunHistory:
    """Accumulates what happened in each round and persists it."""

    def __init__(self, out_dir: Path, config: dict[str, Any]) -> None:
        self.out_dir = out_dir
        self.path = out_dir / "history.json"
        self.data: dict[str, Any] = {
            "status": "running",
            "config": config,
            "model_id": None,
            "started_at": time.time(),
            "rounds": [],
        }
        self._round_started = time.monotonic()
        self.save()

    def save(self) -> None:
        """Persist the history."""
        write_json_atomic(self.path, self.data)

    def set_model(self, model_id: str) -> None:
        """Record the architecture every site trains."""
        self.data["model_id"] = model_id
        self.save()

    def _round(self, server_round: int) -> dict[str, Any]:
        for entry in self.data["rounds"]:
            if entry["round"] == server_round:
                return entry
        entry: dict[str, Any] = {"round": server_round}
        self.data["rounds"].append(entry)
        return entry

    def record_train(
        self,
        server_round: int,
        result: AggregateResult | None,
        sites: list[dict[str, Any]],
        metrics: dict[str, float],
        error: str | None = None,
    ) -> None:
        """Record a round's training replies, aggregation report and saved model."""
        entry = self._round(server_round)
        entry["train"] = {"sites": sites, "metrics": metrics}
        if error is not None:
            entry["error"] = error
        if result is not None:
            model_path = self.out_dir / "models" / f"round-{server_round:03d}.h5"
            write_weights(
                result.to_update(round=server_round, model=self.data["model_id"], site="global"),
                model_path,
            )
            write_json_atomic(model_path.with_suffix(".report.json"), result.report.to_dict())
            tmp = self.out_dir / ".global.h5.tmp"
            shutil.copyfile(model_path, tmp)
            os.replace(tmp, self.out_dir / "global.h5")
            entry["aggregation"] = result.report.to_dict()
            entry["model"] = str(model_path.relative_to(self.out_dir))
        entry["train_seconds"] = round(time.monotonic() - self._round_started, 3)
        self.save()

    def record_evaluate(
        self, server_round: int, sites: list[dict[str, Any]], metrics: dict[str, float]
    ) -> None:
        """Record the federated evaluation of a round's global model."""
        entry = self._round(server_round)
        entry["evaluate"] = {"sites": sites, "metrics": metrics}
        entry["seconds"] = round(time.monotonic() - self._round_started, 3)
        self._round_started = time.monotonic()
        self.save()

    def finish(self, status: str = "finished", error: str | None = None) -> None:
        """Mark the run as over."""
        self.data["status"] = status
        if error:
            self.data["error"] = error
        self.data["finished_at"] = time.time()
        self.save()
