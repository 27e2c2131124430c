"""The figures the commands write: per-round metrics (``simulate``, ``compare-strategies``,
``vertical simulate``) and the GPipe tick table (``pipeline-schedule``)."""

from __future__ import annotations

import contextlib
from collections.abc import Iterator, Mapping
from pathlib import Path
from typing import TYPE_CHECKING, Any

from fedsplit.protocol.atomic import atomic_path
from fedsplit.protocol.errors import ConfigError
from fedsplit.protocol.record.summary import RunSummary
from fedsplit.protocol.record.vertical import VerticalSummary
from fedsplit.protocol.selection import selection_metric

if TYPE_CHECKING:  # importing client.parallel loads torch; only drawing a table needs it
    from fedsplit.client.parallel.schedule import GPipeTable


def metric_key(summary: RunSummary | VerticalSummary | Mapping[str, Any]) -> str:
    """The metric a run is plotted, tabled and compared by: its selection metric (a recipe's
    own, e.g. c_index), else its task kind's (`protocol.tasks`: accuracy, r2, ...)."""
    if isinstance(summary, Mapping):
        summary = _summary(summary)
    chosen = summary.selection_metric if isinstance(summary, RunSummary) else None
    return chosen or selection_metric(str(summary.task))


@contextlib.contextmanager
def figure(path: Path, *, size: tuple[float, float] = (7, 4.2), dpi: int = 110) -> Iterator[Any]:
    """Yield matplotlib axes to draw on; then lay them out and save them to ``path`` atomically
    (PNG). The figure is closed whatever happens; nothing is written when drawing fails."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, ax = plt.subplots(figsize=size)
    try:
        yield ax
        fig.tight_layout()
        with atomic_path(path) as tmp:
            fig.savefig(tmp, dpi=dpi, format="png")
    finally:
        plt.close(fig)


@contextlib.contextmanager
def round_axes(path: Path, *, ylabel: str, title: str,
               size: tuple[float, float] = (7, 4.2)) -> Iterator[Any]:
    """A `figure` of per-round curves: labelled (x: round), gridded, with a legend."""
    with figure(path, size=size) as ax:
        yield ax
        ax.set_xlabel("round")
        ax.set_ylabel(ylabel)
        ax.set_title(title)
        ax.grid(alpha=0.3)
        ax.legend(fontsize=8)


def _summary(summary: RunSummary | Mapping[str, Any]) -> RunSummary:
    return summary if isinstance(summary, RunSummary) else RunSummary.from_json(dict(summary))


#: Up to this many hospitals `plot_rounds` draws a line per hospital (with a legend entry);
#: above, the per-round range and median over the hospitals.
PLOTTED_SITES = 20


def plot_rounds(summary: RunSummary | Mapping[str, Any], path: Path) -> None:
    """Draw the federated metric per round against the baselines (``fedsplit simulate``).

    Bold: the federated model on the pooled test rows (an open square: the round it keeps,
    ``global.h5``); one thin line per hospital: the federated
    model on that hospital's own test patients, with a dotted line of the same colour for the
    hospital's model trained alone, scored on the same patients; dashed: centralized (pooled).
    With personalization, a star per hospital after the last round: its fine-tuned model on its
    own test patients (the pooled one in bold colour).
    """
    summary = _summary(summary)
    key = metric_key(summary)
    rounds = [r.round for r in summary.rounds]
    with round_axes(path, ylabel=f"test {key}", title=f"fedsplit: {summary.strategy} over "
                    f"{len(summary.test_examples_per_site) or summary.sites} hospitals",
                    size=(8, 4.8)) as ax:
        ax.plot(rounds, summary.round_metric(key), "o-", color="C0",
                label="federated (pooled test)", lw=2.5)
        fed = summary.federated
        if fed is not None and fed.rounds_kept:  # the round its validation kept: global.h5
            ax.plot([fed.rounds_kept], [fed.metrics[key]], "s", color="C0", ms=9, mfc="none",
                    mew=2, label=f"federated kept ({fed.keep or 'best-val'})")
        if summary.centralized is not None:
            ax.axhline(summary.centralized.metrics[key], color="k", ls="--",
                       label="centralized (pooled test)")
        alone = {s.site: s for s in summary.local_only}
        names = list(summary.rounds[0].per_site) if summary.rounds else []
        if len(names) > PLOTTED_SITES:  # a band, not a line per hospital
            import numpy as np

            per_round = np.array([[r.per_site[n][key] for n in names] for r in summary.rounds])
            ax.fill_between(rounds, per_round.min(axis=1), per_round.max(axis=1), color="C1",
                            alpha=0.25, label=f"federated on each of {len(names)} hospitals "
                            f"(range)")
            ax.plot(rounds, np.median(per_round, axis=1), "-", color="C1", lw=1.2,
                    label="federated, median hospital")
            names = []
        for i, name in enumerate(names):
            color = f"C{i + 1}"
            ax.plot(rounds, [r.per_site[name][key] for r in summary.rounds], "-", lw=1.2,
                    color=color, label=f"federated on {name}")
            if name in alone:
                ax.axhline(alone[name].per_site[name][key], ls=":", color=color, alpha=0.9,
                           label=f"{name} alone on {name} (n={alone[name].num_examples})")
        tuned = summary.personalized
        if tuned:
            after = rounds[-1] + 0.4
            budget = {"alone": "its alone budget", "prior": "tested bias refit"}.get(
                str(tuned.steps), f"{tuned.steps} steps")
            ax.plot([after], [tuned.metrics[key]], "*", ms=13, color="C0",
                    label=f"fine-tuned at each hospital, {budget} (pooled)")
            for i, name in enumerate(names):
                if name in tuned.per_site:
                    ax.plot([after], [tuned.per_site[name][key]], "*", ms=9, color=f"C{i + 1}")


def plot_comparison(results: Mapping[str, RunSummary | Mapping[str, Any]], path: Path,
                    title: str) -> None:
    """One line per run: the test metric per round (``fedsplit compare-strategies``)."""
    runs = {label: _summary(summary) for label, summary in results.items()}
    key = metric_key(next(iter(runs.values())))
    with round_axes(path, ylabel=f"test {key}", title=title, size=(7.5, 4.5)) as ax:
        for label, summary in runs.items():
            rounds = [r.round for r in summary.rounds]
            style = "--" if label.startswith("clean") else "o-"
            ax.plot(rounds, summary.round_metric(key), style, label=label, lw=2)


def plot_vertical(summary: VerticalSummary | Mapping[str, Any], path: Path) -> None:
    """Fused per round against each site alone and centralized (``fedsplit vertical simulate``);
    a marker on each line shows the round that model keeps (chosen on validation rows)."""
    if not isinstance(summary, VerticalSummary):
        summary = VerticalSummary.from_json(dict(summary))
    key = metric_key(summary)
    rounds = [r.round for r in summary.rounds]
    title = f"fedsplit vertical: {len(summary.local_only)} sites, fill={summary.fill}"
    with round_axes(path, ylabel=f"held-out {key}", title=title) as ax:
        ax.plot(rounds, [r.metrics[key] for r in summary.rounds], "o-", lw=2,
                label="fused (federated)")
        fed = summary.federated
        if fed is not None and fed.rounds_kept:  # the round its validation kept
            ax.plot([fed.rounds_kept], [fed.metrics[key]], "s", color="C0", ms=9,
                    mfc="none", mew=2)
        central = summary.centralized
        if central is not None and central.per_round is not None:
            ax.plot(rounds, [m[key] for m in central.per_round], "k--",
                    label="centralized, all columns")
            ax.plot([central.rounds_kept], [central.metrics[key]], "ks", ms=7)
        for i, s in enumerate(summary.local_only):
            if s.per_round is not None:
                ax.plot(rounds, [m[key] for m in s.per_round], ":", color=f"C{i + 1}",
                        label=f"{s.site} alone")
                ax.plot([s.rounds_kept], [s.metrics[key]], "s", color=f"C{i + 1}", ms=6)


def draw_gpipe(table: GPipeTable, path: Path) -> None:
    """Draw the tick table with matplotlib (Agg backend, no display needed)."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt
    from matplotlib.patches import Rectangle

    ticks = len(table.phases)
    fig, ax = plt.subplots(figsize=(max(6.0, 0.6 * ticks + 1.5), 0.6 * table.stages + 1.6))
    shade = {"fill": "#fff3c4", "steady": "#d9f2d9", "drain": "#f3d9f2"}
    for t, phase in enumerate(table.phases):
        ax.add_patch(Rectangle((t, -0.5), 1, 0.4, color=shade[phase.split()[-1]]))
    for s, row in enumerate(table.cells):
        for t, cell in enumerate(row):
            if not cell:
                continue
            color = "#4c8bd6" if cell.startswith("F") else "#e07b39"
            ax.add_patch(Rectangle((t + 0.05, s + 0.05), 0.9, 0.9, color=color))
            ax.text(t + 0.5, s + 0.5, cell, ha="center", va="center", color="white", fontsize=9)
    ax.set_xlim(0, ticks)
    ax.set_ylim(table.stages, -0.5)
    ax.set_xticks([t + 0.5 for t in range(ticks)], [str(t) for t in range(ticks)])
    ax.set_yticks([s + 0.5 for s in range(table.stages)], [f"stage {s}" for s in range(table.stages)])
    ax.set_xlabel("tick (phase band on top: yellow fill, green steady, pink drain)")
    ax.set_title(f"GPipe {table.stages} x {table.microbatches}: forward {table.forward_ticks} ticks "
                 f"instead of {table.sequential_ticks}, bubble {table.bubble:.0%}")
    fig.tight_layout()
    try:
        fig.savefig(path, dpi=120)
    except OSError as e:
        raise ConfigError(f"Could not write the picture to {path} ({e}); pick a writable path. "
                          f"Received: {path}") from e
    finally:
        plt.close(fig)
