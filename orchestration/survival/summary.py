"""After a survival run of `fedsplit simulate`: the plot of the pooled Kaplan-Meier curve the
coordinator wrote (`server.survival.summary`: ``km.json``, ``global.baseline.json``)."""

from __future__ import annotations

import json
from pathlib import Path

from fedsplit.protocol import survival_summary as ss
from fedsplit.protocol.errors import FederationError


def write_plots(out_dir: Path) -> dict[str, Path]:
    """Draw ``km.png`` from ``OUT_DIR/km.json`` (as `fedsplit km` does); return the summary's
    files: ``km`` (json), ``km_plot`` (png), ``baseline`` (the kept model's baseline)."""
    from fedsplit.orchestration.survival.run import km_plot  # run.py imports experiment: lazily

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
