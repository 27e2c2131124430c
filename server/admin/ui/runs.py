"""Flower runs on disk: find every ``history.json`` under the ``--runs`` folders and read it.

A run is a folder holding ``history.json`` (the coordinator's out-dir: ``OUT/federation`` for
``fedsplit simulate``, ``WORK/out`` for ``fedsplit up``, the compose out volume). Its
``models/round-NNN.h5`` and ``.report.json`` sit beside it; ``summary.json`` (baselines) is
in the run folder or its parent. Each ``--runs DIR`` may be such a folder or hold many of them:
the search goes `MAX_DEPTH` levels down, skips hidden folders and the bulky ones simulate writes
(``flower``, ``sites``, ``models``) and stops after `MAX_RUNS` runs. Runs are named by their
path below DIR and addressed by a 12-hex-digit digest of their absolute path, so a URL never
carries a path. Files are re-read when their modification time changes.

Survival: ``km.json`` (the pooled Kaplan-Meier curve, `ui.documents`) beside ``history.json`` is read
with the run. ``fedsplit km`` and ``fedsplit cox`` write a status file ``history.json``
(`protocol.record.survival.SurvivalAnalysisRecord`: kind, status, mode, no rounds) beside their
output: such a folder is listed as a survival analysis (``analysis`` is its mode) with its
``km.json`` curve or its ``cox.json`` fit (`ui.documents`), its participants being the hospitals
its ``km.json`` names.

Vertical runs (``fedsplit vertical simulate``, `protocol.record.vertical.VerticalRunRecord`, told apart
by `protocol.record.kinds.run_kind`, files written before its ``kind`` included) are listed with their
rounds, the kept round and the fused model against the centralized one and each site alone
(``summary.json``'s `VerticalSummary`). The coordinator sees them; a hospital does not (their
sites are the vertical federation's own names, and the table holds every site's scores).
"""

from __future__ import annotations

import contextlib
import hashlib
import json
import os
import threading
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from fedsplit.protocol.aggregation_report import AggregationReport
from fedsplit.protocol.errors import ConfigError
from fedsplit.protocol.record.common import HISTORY_FILE, SUMMARY_FILE, scalars
from fedsplit.protocol.record.horizontal import Resume, RunRecord
from fedsplit.protocol.record.kinds import run_kind
from fedsplit.protocol.record.summary import RunSummary
from fedsplit.protocol.record.survival import SurvivalAnalysisRecord
from fedsplit.protocol.record.vertical import VerticalRunRecord, VerticalScores, VerticalSummary
from fedsplit.server.admin.ui.documents import COX_FILE, KM_FILE, CoxView, KMView, read_cox, read_km
from fedsplit.server.admin.ui.siterows import RoundRows, SiteRow, rows_from_round

HISTORY = HISTORY_FILE
SUMMARY = SUMMARY_FILE
MAX_DEPTH = 4
MAX_RUNS = 200
#: ``mode`` of the status files ``fedsplit km`` / ``fedsplit cox`` write as history.json.
ANALYSES = {"km": "Kaplan-Meier curve (fedsplit km)", "cox": "Cox model (fedsplit cox)"}
SKIP_DIRS = frozenset({"flower", "sites", "models", "flwr-home", "__pycache__", "node_modules"})
#: History or summary files larger than this are not parsed (a run's history is kilobytes).
MAX_JSON_BYTES = 64 * 1024 * 1024
RESCAN_S = 3.0


@dataclass
class FlowerRound(RoundRows):
    """One round of a Flower run."""

    number: int
    rows: list[SiteRow]
    strategy: str | None
    params: dict[str, Any]
    metrics: dict[str, float]
    test_metrics: dict[str, float]
    error: str | None
    seconds: float | None
    has_model: bool
    num_examples: int | None


@dataclass
class VerticalRoundView:
    """One round of a vertical run: the fused model's training loss and its test and
    validation scores."""

    number: int
    train_loss: float | None
    metrics: dict[str, float]
    val_metrics: dict[str, float]
    seconds: float | None
    kept: bool


@dataclass
class VerticalView:
    """What a vertical run shows: its task, ID overlap, rounds, the kept round and the fused
    model against the centralized one and each site alone (``summary.json``, when there)."""

    task: str | None
    keep: str | None
    metric: str | None
    kept_round: int | None
    train_rows: int | None
    test_rows: int | None
    sites: list[str]
    rounds: list[VerticalRoundView]
    #: (label, scores) rows: fused, centralized, then each site alone
    comparison: list[tuple[str, VerticalScores]]

    @property
    def metric_names(self) -> list[str]:
        """Every single-number metric any compared model or round reports, sorted."""
        names = {k for _, s in self.comparison for k in scalars(s.metrics)}
        names |= {k for r in self.rounds for k in r.metrics}
        return sorted(names)


@dataclass
class FlowerRun:
    """A Flower run's history (and baselines when simulate wrote them)."""

    run_id: str
    name: str
    path: Path
    status: str
    strategy: str
    params: dict[str, Any]
    total_rounds: int | None
    model_id: str | None
    started_at: float | None
    finished_at: float | None
    error: str | None
    rounds: list[FlowerRound]
    config: dict[str, Any]
    summary: RunSummary | None
    resumed: list[Resume] = field(default_factory=list)
    mtime: float = 0.0
    km: KMView | None = None
    analysis: str | None = None
    #: a ``fedsplit cox`` folder's fit (None: none written, or another kind of run)
    cox: CoxView | None = None
    #: what a vertical run shows (None: a horizontal run or a survival analysis)
    vertical: VerticalView | None = None
    #: the round whose model the run keeps (``global.h5``; `protocol.record.horizontal.Selection`, chosen
    #: again as each round is recorded), its rule (``best-val`` or ``last``) and metric; None:
    #: no round kept yet
    kept_round: int | None = None
    keep: str | None = None
    keep_metric: str | None = None

    @property
    def kind(self) -> str:
        """``horizontal``, ``vertical`` or the survival analysis (`protocol.record.kinds.RUN_KINDS`)."""
        if self.vertical is not None:
            return "vertical"
        return f"survival-{self.analysis}" if self.analysis else "horizontal"

    @property
    def sites(self) -> list[str]:
        """Every hospital named in any round."""
        return sorted({row.site for rnd in self.rounds for row in rnd.rows})

    @property
    def participants(self) -> list[str]:
        """The hospitals that took part: those of its rounds; for a survival analysis (no
        rounds), those its ``km.json`` names."""
        if self.analysis is not None and self.km is not None and self.km.doc is not None:
            return sorted(set(self.km.doc.hospitals))
        return self.sites

    @property
    def analysis_hospitals(self) -> list[str]:
        """The hospitals a survival analysis's output names (``km.json`` or ``cox.json``), for
        the coordinator's eyes; who may see the analysis is `participants`' (a ``cox`` folder:
        nobody but the coordinator)."""
        for view in (self.km, self.cox):
            if view is not None and view.doc is not None:
                return sorted(set(view.doc.hospitals))
        return []

    @property
    def analysis_label(self) -> str | None:
        """What a survival analysis is, in words (None for a Flower run)."""
        return ANALYSES.get(self.analysis) if self.analysis else None

    def round(self, number: int) -> FlowerRound | None:
        """Round ``number``, if recorded."""
        return next((r for r in self.rounds if r.number == number), None)

    def kept_score(self, metric: str | None) -> float | None:
        """The score a run is listed with: ``metric`` of the kept round's model on the test
        split (``summary.json``), else in the federated evaluation. None for a failed run (its
        rounds' scores are still on its page) and while no round is kept."""
        if self.status == "failed" or metric is None or self.kept_round is None:
            return None
        rnd = self.round(self.kept_round)
        if rnd is None:
            return None
        value = rnd.test_metrics.get(metric, rnd.metrics.get(metric))
        return value if isinstance(value, int | float) else None

    def model_path(self, number: int) -> Path:
        """Where round ``number``'s model is (it may not exist)."""
        return self.path / "models" / f"round-{number:03d}.h5"


def run_id_of(path: Path) -> str:
    """The URL id of the run in ``path``."""
    return hashlib.sha256(str(path.resolve()).encode()).hexdigest()[:12]


def discover(roots: list[Path]) -> list[tuple[str, Path]]:
    """(display name, run folder) of every run under ``roots``, at most `MAX_RUNS`."""
    found: list[tuple[str, Path]] = []
    seen: set[Path] = set()
    for root in roots:
        root = Path(root)
        if not root.is_dir():
            continue
        stack: list[tuple[Path, int]] = [(root, 0)]
        while stack and len(found) < MAX_RUNS:
            folder, depth = stack.pop()
            real = folder.resolve()
            if real in seen:
                continue
            seen.add(real)
            if (folder / HISTORY).is_file():
                rel = folder.relative_to(root)
                label = root.resolve().name if str(rel) == "." else f"{root.resolve().name}/{rel}"
                found.append((label, folder))
            if depth >= MAX_DEPTH:
                continue
            try:
                children = sorted(
                    (e for e in os.scandir(folder)
                     if e.is_dir(follow_symlinks=False) and not e.name.startswith(".")
                     and e.name not in SKIP_DIRS),
                    key=lambda e: e.name, reverse=True,
                )
            except OSError:
                continue
            stack.extend((Path(e.path), depth + 1) for e in children)
    return sorted(found)


def _read_json(path: Path) -> dict[str, Any] | None:
    try:
        if path.stat().st_size > MAX_JSON_BYTES:
            return None
        data = json.loads(path.read_text())
    except (OSError, ValueError):
        return None
    return data if isinstance(data, dict) else None


def _read_summary(path: Path) -> RunSummary | None:
    """The run's summary.json (in the run folder or its parent), None when absent or malformed."""
    for candidate in (path / SUMMARY, path.parent / SUMMARY):
        data = _read_json(candidate)
        if data is not None:
            with contextlib.suppress(ConfigError):
                return RunSummary.from_json(data, source=str(candidate))
    return None


def _report(path: Path, number: int) -> AggregationReport | None:
    """Round ``number``'s aggregation report beside its model, when the history lacks it."""
    data = _read_json(path / "models" / f"round-{number:03d}.report.json")
    try:
        return AggregationReport.model_validate(data) if data is not None else None
    except ValueError:
        return None


def _params(raw: Any) -> dict[str, Any]:
    if isinstance(raw, dict):
        return raw
    if isinstance(raw, str) and raw.strip():
        try:
            value = json.loads(raw)
        except ValueError:
            return {"(unparsed)": raw}
        return value if isinstance(value, dict) else {"(unparsed)": raw}
    return {}


def _vertical_view(history: VerticalRunRecord, path: Path) -> VerticalView:
    summary = None
    for candidate in (path / SUMMARY, path.parent / SUMMARY):
        data = _read_json(candidate)
        if data is not None:
            with contextlib.suppress(ConfigError):
                summary = VerticalSummary.from_json(data, source=str(candidate))
                break
    selection = history.selection
    kept = selection.rounds_kept if selection is not None else None
    kept_entry = history.kept_round()
    comparison: list[tuple[str, VerticalScores]] = []
    fused = summary.federated if summary is not None and summary.federated is not None else (
        VerticalScores(metrics=dict(kept_entry.metrics), num_examples=kept_entry.num_examples,
                       rounds_kept=kept) if kept_entry is not None else None)
    if fused is not None:
        comparison.append(("Fused (federation)", fused))
    if summary is not None and summary.centralized is not None:
        comparison.append(("Centralized (all columns pooled)", summary.centralized))
    for alone in summary.local_only if summary is not None else []:
        comparison.append((f"{alone.site or '?'} alone", alone))
    widths = history.input_widths
    sites = sorted(widths) if isinstance(widths, dict) else [a.site for a in (
        summary.local_only if summary is not None else []) if a.site]
    return VerticalView(
        task=history.task, keep=selection.keep if selection else None,
        metric=selection.metric if selection else None, kept_round=kept,
        train_rows=history.train_rows, test_rows=history.test_rows, sites=sites,
        rounds=[VerticalRoundView(number=r.round, train_loss=r.train_loss, metrics=scalars(r.metrics),
                                  val_metrics=scalars(r.val_metrics), seconds=r.seconds,
                                  kept=r.round == kept) for r in history.rounds],
        comparison=comparison,
    )


def _load_vertical(name: str, path: Path, data: dict[str, Any]) -> FlowerRun | None:
    try:
        history = VerticalRunRecord.from_json(data, source=str(path / HISTORY))
    except ConfigError:
        return None
    view = _vertical_view(history, path)
    total = history.config.get("num-server-rounds")
    return FlowerRun(
        run_id=run_id_of(path), name=name, path=path.resolve(), status=history.status or "unknown",
        strategy="vertical fusion", params={}, total_rounds=total if isinstance(total, int) else None,
        model_id=None, started_at=history.started_at, finished_at=history.finished_at,
        error=history.error or None, rounds=[], config=history.config, summary=None,
        mtime=(path / HISTORY).stat().st_mtime, vertical=view,
    )


def _load_analysis(name: str, path: Path, data: dict[str, Any]) -> FlowerRun | None:
    """A ``fedsplit km`` / ``fedsplit cox`` folder: its status file and its curve or fit."""
    try:
        record = SurvivalAnalysisRecord.from_json(data, source=str(path / HISTORY))
    except ConfigError:
        return None
    return FlowerRun(
        run_id=run_id_of(path), name=name, path=path.resolve(), status=record.status,
        strategy=ANALYSES[record.mode], params={}, total_rounds=None, model_id=None,
        started_at=record.started_at, finished_at=record.finished_at,
        error=record.error or None, rounds=[], config={}, summary=None,
        mtime=(path / HISTORY).stat().st_mtime, km=read_km(path), analysis=record.mode,
        cox=read_cox(path) if record.mode == "cox" else None,
    )


def load_run(name: str, path: Path) -> FlowerRun | None:
    """Read the run in ``path`` through the `protocol.record` model of its kind (`run_kind`:
    `RunRecord`, `VerticalRunRecord`, `SurvivalAnalysisRecord`); None when its history is
    missing, not JSON, or not a run record."""
    data = _read_json(path / HISTORY)
    if data is None:
        return None
    kind = run_kind(data)
    if kind == "vertical":
        return _load_vertical(name, path, data)
    if kind in ("survival-km", "survival-cox"):
        return _load_analysis(name, path, data)
    try:
        history = RunRecord.from_json(data, source=str(path / HISTORY))
    except ConfigError:
        return None
    summary = _read_summary(path)
    config = history.config
    test_by_round = {r.round: dict(r.metrics) for r in summary.rounds} if summary else {}
    rounds: list[FlowerRound] = []
    for entry in history.rounds:
        number = entry.round
        report = entry.aggregation or _report(path, number)
        rows = rows_from_round(entry.train.sites if entry.train else [], report,
                               entry.evaluate.sites if entry.evaluate else [])
        rounds.append(FlowerRound(
            number=number, rows=rows,
            strategy=report.strategy if report else None,
            params=_params(report.params) if report else {},
            metrics=scalars(entry.evaluate.metrics if entry.evaluate else None),
            test_metrics=test_by_round.get(number, {}),
            error=entry.error or None, seconds=entry.seconds,
            has_model=(path / "models" / f"round-{number:03d}.h5").is_file(),
            num_examples=report.num_examples if report else None,
        ))
    rounds.sort(key=lambda r: r.number)
    total = config.get("num-server-rounds")
    selection = history.selection
    kept = selection.rounds_kept if selection is not None else (
        summary.federated.rounds_kept if summary is not None and summary.federated else None)
    return FlowerRun(
        run_id=run_id_of(path), name=name, path=path.resolve(),
        status=history.status or "unknown",
        strategy=str(config.get("strategy", "?")), params=_params(config.get("strategy-params")),
        total_rounds=total if isinstance(total, int) else None,
        model_id=history.model_id,
        started_at=history.started_at, finished_at=history.finished_at,
        error=history.error or None,
        rounds=rounds, config=config, summary=summary, resumed=list(history.resumed),
        mtime=(path / HISTORY).stat().st_mtime, km=read_km(path), kept_round=kept,
        keep=selection.keep if selection is not None else None,
        keep_metric=selection.metric if selection is not None else None,
    )


def _stamp(path: Path) -> float | None:
    """Newest modification time of the run's history, summary and km.json (None: no history)."""
    try:
        stamp = (path / HISTORY).stat().st_mtime
    except OSError:
        return None
    for other in (path / SUMMARY, path.parent / SUMMARY, path / KM_FILE, path / COX_FILE):
        with contextlib.suppress(OSError):
            stamp = max(stamp, other.stat().st_mtime)
    return stamp


class RunCatalog:
    """The runs under the ``--runs`` folders, rescanned at most every `RESCAN_S` seconds."""

    def __init__(self, roots: list[Path] | tuple[Path, ...]) -> None:
        self.roots = [Path(r) for r in roots]
        self._lock = threading.Lock()
        self._scanned = -1e9
        self._paths: list[tuple[str, Path]] = []
        self._cache: dict[Path, tuple[float, FlowerRun]] = {}

    def runs(self) -> list[FlowerRun]:
        """Every readable run, by name."""
        with self._lock:
            now = time.monotonic()
            if now - self._scanned > RESCAN_S:
                self._paths = discover(self.roots)
                self._scanned = now
            runs: list[FlowerRun] = []
            for name, path in self._paths:
                mtime = _stamp(path)
                if mtime is None:
                    continue
                cached = self._cache.get(path)
                if cached is None or cached[0] != mtime:
                    run = load_run(name, path)
                    if run is None:
                        continue
                    self._cache[path] = (mtime, run)
                runs.append(self._cache[path][1])
            return runs

    def get(self, run_id: str) -> FlowerRun | None:
        """The run with URL id ``run_id``."""
        return next((r for r in self.runs() if r.run_id == run_id), None)
