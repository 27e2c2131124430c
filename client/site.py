"""The hospital's view of its own data inside the agent: which file, which rows train.

A table site reads its file as it comes (`client.data.read_table`), reports its columns
(`site_columns`, for the schema the federation agrees on before round 1), and encodes its rows
with the schema every instruction carries (`load_site`). The held-out evaluation rows are cut
from the file before encoding, the same way every time (``val-fraction``, ``seed``).

The hospital's recipe (`site_recipe`) is its operator's choice: node config ``recipe`` (and
``recipe-params``), else the run config's; none means the built-in MLP or CNN by the data
(`effective_recipe`). A recipe with a data reader reads the node's ``data-path`` itself (a folder
of images, NPZ, Parquet arrays); anything its reader declines is read as a table or NPZ.
"""

from __future__ import annotations

import json
from dataclasses import dataclass
from functools import lru_cache
from pathlib import Path
from typing import Any

import numpy as np
from fedsplit.client.data import (
    IMAGE_SUFFIXES,
    TABLE_SUFFIXES,
    Dataset,
    encode_table,
    is_staged,
    load_site_file,
    read_table,
    read_with_recipe,
    split_indices,
)
from fedsplit.client.node_config import NodeConfig
from fedsplit.client.recipes import Recipe, load_recipe
from fedsplit.client.recipes.builtin import builtin_for_data
from fedsplit.protocol.config import RunConfig
from fedsplit.protocol.errors import ConfigError
from fedsplit.protocol.schema import (
    Schema,
    SiteColumns,
    TableSettings,
    column_report,
    merge_reports,
    named_label_rows,
    target_label_counts,
)
from fedsplit.protocol.tasks import LabelEncoding, TaskKind, declared, label_encoding, task_kind

DATA_SUFFIXES = TABLE_SUFFIXES + IMAGE_SUFFIXES


@dataclass(frozen=True)
class SiteData:
    """A site's local train and held-out evaluation rows."""

    name: str
    train: Dataset
    val: Dataset


def site_recipe(node: NodeConfig, cfg: RunConfig) -> Recipe | None:
    """This hospital's recipe: node config ``recipe`` (with ``recipe-params``), else the run
    config's ``recipe`` (with ``recipe-params``), else the task kind's own recipe
    (`protocol.tasks`: survival's Cox recipe, with ``hidden`` and ``penalizer``); None: the
    built-in model by the data."""
    if node.recipe:
        return _recipe(node.recipe, node.recipe_params or "{}")
    if cfg.recipe:
        return _recipe(cfg.recipe, cfg.recipe_params)
    if ref := task_recipe(cfg):  # the task kind's own recipe, with run settings as parameters
        return _recipe(ref, json.dumps(recipe_settings(task_kind(cfg.task), cfg), sort_keys=True))
    return None


def task_recipe(cfg: RunConfig) -> str:
    """The run's task kind's own recipe reference (survival: the Cox recipe), or ""."""
    kind = declared(cfg.task)
    return kind.recipe if kind is not None else ""


def recipe_settings(kind: TaskKind, cfg: RunConfig) -> dict[str, Any]:
    """The run settings a task kind's recipe takes as its parameters (``recipe_settings``:
    ``hidden``, the widths of ``--hidden``; ``penalizer``, ``norm``)."""
    settings = {"hidden": list(cfg.hidden_widths), "penalizer": cfg.penalizer, "norm": cfg.norm}
    if unknown := sorted(set(kind.recipe_settings) - set(settings)):
        raise ConfigError(f"Task kind {kind.name}'s recipe takes run settings fedsplit does not "
                          f"pass to recipes: {unknown}. It may take {sorted(settings)}.")
    return {name: settings[name] for name in kind.recipe_settings}


@lru_cache(maxsize=8)
def _recipe(ref: str, params: str) -> Recipe:
    return load_recipe(ref, params)


def effective_recipe(node: NodeConfig, cfg: RunConfig, data_kind: str) -> Recipe:
    """The recipe this hospital trains with: its own or the survival task's (`site_recipe`),
    else the built-in one for its data (run config ``model``, or ``mlp`` for tables and ``cnn`` for
    images, with the run config's ``hidden`` and ``norm``)."""
    recipe = site_recipe(node, cfg)
    if recipe is not None:
        return recipe
    return builtin_for_data(cfg.model, data_kind, hidden=cfg.hidden_widths, norm=cfg.norm)


def recipe_line(cfg: RunConfig, data_kind: str | None = None,
                node: NodeConfig | None = None, *, load: bool = True) -> str:
    """Which model the hospitals train, for a command's start line: ``recipe REF (NAME version
    V, params {...})`` (a user's recipe, or the survival task's Cox recipe), else ``built-in MLP
    (hidden 64-32)`` or ``built-in CNN`` for ``data_kind`` (``mlp``: tables), or, with no data
    kind known yet, both built-ins by each hospital's data. ``load`` False: a user's recipe is
    named by its reference and parameters only (its code may be installed at the hospitals
    alone)."""
    node = node or NodeConfig()
    if not load and (ref := node.recipe or cfg.recipe):
        params = node.recipe_params if node.recipe else cfg.recipe_params
        return f"recipe {ref} (params {params or '{}'})"
    recipe = site_recipe(node, cfg)
    if recipe is not None:  # a user's recipe, or the survival task's Cox recipe
        ref = node.recipe or cfg.recipe or task_recipe(cfg)
        return (f"recipe {ref} ({recipe.identity.label()}, params "
                f"{json.dumps(recipe.identity.params, sort_keys=True)})")
    if data_kind is None:
        return "built-in model by each hospital's data (MLP for tables, CNN for images)"
    ident = effective_recipe(node, cfg, data_kind).identity
    if ident.name == "mlp":
        hidden = "-".join(str(h) for h in ident.params.get("hidden", []))
        norm = ident.params.get("norm", "none")
        shape = f"hidden {hidden}" if hidden else "no hidden layer"
        return f"built-in MLP ({shape}{'' if norm == 'none' else ', norm ' + norm})"
    return f"built-in {ident.name.upper()}"


def raw_data_path(node: NodeConfig, cfg: RunConfig) -> Path:
    """This node's data as configured (a file or a folder): node config ``data-path``, else
    ``DATA_DIR/site-<partition-id>/``."""
    if node.data_path:
        return Path(node.data_path)
    if (folder := node.partition_folder(cfg.data_dir)) is not None:
        return folder
    return resolve_data_path(node, cfg)  # raises with the fix


def resolve_data_path(node: NodeConfig, cfg: RunConfig) -> Path:
    """Find this node's data file: node config ``data-path``, else ``DATA_DIR/site-<partition-id>/``."""
    if node.data_path:
        path = Path(node.data_path)
    elif (folder := node.partition_folder(cfg.data_dir)) is not None:
        path = folder
    else:
        raise ConfigError(
            "This hospital agent does not know where its data is. Start the SuperNode with "
            "--node-config \"data-path='/path/to/site.csv'\" (CSV/Parquet with the target column, "
            f"or NPZ with x and y). Received: node config {node.given}"
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


def site_name(node: NodeConfig, node_id: int, cfg: RunConfig | None = None) -> str:
    """Name for reports: node config ``site-name``, else run config ``site-names`` by
    partition-id, else ``site-<partition-id>``, else the node id."""
    return node.name(node_id, cfg.names if cfg is not None else ())


def _is_table(path: Path) -> bool:
    return path.suffix.lower() in TABLE_SUFFIXES


@lru_cache(maxsize=8)
def _raw(path: str, val_fraction: float, seed: int) -> tuple[Any, Any]:
    """(training rows, held-out rows) of a table, as read (cells uninterpreted)."""
    frame = read_table(Path(path))
    if len(frame) < 2:
        raise ConfigError(f"A site needs at least 2 rows (train and evaluation). "
                          f"Received: {len(frame)} in {path}")
    keep, held = split_indices(len(frame), val_fraction, seed)
    return frame.iloc[keep].reset_index(drop=True), frame.iloc[held].reset_index(drop=True)


@lru_cache(maxsize=8)
def _encoded(path: str, val_fraction: float, seed: int, schema_json: str,
             named: tuple[str, ...] = ()) -> tuple[Dataset, Dataset]:
    """The table's (training, held-out) rows encoded with the schema; rows whose class label
    the schema lacks and this hospital did not name (``named``: it withheld them as rare) are
    dropped (`protocol.schema.named_label_rows`)."""
    train, val = _raw(path, val_fraction, seed)
    schema = Schema.from_json(schema_json)
    train, val = (_named_rows(schema, rows, named) for rows in (train, val))
    return (encode_table(schema, train, source=f"{path} (training rows)"),
            encode_table(schema, val, source=f"{path} (held-out rows)"))


def _named_rows(schema: Schema, rows: Any, named: tuple[str, ...]) -> Any:
    if not task_kind(schema.task).classes or schema.target not in rows.columns:
        return rows
    keep = named_label_rows(schema, rows[schema.target].tolist(), named)
    return rows if keep.all() else rows[keep].reset_index(drop=True)


def hospital_table_settings(node: NodeConfig, cfg: RunConfig) -> TableSettings:
    """The run's table settings with this hospital's own minimum count for categories and class
    labels applied: max(policy ``min_category_count``, run ``min-category-count``)."""
    from fedsplit.client.policy.labels import hospital_settings
    from fedsplit.client.policy.paths import hospital_policy

    return hospital_settings(hospital_policy(node), cfg.table_settings)


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


def site_columns(node: NodeConfig, node_id: int, cfg: RunConfig) -> SiteColumns:
    """This site's column report on its training rows (``query.schema``); NPZ sites report
    ``table`` False."""
    name = site_name(node, node_id, cfg)
    if (read := _recipe_read(node, cfg)) is not None:
        return SiteColumns(name, len(split_site(read, cfg.val_fraction, cfg.seed)[0]), False)
    path = resolve_data_path(node, cfg)
    if not _is_table(path):
        site = load_site(node, node_id, cfg)
        return SiteColumns(name, len(site.train), False)
    from fedsplit.client.policy.labels import check_report_labels
    from fedsplit.client.policy.paths import hospital_policy

    train, _ = _raw(str(path), cfg.val_fraction, cfg.seed)
    settings = hospital_table_settings(node, cfg)
    report = column_report(name, train, settings)  # rare categories and labels withheld
    check_report_labels(hospital_policy(node), report, cfg.target,
                        settings.min_category_count, cfg.task)
    return report


def load_site(node: NodeConfig, node_id: int, cfg: RunConfig,
              schema: str | None = None) -> SiteData:
    """Load (once per process) and split this site's data; tables are encoded with ``schema``
    (the federation's, as JSON), else with the file's own schema (`client.data.local_schema`).
    A recipe with a reader for the data path reads it instead (`client.data.read_with_recipe`)."""
    name = site_name(node, node_id, cfg)
    if (read := _recipe_read(node, cfg)) is not None:
        return _capped(node, SiteData(name, *split_site(read, cfg.val_fraction, cfg.seed)))
    path = resolve_data_path(node, cfg)
    task = None if cfg.task == "auto" else cfg.task
    if not _is_table(path):
        train, val = _load(str(path), cfg.target, task, cfg.val_fraction, cfg.seed)
        return _capped(node, SiteData(name, train, val))
    from fedsplit.client.policy.labels import check_federation_labels, check_own_labels
    from fedsplit.client.policy.paths import hospital_policy

    policy = hospital_policy(node)
    settings = hospital_table_settings(node, cfg)
    rows, _ = _raw(str(path), cfg.val_fraction, cfg.seed)
    counts = (target_label_counts(rows, settings)
              if label_encoding(task) is not LabelEncoding.VALUES else None) or {}
    named = tuple(sorted(k for k, v in counts.items() if v >= settings.min_category_count))
    check_own_labels(policy, name, cfg.target, len(counts), len(counts) - len(named),
                     settings.min_category_count)
    if not schema:  # its own report's schema (what it would agree on alone)
        if counts and not named:
            raise ConfigError(
                f"every class label of {cfg.target!r} is held by fewer than "
                f"{settings.min_category_count} rows here (the hospital's minimum count: the "
                f"larger of its policy's min_category_count and the run's min-category-count), "
                f"so it names none and, alone, has no row to train on: give it more rows, or "
                f"lower min_category_count in its policy file if naming smaller groups is safe. "
                f"Received: {len(counts)} label(s), the largest held by {max(counts.values())} "
                f"row(s)")
        schema = merge_reports([column_report(name, rows, settings)], cfg.table_settings,
                               task=task or "auto", max_labels=policy.max_labels
                               ).schema.to_json()
    else:
        check_federation_labels(policy, name, _label_count(schema), "the agreed schema")
    train, val = _encoded(str(path), cfg.val_fraction, cfg.seed, schema, named)
    return _enough_rows(node, SiteData(name, train, val))


@lru_cache(maxsize=8)
def _label_count(schema_json: str) -> int:
    return len(Schema.from_json(schema_json).labels)


def _enough_rows(node: NodeConfig, site: SiteData) -> SiteData:
    """Refuse (policy ``min_rows``) a split that leaves fewer rows on either side than the
    hospital lets any reported number describe: a run config whose ``val-fraction`` leaves one
    training row would have its feature sums be that patient's values, and one held-out row its
    accuracy that patient's label."""
    from fedsplit.client.policy.paths import hospital_policy
    from fedsplit.protocol.site_policy import PolicyRefusal

    if node.simulated:
        return site  # Flower's simulation engine: one operator's own partitions, not a hospital
    least = hospital_policy(node).min_rows
    small = [f"{what} {len(rows)}" for what, rows in (("training", site.train),
                                                       ("held-out", site.val)) if len(rows) < least]
    if small:
        raise PolicyRefusal(
            f"hospital {site.name} reports nothing computed on fewer than {least} patients "
            f"(its policy's min_rows), and this split leaves {' and '.join(small)} rows: the run "
            f"must leave at least {least} rows on each side (its val-fraction), or the hospital "
            f"needs more rows. Received: {len(site.train)} training, {len(site.val)} held-out rows")
    return site


def _capped(node: NodeConfig, site: SiteData) -> SiteData:
    """Refuse (policy ``max_labels``) a site whose own data holds too many class labels, or too
    few rows (`_enough_rows`)."""
    if task_kind(site.train.task).classes and np.ndim(site.train.y) == 1:
        from fedsplit.client.policy.labels import check_own_labels
        from fedsplit.client.policy.paths import hospital_policy

        labels = len(np.union1d(np.unique(site.train.y), np.unique(site.val.y)))
        check_own_labels(hospital_policy(node), site.name, "y", labels, 0, 1)
    return _enough_rows(node, site)


_READ: dict[tuple[str, str, str], Dataset | None] = {}


def _recipe_read(node: NodeConfig, cfg: RunConfig) -> Dataset | None:
    """The site's data as its recipe's reader reads it (once per process), or None."""
    recipe = site_recipe(node, cfg)
    if recipe is None or type(recipe).read_data is Recipe.read_data:
        return None
    path = raw_data_path(node, cfg)
    if is_staged(path):  # rows fedsplit simulate staged: read back exactly, never re-read
        return None
    key = (str(path.resolve()), type(recipe).__qualname__, recipe.identity.to_json())
    if key not in _READ:
        _READ[key] = read_with_recipe(recipe, path)
    return _READ[key]
