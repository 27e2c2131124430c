"""Aggregate a round: stream its stored files through `aggregation.aggregate_updates`."""

from __future__ import annotations

import contextlib
import time

import numpy as np

import aggregation
from protocol.arrays import ArraySpec
from protocol.weights import open_weights, write_weights
from server.admin.context import AdminContext
from server.admin.errors import ConflictError
from server.admin.services.rounds import AGGREGATED, get_round
from server.admin.tables import Round, utcnow


def _expected(rnd: Round) -> tuple[ArraySpec, ...] | None:
    if not rnd.model_specs:
        return None
    return tuple(
        ArraySpec(s["name"], tuple(s["shape"]), np.dtype(s["dtype"])) for s in rnd.model_specs
    )


def aggregate_round(ctx: AdminContext, round_id: int) -> Round:
    """Run the round's strategy over its current uploads; store the model and the report."""
    with ctx.aggregate_lock, ctx.sessions() as session:
        rnd = get_round(session, round_id)
        if rnd.status == AGGREGATED:
            raise ConflictError(
                f"Round {round_id} is already aggregated; download its model with GET "
                f"/api/v1/rounds/{round_id}/model, or create a round that continues it. "
                f"Received: status {rnd.status!r}"
            )
        current = [u for u in rnd.uploads if u.current]
        if len(current) < rnd.min_uploads:
            raise ConflictError(
                f"Round {round_id} has {len(current)} upload(s) but needs {rnd.min_uploads} "
                f"(min_uploads) before it can be aggregated. Wait for more sites. "
                f"Received: {len(current)} upload(s)"
            )
        strategy = aggregation.get_strategy(rnd.strategy, rnd.params)
        started = time.perf_counter()
        with contextlib.ExitStack() as stack:
            # Files are opened, not read: the strategy streams parameters from disk.
            files = [
                stack.enter_context(
                    open_weights(ctx.files.absolute(u.weights_file), default_site=u.site.name)
                )
                for u in current
            ]
            result = aggregation.aggregate_updates(
                strategy,
                files,
                expected=_expected(rnd),
                cohort_caps={u.site.name: u.site.cohort_size for u in current if u.site.cohort_size},
                cap_policy="refuse",
                memory_budget=ctx.settings.aggregation_memory_mb * 1024 * 1024,
            )
            models = {f.header.model for f in files} - {None}
        target = ctx.files.round_dir(round_id) / "model.h5"
        write_weights(
            result.to_update(
                site="aggregate", round=round_id, model=models.pop() if len(models) == 1 else None
            ),
            target,
        )
        seconds = time.perf_counter() - started
        report = result.report.to_dict()
        ctx.files.write_json(report, ctx.files.round_dir(round_id) / "report.json")
        rnd.status = AGGREGATED
        rnd.model_file = ctx.files.relative(target)
        rnd.report = report
        rnd.num_examples = result.num_examples
        rnd.aggregation_seconds = seconds
        rnd.aggregated_at = utcnow()
        session.commit()
        session.refresh(rnd)
        for u in rnd.uploads:  # load what the response needs before the session closes
            _ = u.site.name
    ctx.metrics.aggregation_done(seconds)
    return rnd
