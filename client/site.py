"""The hospital's view of its own data inside the agent: which file, which rows train."""

from __future__ import annotations

from dataclasses import dataclass
from functools import lru_cache
from pathlib import Path
from typing import Any

from client.data import IMAGE_SUFFIXES, TABLE_SUFFIXES, Dataset, load_site_file, split_indices
from protocol.config import RunConfig
from protocol.errors import ConfigError

DATA_SUFFIXES = TABLE_SUFFIXES + IMAGE_SUFFIXES


@dataclass(frozen=True)
class SiteData:
    """A site's local train and held-out evaluation rows."""

    name: str
    train: Dataset
    val: Dataset


def resolve_data_path(node_config: dict[str, Any], cfg: RunConfig) -> Path:
    """Find this node's data file: node config ``data-path``, else ``DATA_DIR/site-<partition-id>/``."""
    if "data-path" in node_config:
        path = Path(str(node_config["data-path"]))
    elif cfg.data_dir and "partition-id" in node_config:
        path = Path(cfg.data_dir) / f"site-{int(node_config['partition-id'])}"
    else:
        raise ConfigError(
            "This hospital agent does not know where its data is. Start the SuperNode with "
            "--node-config \"data-path='/path/to/site.csv'\" (CSV/Parquet with the target column, "
            f"or NPZ with x and y). Received: node config {dict(node_config)}"
        )
    if path.is_dir():
        files = sorted(p for p in path.iterdir() if p.suffix.lower() in DATA_SUFFIXES)
        if len(files) != 1:
            raise ConfigError(
                f"Data directory {path} must hold exactly one .csv/.parquet/.npz file. "
                f"Received: {[p.name for p in files]}"
            )
        path = files[0]
    return path


def site_name(node_config: dict[str, Any], node_id: int) -> str:
    """Name for reports: node config ``site-name``, else ``site-<partition-id>``, else the node id."""
    if "site-name" in node_config:
        return str(node_config["site-name"])
    if "partition-id" in node_config:
        return f"site-{int(node_config['partition-id'])}"
    return f"node-{node_id}"


@lru_cache(maxsize=8)
def _load(
    path: str, target: str, task: str | None, val_fraction: float, seed: int
) -> tuple[Dataset, Dataset]:
    return split_site(load_site_file(path, target=target, task=task), val_fraction, seed)


def split_site(data: Dataset, val_fraction: float, seed: int) -> tuple[Dataset, Dataset]:
    """Split a site's rows into (train, held-out evaluation), as the agent does."""
    if len(data) < 2:
        raise ConfigError(f"A site needs at least 2 rows (train and evaluation). Received: {len(data)}")
    keep, held = split_indices(len(data), val_fraction, seed)
    return data.subset(keep), data.subset(held)


def load_site(node_config: dict[str, Any], node_id: int, cfg: RunConfig) -> SiteData:
    """Load (once per process) and split this site's data."""
    path = resolve_data_path(node_config, cfg)
    task = None if cfg.task == "auto" else cfg.task
    train, val = _load(str(path), cfg.target, task, cfg.val_fraction, cfg.seed)
    return SiteData(site_name(node_config, node_id), train, val)
