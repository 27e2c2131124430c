"""The one entry point every path (Flower, REST, CLI) aggregates through.

`aggregate_updates` guards the inputs (`aggregation.guard`: layout, count, cohort cap, finite
values; failures are excluded with a reason, not fatal), runs the strategy within the memory
budget, and returns the aggregate with a report holding one entry per input update: the count
used, its weight, whether and why it was excluded, how often it was trimmed or whether it was
selected, and its L2 distance to the aggregate.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence

import numpy as np

from aggregation._blocks import DEFAULT_MEMORY_BUDGET, BlockReader, plan_blocks, work_dtype
from aggregation.base import AggregateResult, AggregationStrategy, SiteReport
from aggregation.errors import AggregationError, NotEnoughUpdatesError
from aggregation.guard import Expected, guard_updates
from protocol.update import UpdateSource


def aggregate_updates(
    strategy: AggregationStrategy,
    updates: Sequence[UpdateSource],
    *,
    expected: Expected | None = None,
    cohort_caps: Mapping[str, int] | None = None,
    cap_policy: str = "clip",
    memory_budget: int = DEFAULT_MEMORY_BUDGET,
) -> AggregateResult:
    """Guard ``updates``, merge the accepted ones with ``strategy``, and report per site.

    Parameters
    ----------
    strategy : AggregationStrategy
        From `aggregation.get_strategy`.
    updates : Sequence[UpdateSource]
        In-memory `protocol.Update` objects or open `protocol.WeightFile` objects.
    expected : specs, header, update or name -> array, optional
        The round's model layout. Default: the layout shared by more than half the updates.
    cohort_caps : Mapping[str, int], optional
        Registered cohort size per site label; a larger claimed count is clipped or refused.
    cap_policy : {"clip", "refuse"} (default: "clip")
        What happens to a count above its site's cap; the site is flagged either way.
    memory_budget : int (default: 512 MiB)
        Working memory (bytes) the strategy may use beyond its output.
    """
    if not updates:
        raise NotEnoughUpdatesError("No updates to aggregate. Received: 0 updates")
    if isinstance(memory_budget, bool) or not isinstance(memory_budget, int) or memory_budget < 1:
        raise AggregationError(
            f"The memory budget must be a positive number of bytes (e.g. 512MB). "
            f"Received: {memory_budget!r}"
        )
    guard = guard_updates(
        updates,
        expected=expected,
        cohort_caps=cohort_caps,
        cap_policy=cap_policy,
        memory_budget=memory_budget,
    )
    if not guard.accepted:
        reasons = "; ".join(f"{r.site}: {r.reason}" for r in guard.reports)
        raise NotEnoughUpdatesError(
            f"Every update was excluded by the input checks, so there is nothing to aggregate. "
            f"Fix the sites' exports and resend. Received: {reasons}"
        )
    result = strategy.aggregate_bounded(guard.accepted, memory_budget=memory_budget)
    missing = [
        i for i, s in enumerate(result.report.sites) if s.l2_to_aggregate is None
    ]
    if missing:
        dists = distances_to(
            [guard.accepted[i] for i in missing], result.arrays, memory_budget=memory_budget
        )
        for i, d in zip(missing, dists, strict=True):
            result.report.sites[i].l2_to_aggregate = d
    merged: list[SiteReport] = list(guard.reports)
    for k, site in zip(guard.accepted_index, result.report.sites, strict=True):
        pre = guard.reports[k]
        site.flags = [*pre.flags, *site.flags]
        site.claimed_examples = pre.claimed_examples
        merged[k] = site
    result.report.sites = merged
    if result.report.memory_budget is None:
        result.report.memory_budget = memory_budget
    return result


def distances_to(
    updates: Sequence[UpdateSource],
    arrays: Mapping[str, np.ndarray],
    *,
    memory_budget: int = DEFAULT_MEMORY_BUDGET,
) -> list[float]:
    """Return each update's L2 distance to ``arrays`` (all parameters), one update at a time.

    Differences are taken in the working precision (float32 for float16/32 models) block by
    block and summed in float64 across blocks.
    """
    specs = updates[0].header.specs
    work = max((work_dtype(s.dtype) for s in specs), key=lambda d: d.itemsize)
    values = max(1, min(memory_budget // (2 * work.itemsize), max(s.size for s in specs), 1 << 20))
    buf = np.empty(values, dtype=work)
    out = []
    for u in updates:
        reader = BlockReader(u)
        total = 0.0
        for block in plan_blocks(specs, values):
            diff = buf[: block.size]
            ref = np.asarray(arrays[block.name]).reshape(-1)[block.start : block.stop]
            vals = reader.view(block)
            if vals is None:
                reader.read(block, diff)
                np.subtract(diff, ref, out=diff, casting="unsafe")
            else:
                np.subtract(vals, ref, out=diff, casting="unsafe")
            total += float(np.dot(diff, diff))
        reader.release()
        out.append(float(np.sqrt(total)))
    return out
