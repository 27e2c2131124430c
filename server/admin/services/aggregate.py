"""Aggregate a round: its stored files through `aggregation.files.aggregate_files`."""

from __future__ import annotations

import time

from fedsplit.aggregation.files import aggregate_files
from fedsplit.server.admin.context import AdminContext
from fedsplit.server.admin.errors import ConflictError
from fedsplit.server.admin.services.rounds import AGGREGATED, get_round
from fedsplit.server.admin.tables import Round, utcnow

from fedsplit import aggregation


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
        folder = ctx.files.round_dir(round_id)
        # Files are opened, not read: the strategy streams parameters from disk.
        done = aggregate_files(
            strategy,
            [ctx.files.absolute(u.weights_file) for u in current],
            folder / "model.h5",
            report_path=folder / "report.json",
            labels=[u.site.name for u in current],
            counts=[u.num_examples for u in current],  # as recorded: the file is stored as sent
            expected=rnd.specs,
            cohort_caps={u.site.name: u.site.cohort_size for u in current if u.site.cohort_size},
            cap_policy="refuse",
            memory_budget=ctx.settings.aggregation_memory_mb * 1024 * 1024,
            round_id=round_id,
            settings=ctx.backend,
        )
        seconds = time.perf_counter() - started
        result = done.result
        report = result.report.to_json()
        rnd.status = AGGREGATED
        rnd.model_file = ctx.files.relative(done.weights_path)
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
