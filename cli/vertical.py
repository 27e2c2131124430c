"""``fedsplit vertical``: sites with different columns of the same patients (embedding fusion).

- ``simulate``: PSI alignment, split training in Flower's simulation engine (one ClientApp per
  site), baselines (each site alone, one centralized model on all columns), summary.json and
  rounds.png.
- ``compare-fills``: the partial-overlap fills side by side (in-process runs of the same code).
- ``predict``: score new rows with a trained run's branches and head, aligned by PSI.
"""

from __future__ import annotations

import json
import time
from pathlib import Path
from typing import Annotated, Any

import typer
from rich.console import Console
from rich.table import Table

console = Console()
app = typer.Typer(help="Vertical federated learning: same patients, different columns per site.",
                  no_args_is_help=True)


def _params(**kw: Any) -> Any:
    import aggregation

    return aggregation.get_strategy("vertical-fusion", kw).params


def _inputs(dataset: str | None, site: list[Path] | None, labels: Path | None, sites: int,
            overlap: float, out: Path, seed: int, id_column: str,
            target: str) -> tuple[list[Path], Path, str, str]:
    from cli.vertical_datasets import write_bundled
    from protocol.errors import ConfigError

    if bool(dataset) == bool(site):
        raise ConfigError("Give either --dataset NAME --sites N, or one --site FILE per site with "
                          f"--labels FILE. Received: dataset={dataset!r}, {len(site or [])} --site")
    if dataset:
        files = write_bundled(dataset, sites, out / "data", overlap=overlap, seed=seed)
        return files.sites, files.labels, files.id_column, files.target
    if labels is None:
        raise ConfigError("--labels FILE (ID column + target, held by the coordinator) is needed "
                          "with --site files. Received: no --labels")
    return [p.resolve() for p in site or []], labels.resolve(), id_column, target


def run_flower(cfg: Any, num_sites: int, work: Path, timeout: float = 3600) -> dict[str, Any]:
    """Run the vertical app in Flower's simulation engine with ``num_sites`` site nodes."""
    from cli.flower_runtime import simulation

    return simulation(cfg, num_sites, work, timeout=timeout,
                      components=("server.vertical_app:app", "client.vertical_app:app"))


def plot(summary: dict[str, Any], path: Path) -> None:
    """Fused per round against each site alone and centralized."""
    from cli.plots import metric_key, round_axes

    key = metric_key(summary["task"])
    rounds = [r["round"] for r in summary["rounds"]]
    title = f"fedsplit vertical: {len(summary['local_only'])} sites, fill={summary['fill']}"
    with round_axes(path, ylabel=f"held-out {key}", title=title) as ax:
        ax.plot(rounds, [r["metrics"][key] for r in summary["rounds"]], "o-", lw=2,
                label="fused (federated)")
        ax.plot(rounds, [m[key] for m in summary["centralized"]["per_round"]], "k--",
                label="centralized, all columns")
        for i, s in enumerate(summary["local_only"]):
            ax.plot(rounds, [m[key] for m in s["per_round"]], ":", color=f"C{i + 1}",
                    label=f"{s['site']} alone")


def print_summary(summary: dict[str, Any]) -> None:
    """Each site alone, fused, centralized."""
    keys = ["accuracy"] if summary["task"] == "classification" else ["r2", "rmse"]
    table = Table(title=f"Held-out split ({summary['test_examples']} rows)")
    table.add_column("model")
    table.add_column("training rows", justify="right")
    for k in keys:
        table.add_column(k, justify="right")
    for s in summary["local_only"]:
        table.add_row(f"{s['site']} alone", str(s["num_examples"]), *[f"{s['metrics'][k]:.4f}" for k in keys])
    fed = summary["federated"]
    table.add_row("[bold]fused (vertical-fusion)[/]", str(summary["train_rows"]),
                  *[f"[bold]{fed['metrics'][k]:.4f}[/]" for k in keys])
    c = summary["centralized"]
    table.add_row("centralized (all columns)", str(c["num_examples"]),
                  *[f"{c['metrics'][k]:.4f}" for k in keys])
    console.print(table)
    for o in summary["overlap"]:
        console.print(f"overlap {o['site']}: {o['shared']} of {o['label_rows']} labelled patients "
                      f"({o['share_of_labels']:.0%}){' [yellow]LOW[/]' if o['status'] == 'low' else ''}")


@app.command("simulate")
def simulate(
    out: Annotated[Path, typer.Option(help="Output directory (summary.json, rounds.png, models).")],
    site: Annotated[list[Path] | None, typer.Option("--site", help="A site's CSV/Parquet (repeat).")] = None,
    labels: Annotated[Path | None, typer.Option(help="Label holder's file: ID column + target.")] = None,
    id_column: Annotated[str, typer.Option(help="ID column in every file.")] = "id",
    target: Annotated[str, typer.Option(help="Target column in the label file.")] = "target",
    dataset: Annotated[str | None, typer.Option(help="Bundled data: breast-cancer or digits.")] = None,
    sites: Annotated[int, typer.Option(min=1, help="Sites to cut --dataset's columns into.")] = 2,
    overlap: Annotated[float, typer.Option(help="--dataset: share of patients every site holds.")] = 1.0,
    task: Annotated[str, typer.Option(help="auto, classification or regression.")] = "auto",
    fill: Annotated[str, typer.Option(help="Missing views: nearest, mean, zero or drop.")] = "nearest",
    rounds: Annotated[int, typer.Option(min=1, help="Flower rounds.")] = 10,
    steps: Annotated[int, typer.Option(min=1, help="Mini-batch steps per round.")] = 20,
    batch_size: Annotated[int, typer.Option(min=1, help="Aligned rows per step.")] = 64,
    lr: Annotated[float, typer.Option(min=0.0, help="Adam learning rate.")] = 0.01,
    embedding_dim: Annotated[int, typer.Option(min=1, help="Embedding width per site.")] = 16,
    branch_hidden: Annotated[int, typer.Option(min=0, help="Hidden width in each branch (0 = none).")] = 0,
    head_hidden: Annotated[int, typer.Option(min=0, help="Head hidden width (0 = linear).")] = 16,
    min_overlap: Annotated[float, typer.Option(help="Refuse under this share of shared patients.")] = 0.2,
    test_fraction: Annotated[float, typer.Option(min=0.05, max=0.9, help="Held-out share.")] = 0.2,
    seed: Annotated[int, typer.Option(help="Seed for splits and initial weights.")] = 0,
) -> None:
    """Train branches + a fusion head across sites with Flower; compare with each site and centralized."""
    import torch

    from cli.vertical_local import baselines
    from protocol.atomic import write_json_atomic
    from protocol.vertical_config import VerticalConfig
    from server.vertical_coordinator import read_label_file

    torch.set_num_threads(1)
    out = out.resolve()
    out.mkdir(parents=True, exist_ok=True)
    params = _params(embedding_dim=embedding_dim, branch_hidden=branch_hidden, head_hidden=head_hidden,
                     lr=lr, batch_size=batch_size, steps_per_round=steps, fill=fill, min_overlap=min_overlap)
    files, labels_path, id_col, tgt = _inputs(dataset, site, labels, sites, overlap, out, seed,
                                              id_column, target)
    label_table = read_label_file(str(labels_path), id_col, tgt, None if task == "auto" else task)
    cfg = VerticalConfig(
        num_server_rounds=rounds, strategy_params=json.dumps(params.model_dump()), id_column=id_col,
        target=tgt, labels_path=str(labels_path), task=task,
        site_files=json.dumps([str(p) for p in files]),
        site_out_dirs=json.dumps([str(out / "sites" / f"site-{i}") for i in range(len(files))]),
        seed=seed, test_fraction=test_fraction, out_dir=str(out / "federation"), min_nodes=len(files))
    console.print(f"[dim]federation: {len(files)} sites, vertical-fusion, fill={fill}, {rounds} rounds x "
                  f"{steps} steps (Flower simulation)[/]")
    t0 = time.monotonic()
    history = run_flower(cfg, len(files), out / "flower")
    fed_seconds = time.monotonic() - t0
    console.print("[dim]baselines: each site alone and centralized (same steps, in-process)[/]")
    base = baselines(label_table, files, id_col, params, rounds, seed=seed, test_fraction=test_fraction)
    final = history["rounds"][-1]
    summary = {
        "task": history["task"], "strategy": "vertical-fusion", "params": params.model_dump(),
        "dataset": dataset or [str(p) for p in files], "sites": len(files), "fill": fill,
        "overlap": history["overlap"], "psi_seconds": history["psi_seconds"],
        "train_rows": history["train_rows"], "test_examples": history["test_rows"],
        "centralized": base["centralized"], "local_only": base["local_only"],
        "federated": {"metrics": final["metrics"], "num_examples": final["num_examples"],
                      **({"metrics_complete_rows": final["metrics_complete_rows"]}
                         if "metrics_complete_rows" in final else {}),
                      "model": str(out / "federation" / "head"), "site_models": history["site_models"],
                      "seconds": round(fed_seconds, 1), "messages": history["messages"]},
        "rounds": [{"round": r["round"], "metrics": r["metrics"], "train_loss": r["train_loss"],
                    "steps": r["steps"]} for r in history["rounds"]],
        "inventory": history["inventory"],
    }
    write_json_atomic(out / "summary.json", summary)
    plot(summary, out / "rounds.png")
    print_summary(summary)
    console.print(f"wrote {out / 'summary.json'}, {out / 'rounds.png'}")


@app.command("compare-fills")
def compare_fills(
    out: Annotated[Path, typer.Option(help="Output directory (fills.json).")],
    site: Annotated[list[Path] | None, typer.Option("--site", help="A site's CSV/Parquet (repeat).")] = None,
    labels: Annotated[Path | None, typer.Option(help="Label holder's file.")] = None,
    id_column: Annotated[str, typer.Option(help="ID column in every file.")] = "id",
    target: Annotated[str, typer.Option(help="Target column in the label file.")] = "target",
    dataset: Annotated[str | None, typer.Option(help="Bundled data: breast-cancer or digits.")] = None,
    sites: Annotated[int, typer.Option(min=1, help="Sites for --dataset.")] = 2,
    overlap: Annotated[float, typer.Option(help="--dataset: share of patients every site holds.")] = 0.6,
    rounds: Annotated[int, typer.Option(min=1)] = 10,
    steps: Annotated[int, typer.Option(min=1)] = 20,
    embedding_dim: Annotated[int, typer.Option(min=1)] = 16,
    seed: Annotated[int, typer.Option()] = 0,
) -> None:
    """Accuracy of each fill (nearest, mean, zero, drop) on the same held-out rows, in-process."""
    import torch

    from protocol.atomic import write_json_atomic
    from server.vertical_coordinator import read_label_file

    torch.set_num_threads(1)
    out = out.resolve()
    files, labels_path, id_col, tgt = _inputs(dataset, site, labels, sites, overlap, out, seed,
                                              id_column, target)
    label_table = read_label_file(str(labels_path), id_col, tgt, None)
    results = compare(label_table, files, id_col, rounds, steps, embedding_dim, seed)
    write_json_atomic(out / "fills.json", results)
    table = Table(title="Fills for missing views (held-out rows)")
    for col in ("fill", "training rows", "all held-out rows", "rows every site holds"):
        table.add_column(col, justify="right")
    key = "accuracy" if label_table.task == "classification" else "r2"
    for r in results["fills"]:
        table.add_row(r["fill"], str(r["train_rows"]), f"{r['metrics'][key]:.4f} (n={r['num_examples']})",
                      f"{r.get('metrics_complete_rows', r['metrics'])[key]:.4f} (n={r['complete_rows']})")
    console.print(table)


def compare(labels: Any, files: list[Path], id_column: str, rounds: int, steps: int,
            embedding_dim: int, seed: int) -> dict[str, Any]:
    """Run every fill on the same split; return their held-out metrics."""
    from cli.vertical_local import train_local

    fills = []
    for fill in ("nearest", "mean", "zero", "drop"):
        p = _params(fill=fill, steps_per_round=steps, embedding_dim=embedding_dim)
        r = train_local(labels, files, id_column, p, rounds, seed=seed)
        r.pop("per_round")
        fills.append({"fill": fill, **r})
    return {"fills": fills}


@app.command("predict")
def predict(
    model: Annotated[Path, typer.Option(help="A `vertical simulate` output directory.")],
    site: Annotated[list[Path], typer.Option("--site", help="New rows per site, same order as training.")],
    out: Annotated[Path, typer.Option(help="CSV of predictions to write.")],
    id_column: Annotated[str, typer.Option(help="ID column in every file.")] = "id",
    labels: Annotated[Path | None, typer.Option(help="Optional labels to score against.")] = None,
    target: Annotated[str, typer.Option(help="Target column in --labels.")] = "target",
) -> None:
    """Score rows every site holds: PSI-align the site files, embed at each branch, run the head."""
    import torch

    from cli.vertical_predict import predict_rows

    torch.set_num_threads(1)
    result = predict_rows(model, site, id_column, labels, target)
    result["frame"].to_csv(out, index=False)
    console.print(f"wrote {len(result['frame'])} predictions to {out} ({result['skipped']} rows of site-0 "
                  f"not held by every site were skipped)")
    if result.get("metrics"):
        console.print(f"metrics against {labels}: {result['metrics']}")
