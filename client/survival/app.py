"""The hospital agent of the survival paths: a Flower ClientApp answering sums, never rows.

Handlers:

- ``query.schema``: the column report of the hospital's table (`protocol.schema`; the time
  column as the target, the event column set aside), as in every horizontal federation.
- ``query.survival`` (`protocol.survival.STAGES`), each reply one vector:
  ``moments`` [rows, events, per covariate sum, sum of squares];
  ``newton`` [log partial likelihood, gradient, Hessian's upper triangle] of this hospital's
  stratum at the broadcast (standardized) coefficients (`client.survival.cox.efron_parts`);
  ``concordance`` [concordant, tied, comparable] pair counts at those coefficients;
  ``km-times`` the hospital's distinct event times (the grid; no counts);
  ``km-counts`` [rows, then number at risk and number of events at each grid time]. The
  hospital's own Kaplan-Meier curve is written beside its data file (``km-own.json``), never
  sent.
- ``query.secagg``: secure aggregation's setup, share-keys and unmask stages
  (`client.secure.agent`). A ``query.survival`` instruction carrying a ``secagg`` record is the
  collect stage: the vector is encoded in fixed point (`protocol.survival.encode_fixed`),
  masked, and only the masked vector leaves.
"""

from __future__ import annotations

import json
from functools import lru_cache
from pathlib import Path
from typing import Any

import numpy as np
from fedsplit.client.data import TABLE_SUFFIXES, read_table
from fedsplit.client.node_config import NodeConfig
from fedsplit.client.policy import policy_mod
from fedsplit.client.secure import secagg
from fedsplit.client.secure.agent import handle_query, take_secure_record
from fedsplit.client.survival.cox import (
    concordance_counts,
    efron_parts,
    km_counts,
    triangle,
)
from fedsplit.protocol import horizontal_wire as wire
from fedsplit.protocol import privacy as pv
from fedsplit.protocol import survival as sv
from fedsplit.protocol.errors import ConfigError
from fedsplit.protocol.schema import Schema, column_report, encode_frame
from flwr.app import Array, ArrayRecord, ConfigRecord, Context, Message, RecordDict
from flwr.clientapp import ClientApp

app = ClientApp(mods=[policy_mod("survival")])  # the hospital's policy and egress log


def data_path(node: NodeConfig, run: sv.SurvivalRun) -> Path:
    """This hospital's table: node config ``data-path``, else ``DATA_DIR/site-<partition-id>/``."""
    if node.data_path:
        path = Path(node.data_path)
    elif (folder := node.partition_folder(run.data_dir)) is not None:
        path = folder
    else:
        raise ConfigError("This hospital agent does not know where its table is: start the "
                          "SuperNode with --node-config \"data-path='/path/to/site.csv'\". "
                          f"Received: node config {node.given}")
    if path.is_dir():
        files = sorted(p for p in path.iterdir() if p.suffix.lower() in TABLE_SUFFIXES)
        if len(files) != 1:
            raise ConfigError(f"{path} must hold exactly one .csv/.parquet table. "
                              f"Received: {[p.name for p in files]}")
        path = files[0]
    return path


@lru_cache(maxsize=4)
def _table(path: str, name: str, time: str, event: str, na_values: tuple[str, ...] = ()
           ) -> tuple[Any, np.ndarray, np.ndarray]:
    frame = read_table(Path(path))
    t, e = sv.read_survival(name, frame, time, event, na_values)  # refuses unusable rows
    return frame, t, e


@lru_cache(maxsize=4)
def _covariates(path: str, name: str, run: sv.SurvivalRun, schema_json: str) -> np.ndarray:
    frame, _, _ = _table(path, name, run.time, run.event, run.missing_markers)
    schema = Schema.from_json(schema_json)
    x, _ = encode_frame(schema, frame, where=f"Hospital {name}'s table")
    _, keep, _ = sv.cox_columns(schema)
    x = x[:, keep].astype(np.float64)
    if np.isnan(x).any():
        names = [n for n, bad in zip(sv.cox_columns(schema)[0], np.isnan(x).any(axis=0),
                                     strict=True) if bad]
        raise ConfigError(f"Hospital {name}: {int(np.isnan(x).any(axis=1).sum())} row(s) have "
                          f"missing values in {names}; a Cox model needs every covariate. Fill "
                          f"them, drop those rows, or leave the columns out with --ignore-column. "
                          f"Received: missing values")
    return x


def _site(context: Context, msg_node: int) -> tuple[sv.SurvivalRun, NodeConfig, str, str]:
    """The run config and the node config (read here, once per message), the table's path and
    the hospital's name."""
    run = sv.SurvivalRun.from_flower(context.run_config)
    node = NodeConfig.from_flower(context.node_config)
    return run, node, str(data_path(node, run)), node.name(msg_node, run.names)


@app.query("schema")
def schema(msg: Message, context: Context) -> Message:
    """The column report of this hospital's table (time as target, event set aside)."""
    wire.check_content(wire.SCHEMA_QUERY, msg.content, reply=False)
    run, node, path, name = _site(context, msg.metadata.dst_node_id)
    frame, _, _ = _table(path, name, run.time, run.event, run.missing_markers)
    from fedsplit.client.policy.labels import hospital_settings
    from fedsplit.client.policy.paths import hospital_policy

    # rare categories withheld at max(the hospital's policy min_category_count, the run's)
    report = column_report(name, frame, hospital_settings(hospital_policy(node),
                                                          run.table_settings))
    return Message(wire.build_schema_reply(report), reply_to=msg)


@app.query("secagg")
def secure(msg: Message, context: Context) -> Message:
    """Secure aggregation's setup, share-keys and unmask stages."""
    return Message(handle_query(msg.content, msg.metadata.dst_node_id, context), reply_to=msg)


def _vector(stage: str, record: dict[str, Any], run: sv.SurvivalRun, path: str, name: str
            ) -> np.ndarray:
    _, t, e = _table(path, name, run.time, run.event, run.missing_markers)
    if stage == "km-times":
        return np.unique(t[e])
    if stage == "km-counts":
        grid = np.asarray(record["grid"], dtype=np.float64)
        at_risk, events = km_counts(t, e, grid)
        _own_curve(Path(path).parent, t, e)
        return np.concatenate([[len(t)], at_risk, events]).astype(np.float64)
    x = _covariates(path, name, run, str(record["schema"]))
    if stage == "moments":
        return np.concatenate([[len(t), int(e.sum())], x.sum(axis=0), (x**2).sum(axis=0)])
    mean, std = np.asarray(record["mean"], np.float64), np.asarray(record["std"], np.float64)
    beta = np.asarray(record["beta"], np.float64)
    if len(beta) != x.shape[1] or len(mean) != x.shape[1] or len(std) != x.shape[1]:
        raise ConfigError(f"The coefficients have {len(beta)} entries; this hospital's covariates "
                          f"{x.shape[1]}. Received: {len(beta)}")
    z = (x - mean) / std
    if stage == "newton":
        parts = efron_parts(z, t, e, beta)
        return np.concatenate([[parts.loglik], parts.gradient, triangle(parts.hessian)])
    return np.asarray(concordance_counts(t, e, z @ beta), dtype=np.float64)


def _own_curve(folder: Path, t: np.ndarray, e: np.ndarray) -> None:
    """This hospital's own Kaplan-Meier curve, for its own eyes (written locally, not sent)."""
    from lifelines import KaplanMeierFitter

    km = KaplanMeierFitter().fit(t, e)
    table = km.event_table
    (folder / "km-own.json").write_text(json.dumps({
        "time": km.survival_function_.index.tolist(),
        "survival": km.survival_function_.iloc[:, 0].tolist(),
        "at_risk": table["at_risk"].astype(int).tolist(),
        "events": table["observed"].astype(int).tolist()}))


@app.query("survival")
def survival(msg: Message, context: Context) -> Message:
    """One survival stage: a vector of sums, plain or masked."""
    collect = take_secure_record(msg.content) if pv.SECAGG in msg.content.config_records else None
    if list(msg.content.keys()) != [sv.RECORD]:
        raise ConfigError(f"A {sv.QUERY} instruction holds one config record {sv.RECORD!r} (and "
                          f"{pv.SECAGG!r} under secure aggregation). Received: "
                          f"{list(msg.content.keys())}")
    record = dict(msg.content.config_records[sv.RECORD])
    stage = sv.check_instruction(record)
    run, _, path, name = _site(context, msg.metadata.dst_node_id)
    vector = _vector(stage, record, run, path, name)
    site = ConfigRecord({"name": name})
    if collect is None:
        return Message(RecordDict({sv.SUMS: ArrayRecord({"vector": Array(vector)}), sv.SITE: site}),
                       reply_to=msg)
    if stage not in sv.STAGE_BITS:
        raise ConfigError(f"Stage {stage} is not a secure sum. Received: {stage}")
    parties = max(len(run.names), run.min_nodes)
    encoded = sv.encode_fixed(vector, parties, sv.STAGE_BITS[stage])
    masked = secagg.masked_vector(context, collect, encoded)
    return Message(RecordDict({pv.MASKED: ArrayRecord({"vector": Array(masked)}), sv.SITE: site}),
                   reply_to=msg)
