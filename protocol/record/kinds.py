"""Which kind of run wrote a ``history.json`` (`RUN_KINDS`, `run_kind`), and reading any run's
``history.json`` as the model of its kind (`load_run_record`): a horizontal Flower run's
`RunRecord`, a vertical run's `VerticalRunRecord`, or the status file of ``fedsplit km`` /
``fedsplit cox`` (`SurvivalAnalysisRecord`).
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

from fedsplit.protocol.record.common import HISTORY_FILE, read_json
from fedsplit.protocol.record.horizontal import RunRecord
from fedsplit.protocol.record.survival import SurvivalAnalysisRecord
from fedsplit.protocol.record.vertical import VerticalRunRecord

#: What wrote a ``history.json``: a horizontal Flower run (`RunRecord`), a vertical one
#: (`VerticalRunRecord`), or ``fedsplit km`` / ``fedsplit cox`` (a status file without rounds
#: whose ``mode`` names the analysis: `SurvivalAnalysisRecord`).
RUN_KINDS = ("horizontal", "vertical", "survival-km", "survival-cox")
#: Keys of a vertical run's configuration (`protocol.vertical.config.VerticalConfig.to_flower`)
#: that a horizontal one never has: how a file written before ``kind`` existed is told apart.
_VERTICAL_CONFIG_KEYS = frozenset({"fusion-params", "site-files", "site-out-dirs"})


def run_kind(data: dict[str, Any]) -> str:
    """The kind of run a parsed ``history.json`` records (`RUN_KINDS`): its ``kind`` when written
    (since issue 34), else told from its keys (files written before)."""
    kind = data.get("kind")
    if isinstance(kind, str) and kind in RUN_KINDS:
        return kind
    config = data.get("config")
    if "overlap" in data or "psi_seconds" in data or (
            isinstance(config, dict) and _VERTICAL_CONFIG_KEYS & set(config)):
        return "vertical"
    mode = data.get("mode")
    if mode in ("km", "cox") and not data.get("rounds"):
        return f"survival-{mode}"
    return "horizontal"


AnyRunRecord = RunRecord | VerticalRunRecord | SurvivalAnalysisRecord


def load_run_record(path: str | Path) -> AnyRunRecord:
    """Read any run's ``history.json`` as the model of its kind (`run_kind`); `ConfigError`
    when it is unreadable or not a run record of that kind."""
    return run_record_from_json(read_json(Path(path)), source=str(path))


def run_record_from_json(data: Any, *, source: str = HISTORY_FILE) -> AnyRunRecord:
    """Parsed ``history.json`` content as the model of its kind (`run_kind`); every kind has
    ``status`` and ``error``. `ConfigError` names what is wrong."""
    kind = run_kind(data) if isinstance(data, dict) else "horizontal"
    if kind == "vertical":
        return VerticalRunRecord.from_json(data, source=source)
    if kind in ("survival-km", "survival-cox"):
        return SurvivalAnalysisRecord.from_json(data, source=source)
    return RunRecord.from_json(data, source=source)
