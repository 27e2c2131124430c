"""The coordinator of the survival paths: a Flower ServerApp that sees only sums.

``mode = "cox"`` (``fedsplit cox``): the schema exchange (``query.schema``, merged as in every
horizontal federation), then one summed vector per stage (`protocol.survival.STAGES`): the
moments (pooled standardization), one Newton round per gradient/Hessian evaluation
(`server.survival.newton`), and the concordance pair counts at the fit. Writes
``OUT/cox.json``.

``mode = "km"`` (``fedsplit km``): the grid of event times (each hospital's distinct event
times, united), then the summed number at risk and number of events at each grid time; the
pooled curve after the minimum-count rule (`server.survival.km`). Writes ``OUT/km.json``.

With ``secure-aggregation`` on, every summed vector is one SecAgg+ sum (`server.secure.secagg`,
fresh keys each): the coordinator learns the sum and nothing per hospital; real values travel
in fixed point (`protocol.survival.encode_fixed`). Without it, each hospital's vector arrives
in the clear and is summed here. ``OUT/history.json`` records the status for the runner and the
web view (`protocol.record.survival.SurvivalAnalysisRecord`).
"""

from __future__ import annotations

import json
import logging
import os
import time
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Protocol

import numpy as np
from fedsplit.protocol import horizontal_wire as wire
from fedsplit.protocol import privacy as pv
from fedsplit.protocol import survival as sv
from fedsplit.protocol.design import derived_features
from fedsplit.protocol.errors import FederationError, FedsplitError
from fedsplit.protocol.privacy import SecureSpec
from fedsplit.protocol.record.common import HISTORY_FILE
from fedsplit.protocol.record.survival import (
    COX_FILE,
    KM_FILE,
    CoxDocument,
    CoxSites,
    KMDocument,
    SurvivalAnalysisRecord,
)
from fedsplit.protocol.schema import Schema, merge_reports
from fedsplit.server.exchange import collect_all
from fedsplit.server.secure import unmask
from fedsplit.server.secure.secagg import SecureSum
from fedsplit.server.setup import wait_for_nodes
from fedsplit.server.survival import km as kmm
from fedsplit.server.survival import newton as nt
from flwr.app import ArrayRecord, ConfigRecord, Context, Message, RecordDict
from flwr.serverapp import Grid, ServerApp

log = logging.getLogger(__name__)

app = ServerApp()


class SumSettings(Protocol):
    """What the coordinator reads of a run config: `protocol.survival.SurvivalRun`, or the
    horizontal `protocol.config.RunConfig` (the survival summary after training)."""

    @property
    def secure_aggregation(self) -> str: ...

    @property
    def round_timeout(self) -> float: ...


class Coordinator:
    """Sends one stage to every hospital and returns the summed vector (plain or secure).

    ``arrays`` (of `gather` and `total`): array records sent with the stage's config record
    (the survival summary sends the kept model so); ``bits``: the fixed-point fraction bits of
    a secure sum, by default the stage's (`protocol.survival.STAGE_BITS`)."""

    def __init__(self, grid: Grid, nodes: list[int], run: SumSettings) -> None:
        self.grid, self.nodes, self.run = grid, nodes, run
        self.secure = SecureSpec.parse(run.secure_aggregation)
        self.sums = 0
        self.per_site: dict[str, np.ndarray] = {}
        self.sites: list[str] = []

    def _send(self, messages: Sequence[Message], what: str) -> list[Message]:
        return collect_all(self.grid, messages, timeout=self.run.round_timeout, what=what)

    def schema(self) -> tuple[Schema, list[str]]:
        """The schema exchange of every horizontal federation (column reports merged)."""
        msgs = [Message(wire.build_schema_instruction(), dst_node_id=n,
                        message_type=wire.SCHEMA_QUERY) for n in self.nodes]
        reports = [wire.parse_schema_reply(r) for r in self._send(msgs, wire.SCHEMA_QUERY)]
        self.sites = sorted(r.site for r in reports)
        if len(set(self.sites)) != len(self.sites):
            raise FederationError(f"Two hospitals report the same name. Received: {self.sites}")
        merged = merge_reports(reports, self.run.table_settings, task="regression")
        return merged.schema, list(merged.warnings)

    def gather(self, stage: str, inputs: dict[str, Any],
               arrays: Mapping[str, ArrayRecord] | None = None) -> dict[str, np.ndarray]:
        """Each hospital's vector in the clear (the km-times grid; every stage when not secure)."""
        record = {"stage": stage, **inputs}
        msgs = [Message(RecordDict({sv.RECORD: ConfigRecord(record), **(arrays or {})}),
                        dst_node_id=n, message_type=sv.QUERY) for n in self.nodes]
        out = {}
        for reply in self._send(msgs, f"{sv.QUERY} {stage}"):
            name = str(reply.content.config_records[sv.SITE]["name"])
            out[name] = reply.content.array_records[sv.SUMS]["vector"].numpy().astype(np.float64)
        return out

    def total(self, stage: str, inputs: dict[str, Any],
              arrays: Mapping[str, ArrayRecord] | None = None, bits: int | None = None
              ) -> np.ndarray:
        """The sum over hospitals of one stage's vectors."""
        self.sums += 1
        if self.secure is None:
            vectors = self.gather(stage, inputs, arrays)
            self.per_site = vectors
            sizes = {len(v) for v in vectors.values()}
            if len(sizes) != 1:
                raise FederationError(f"Hospitals sent vectors of different lengths for {stage}. "
                                      f"Received: {sorted(sizes)}")
            return np.sum(list(vectors.values()), axis=0)
        return sv.decode_fixed(self._secure_total(stage, inputs, arrays),
                               sv.STAGE_BITS[stage] if bits is None else bits)

    def _ask(self, instructions: dict[int, dict[str, Any]]) -> dict[int, dict[str, Any]]:
        msgs = [Message(RecordDict({pv.SECAGG: ConfigRecord(cfg)}), dst_node_id=node,
                        message_type=pv.SECAGG_QUERY) for node, cfg in instructions.items()]
        return {r.metadata.src_node_id: dict(r.content.config_records[pv.SECAGG])
                for r in self._send(msgs, pv.SECAGG_QUERY)}

    def _secure_total(self, stage: str, inputs: dict[str, Any],
                      arrays: Mapping[str, ArrayRecord] | None = None) -> np.ndarray:
        """One SecAgg+ sum: setup, share-keys, collect (the survival stage), unmask."""
        assert self.secure is not None
        run = SecureSum(self.secure, list(self.nodes), round=self.sums)
        setup = self._ask({n: run.setup_config() for n in run.nodes})
        shared = self._ask(run.share_instructions({n: (r["pk1"], r["pk2"])
                                                   for n, r in setup.items()}))
        collect = run.collect_instructions({n: (list(r["dsts"]), list(r["ciphertexts"]))
                                            for n, r in shared.items()})
        record = {"stage": stage, **inputs}
        msgs = [Message(RecordDict({sv.RECORD: ConfigRecord(record),
                                    pv.SECAGG: ConfigRecord(collect[n]), **(arrays or {})}),
                        dst_node_id=n, message_type=sv.QUERY) for n in collect]
        masked = {r.metadata.src_node_id: r.content.array_records[pv.MASKED]["vector"].numpy()
                  for r in self._send(msgs, f"{sv.QUERY} {stage} (secure)")}
        if len(masked) < len(self.nodes):
            raise FederationError(f"Only {len(masked)} of {len(self.nodes)} hospitals sent their "
                                  f"masked vector; an exact fit needs every hospital. "
                                  f"Received: {len(masked)}")
        unmask = self._ask(run.unmask_instructions(masked))
        return run.total({n: (list(r["nodes"]), list(r["shares"])) for n, r in unmask.items()})


def fit_cox(coord: Coordinator, run: sv.SurvivalRun) -> CoxDocument:
    """The exact stratified Cox fit (module docstring); the cox.json document."""
    started = time.monotonic()
    schema, warnings = coord.schema()
    names, _, references = sv.cox_columns(schema)
    if not names:
        raise FederationError("No covariate is left for the Cox model (every column is the time, "
                              "the event, the ID or ignored). Received: 0 covariates")
    schema_json = schema.to_json()
    p = len(names)
    moments = coord.total("moments", {"schema": schema_json})
    rows, events = round(moments[0]), round(moments[1])
    # derived covariates constant everywhere, or collinear, are left out (protocol.design)
    plan = nt.design(names, derived_features(schema), moments[0], moments[2:2 + p],
                     moments[2 + p:])
    per_site_rows = ({k: int(v[0]) for k, v in coord.per_site.items()}
                     if coord.secure is None else None)
    base = {"schema": schema_json, "mean": plan.mean.tolist(), "std": plan.std.tolist()}

    def evaluate_sum(beta: np.ndarray) -> tuple[float, np.ndarray, np.ndarray]:
        vec = coord.total("newton", {**base, "beta": [float(b) for b in beta]})
        return float(vec[0]), vec[1:1 + p], upper_to_full(vec[1 + p:], p)

    result = nt.fit(plan, evaluate_sum, run.penalizer, max_rounds=run.max_rounds)
    for line in plan.warnings:
        log.warning("Cox design: %s", line)
    table = nt.original_scale(result, plan.used_names, plan.standardization().std)
    pairs = coord.total("concordance", {**base, "beta": [float(b) for b in plan.full(result.beta)]})
    per_site_c = ({k: nt.concordance(*v) for k, v in coord.per_site.items()}
                  if coord.secure is None else None)
    return nt.summary(
        table, result, rows=rows, events=events, penalizer=run.penalizer, hospitals=coord.sites,
        c_index=nt.concordance(*pairs),
        concordance_note="Harrell's C over pairs within each hospital (stratified, as lifelines "
                         "with strata), at the fitted coefficients",
        per_site=CoxSites(rows=per_site_rows, concordance=per_site_c),
        reference_categories=references, left_out=plan.dropped,
        schema_warnings=[*warnings, *plan.warnings],
        secure_aggregation=coord.secure.to_spec() if coord.secure else "off",
        secure_sums=coord.sums, seconds=time.monotonic() - started,
        shared="per hospital: column report; per stage one vector of sums (moments, "
               "log-likelihood/gradient/Hessian per Newton round, concordance pair counts); no "
               "row, time or covariate value")


def upper_to_full(values: np.ndarray, p: int) -> np.ndarray:
    """The symmetric matrix from its upper triangle (row by row, with the diagonal)."""
    out = np.zeros((p, p))
    out[np.triu_indices(p)] = values
    return out + np.triu(out, 1).T


def fit_km(coord: Coordinator, run: sv.SurvivalRun) -> KMDocument:
    """The pooled Kaplan-Meier curve (module docstring); the km.json document."""
    return pooled_km(coord, run.min_count).document


@dataclass(frozen=True)
class PooledCounts:
    """The km exchanges' result: the grid, the pooled counts on it, and the km.json document."""

    grid: np.ndarray
    at_risk: np.ndarray
    events: np.ndarray
    rows: int
    document: KMDocument


def pooled_km(coord: Coordinator, min_count: int, inputs: Mapping[str, Any] | None = None
              ) -> PooledCounts:
    """The km-times and km-counts exchanges (``inputs`` added to both instructions) and the
    pooled curve after the minimum-count rule."""
    times = coord.gather("km-times", dict(inputs or {}))
    coord.sites = sorted(times)
    grid = np.unique(np.concatenate([v for v in times.values()] or [np.zeros(0)]))
    if not len(grid):
        raise FederationError("No hospital has an event: there is no curve to estimate. "
                              "Received: 0 event times")
    counts = coord.total("km-counts", {**(inputs or {}), "grid": [float(g) for g in grid]})
    rows, counts = round(counts[0]), counts[1:]
    at_risk, events = np.rint(counts[:len(grid)]), np.rint(counts[len(grid):])
    curve = kmm.apply_min_count(grid, at_risk, events, min_count)
    doc = KMDocument(
        hospitals=coord.sites, rows=rows, events=int(events.sum()), min_count=min_count,
        curve=curve.points(), secure_aggregation=coord.secure.to_spec() if coord.secure else "off",
        shared="per hospital: its distinct event times (the grid, in the clear), then the number "
               "at risk and number of events at each grid time (summed; secure when on); its own "
               "curve stays beside its data (km-own.json)")
    return PooledCounts(grid, at_risk, events, rows, doc)


@app.main()
def main(grid: Grid, context: Context) -> None:
    """Run the configured survival path; write its document and the history."""
    run = sv.SurvivalRun.from_flower(context.run_config)
    unmask.use_workers(unmask.workers_from(os.environ))  # read once, here (docs/settings.md)
    out = Path(run.out_dir)
    out.mkdir(parents=True, exist_ok=True)
    record = SurvivalAnalysisRecord.start(run.mode, at=time.time())
    record.save(out / HISTORY_FILE)
    try:
        nodes = wait_for_nodes(grid, run.min_nodes, run.round_timeout)
        coord = Coordinator(grid, nodes, run)
        if run.mode == "cox":
            fit_cox(coord, run).save(out / COX_FILE)
        else:
            fit_km(coord, run).save(out / KM_FILE)
    except FedsplitError as e:
        record.end("failed", at=time.time(), error=f"{type(e).__name__}: {e}")
        record.save(out / HISTORY_FILE)
        raise
    record.end("finished", at=time.time())
    record.save(out / HISTORY_FILE)
    log.info("survival %s finished: %s", run.mode, json.dumps({"sums": coord.sums}))
