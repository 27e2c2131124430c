"""After a survival run of `fedsplit simulate` or `fedsplit up`: the pooled Kaplan-Meier curve's
plot (``km.png``) from the ``km.json`` the coordinator wrote (`server.survival.summary`, beside
``global.baseline.json``); `km_plot` also draws `fedsplit km`'s (`orchestration.survival.run`).
For `fedsplit up`: `tcga_partitions` writes the bundled Fed-TCGA-BRCA's regions as hospitals,
and `up_report` the lines printed at the end (per-hospital C-index of the kept model, files).

A module of its own, outside ``orchestration.survival``: that package imports
`orchestration.experiment` (``parse_site``), so `experiment` importing it would close an import
circle (tests/test_layers.py).
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from fedsplit.orchestration.plots import figure
from fedsplit.protocol import survival_summary as ss
from fedsplit.protocol.errors import FederationError
from fedsplit.protocol.record.horizontal import RunRecord
from fedsplit.protocol.record.summary import RunSummary, SurvivalFiles
from fedsplit.protocol.record.survival import KM_FILE, KMDocument
from fedsplit.protocol.survival import pooled_concordance


def write_plots(out_dir: Path) -> SurvivalFiles:
    """Draw ``km.png`` from ``OUT_DIR/km.json`` (as `fedsplit km` does); return the summary's
    files: ``km`` (json), ``km_plot`` (png), ``baseline`` (the kept model's baseline)."""
    out_dir = Path(out_dir)
    km = out_dir / KM_FILE
    baseline = ss.baseline_path(out_dir / "global.h5")
    missing = [p.name for p in (km, baseline) if not p.exists()]
    if missing:
        raise FederationError(f"The survival run wrote no {' or '.join(missing)} in {out_dir}: the "
                              f"summary after the last round did not finish (see history.json's "
                              f"error). Received: {sorted(p.name for p in out_dir.iterdir())}")
    km_plot(KMDocument.load(km), out_dir / "km.png")
    return SurvivalFiles(km=str(km), km_plot=str(out_dir / "km.png"), baseline=str(baseline))


def km_plot(doc: KMDocument, path: Path) -> None:
    """The pooled Kaplan-Meier curve with its 95% band (steps)."""
    c = doc.curve
    times = [0.0, *c.time]
    with figure(path, dpi=120) as ax:
        ax.step(times, [1.0, *c.survival], where="post", color="tab:blue",
                label=f"pooled ({doc.rows} patients, {doc.events} events)")
        ax.fill_between(times, [1.0, *c.lower_95], [1.0, *c.upper_95], step="post",
                        alpha=0.25, color="tab:blue", label="95% band (exponential Greenwood)")
        ax.set_ylim(0, 1.02)
        ax.set_xlabel("time")
        ax.set_ylabel("survival")
        ax.set_title(f"Federated Kaplan-Meier, {len(doc.hospitals)} hospitals "
                     f"(min-count {doc.min_count})", fontsize=9)
        ax.grid(alpha=0.3)
        ax.legend(fontsize=8)


@dataclass(frozen=True)
class UpDataset:
    """What a bundled survival dataset fixes for `fedsplit up`: its name (``dataset``, for
    `orchestration.datasets.table_keys`'s columns) and its hospitals (``sites``); None: nothing."""

    dataset: str | None = None
    sites: int | None = None


def up_dataset(dataset: str, site_files: Sequence[str] | None) -> UpDataset:
    """For `fedsplit up --dataset tcga-brca`: its name and 6 sites (its regions are the
    hospitals); else an `UpDataset` that fixes nothing."""
    from fedsplit.client.survival.tcga import DATASET, REGIONS

    if dataset != DATASET or site_files:
        return UpDataset()
    return UpDataset(dataset=DATASET, sites=len(REGIONS))


def tcga_partitions(folder: Path) -> dict[str, Path]:
    """Fed-TCGA-BRCA's 6 regions as hospitals for `fedsplit up`: each region's training rows (as
    FLamby's split) in ``folder/REGION/data.csv``; region name -> file."""
    from fedsplit.client.survival.tcga import load_tcga_brca

    files = {}
    for region, (train, _test) in load_tcga_brca().items():
        (folder / region).mkdir(parents=True, exist_ok=True)
        for stale in (folder / region).glob("data.*"):
            stale.unlink()
        train.to_csv(folder / region / "data.csv", index=False)
        files[region] = folder / region / "data.csv"
    return files


def summary_plots(out_dir: Path) -> dict[str, Any]:
    """The survival kind's plots after a ``simulate`` run (`protocol.tasks`): `write_plots`, as
    the run summary's ``survival`` field (set through `RunSummary`, so the key is the model's)."""
    return RunSummary(survival=write_plots(out_dir)).to_json()


def up_report(out_dir: Path, history: RunRecord) -> list[str]:
    """The end of a survival `fedsplit up`: the kept round's C-index per hospital (on its own
    evaluation rows) and over the summed pairs, and the summary's files (km.png drawn)."""
    files = write_plots(out_dir)
    kept = history.selection.rounds_kept if history.selection else None
    entry = history.round(kept) if kept else None
    lines = []
    if entry is not None and entry.evaluate is not None:
        for s in entry.evaluate.sites:
            if not s.excluded and "c_index" in s.metrics:
                lines.append(f"{s.site}: C-index {float(s.metrics['c_index']):.4f} "  # type: ignore[arg-type]
                             f"({s.num_examples} evaluation rows)")
        pooled = pooled_concordance(entry.evaluate.metrics) or entry.evaluate.metrics.get("c_index")
        if isinstance(pooled, int | float):
            lines.append(f"all hospitals (summed pairs): C-index {float(pooled):.4f}, round "
                         f"{kept}")
    lines.append(f"Kaplan-Meier {files.km} ({Path(str(files.km_plot)).name}), Breslow baseline "
                 f"{files.baseline}")
    return lines
