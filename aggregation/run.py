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

from aggregation._blocks import DEFAULT_MEMORY_BUDGET, Block, BlockReader, plan_blocks, work_dtype
from aggregation._threads import map_threads, round_robin, threads_for
from aggregation.base import AggregateResult, AggregationStrategy, SiteReport
from aggregation.errors import AggregationError, NotEnoughUpdatesError
from aggregation.guard import Expected, guard_updates
from protocol.update import UpdateSource

#: Coordinates per block of the distance pass: the aggregate's block stays in the L2 cache.
DISTANCE_BLOCK = 131_072


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
    """Return each update's L2 distance to ``arrays`` (all parameters).

    Block by block (each block of ``arrays`` stays in cache while every update's block is
    compared with it, so each input byte is read once), blocks shared out among worker
    threads. Differences are taken in the working precision (float32 for float16/32 models);
    squares are summed in float64.
    """
    specs = updates[0].header.specs
    work = max((work_dtype(s.dtype) for s in specs), key=lambda d: d.itemsize)
    size = sum(s.size for s in specs)
    # at least this many blocks, as blocks are at most DISTANCE_BLOCK long
    threads = threads_for(len(updates) * size, -(-size // DISTANCE_BLOCK))
    length = max(1, min(DISTANCE_BLOCK, memory_budget // (threads * work.itemsize), size))
    blocks = plan_blocks(specs, length)

    def squares(part: Sequence[Block]) -> np.ndarray:
        readers = [BlockReader(u) for u in updates]
        buf = np.empty(length, dtype=work)
        total = np.zeros(len(updates), dtype=np.float64)
        for block in part:
            ref = np.asarray(arrays[block.name]).reshape(-1)[block.start : block.stop]
            diff = buf[: block.size]
            for k, reader in enumerate(readers):
                vals = reader.view(block)
                if vals is None:
                    reader.read(block, diff)
                    np.subtract(diff, ref, out=diff, casting="unsafe")
                else:
                    np.subtract(vals, ref, out=diff, casting="unsafe")
                total[k] += float(np.dot(diff, diff))
        for reader in readers:
            reader.release()
        return total

    parts = map_threads(squares, threads, round_robin(blocks, threads))
    return [float(np.sqrt(t)) for t in np.sum(parts, axis=0)]
