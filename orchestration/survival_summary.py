"""After a survival run of `fedsplit simulate`: the pooled Kaplan-Meier curve's plot
(``km.png``) from the ``km.json`` the coordinator wrote (`server.survival.summary`, beside
``global.baseline.json``); `km_plot` also draws `fedsplit km`'s (`orchestration.survival.run`).

A module of its own, outside ``orchestration.survival``: that package imports
`orchestration.experiment` (``parse_site``), so `experiment` importing it would close an import
circle (tests/test_layers.py).
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

from fedsplit.orchestration.plots import figure
from fedsplit.protocol import survival_summary as ss
from fedsplit.protocol.errors import FederationError


def write_plots(out_dir: Path) -> dict[str, Path]:
    """Draw ``km.png`` from ``OUT_DIR/km.json`` (as `fedsplit km` does); return the summary's
    files: ``km`` (json), ``km_plot`` (png), ``baseline`` (the kept model's baseline)."""
    out_dir = Path(out_dir)
    km = out_dir / ss.KM_FILE
    baseline = ss.baseline_path(out_dir / "global.h5")
    missing = [p.name for p in (km, baseline) if not p.exists()]
    if missing:
        raise FederationError(f"The survival run wrote no {' or '.join(missing)} in {out_dir}: the "
                              f"summary after the last round did not finish (see history.json's "
                              f"error). Received: {sorted(p.name for p in out_dir.iterdir())}")
    km_plot(json.loads(km.read_text()), out_dir / "km.png")
    return {"km": km, "km_plot": out_dir / "km.png", "baseline": baseline}


def km_plot(doc: dict[str, Any], path: Path) -> None:
    """The pooled Kaplan-Meier curve with its 95% band (steps)."""
    c = doc["curve"]
    times = [0.0, *c["time"]]
    with figure(path, dpi=120) as ax:
        ax.step(times, [1.0, *c["survival"]], where="post", color="tab:blue",
                label=f"pooled ({doc['rows']} patients, {doc['events']} events)")
        ax.fill_between(times, [1.0, *c["lower_95"]], [1.0, *c["upper_95"]], step="post",
                        alpha=0.25, color="tab:blue", label="95% band (exponential Greenwood)")
        ax.set_ylim(0, 1.02)
        ax.set_xlabel("time")
        ax.set_ylabel("survival")
        ax.set_title(f"Federated Kaplan-Meier, {len(doc['hospitals'])} hospitals "
                     f"(min-count {doc['min_count']})", fontsize=9)
        ax.grid(alpha=0.3)
        ax.legend(fontsize=8)
