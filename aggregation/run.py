"""The one entry point every path (Flower, REST, CLI) aggregates through.

`aggregate_updates` guards the inputs (`aggregation.guard`: layout, count, cohort cap, finite
values; failures are excluded with a reason, not fatal), runs the strategy within the memory
budget (fewer accepted updates than its `min_updates` is refused, naming the exclusions), and
returns the aggregate with a report holding one entry per input update: the count used, its
weight, whether and why it was excluded, how often it was trimmed or whether it was selected,
and its L2 distance to the aggregate (``backend.squared_distances`` for rules that leave it
out; a rule with ``fuses_distances``, FedAvg, is asked for them in its own pass).

The finite-value check costs a full read of every update, so for a rule that declares
`AggregationStrategy.checks_values_in_pass` it is fused into the rule's own pass: the guard
skips the scan, the rule's reads (or its weighted sums' and distances' outputs) are checked as
they are consumed, and in the rare case one is not finite (or reading fails) the round is
redone with the full scan. Results and reports are those of the scan either way.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence

from fedsplit.aggregation import backend
from fedsplit.aggregation._blocks import DEFAULT_MEMORY_BUDGET, ValueWatch, check_budget
from fedsplit.aggregation.base import AggregateResult, AggregationStrategy
from fedsplit.aggregation.building_blocks import require_updates
from fedsplit.aggregation.errors import NotEnoughUpdatesError
from fedsplit.aggregation.guard import Expected, guard_updates
from fedsplit.aggregation.settings import DEFAULT_SETTINGS, BackendSettings
from fedsplit.protocol.aggregation_report import SiteReport
from fedsplit.protocol.update import UpdateSource


def aggregate_updates(
    strategy: AggregationStrategy,
    updates: Sequence[UpdateSource],
    *,
    expected: Expected | None = None,
    cohort_caps: Mapping[str, int] | None = None,
    cap_policy: str = "clip",
    memory_budget: int = DEFAULT_MEMORY_BUDGET,
    settings: BackendSettings | None = None,
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
        Working memory (bytes) the strategy may use beyond its output (on the GPU too).
    settings : BackendSettings, optional
        How the passes run (backend mode, device, threads; `aggregation.settings`), built once
        where the command or service starts (``BackendSettings.from_environ(os.environ,
        device=...)``) and used for every pass of this aggregation. Default: the library's
        defaults (`aggregation.settings.DEFAULT_SETTINGS`; nothing is read from the environment).
    """
    if not updates:
        raise NotEnoughUpdatesError("No updates to aggregate. Received: 0 updates")
    check_budget(memory_budget)
    settings = settings if settings is not None else DEFAULT_SETTINGS
    settings.prepare_reads(updates)  # the guard's scans read the files too
    args = (strategy, updates, expected, cohort_caps, cap_policy, memory_budget, settings)
    if getattr(strategy, "checks_values_in_pass", False):
        watch = ValueWatch()
        try:
            result = _guarded(*args, watch=watch)
        except Exception:  # redone below with the full scan, which decides
            watch.flag()
        if not watch.flagged:
            return result
    return _guarded(*args, watch=None)


def _guarded(
    strategy: AggregationStrategy,
    updates: Sequence[UpdateSource],
    expected: Expected | None,
    cohort_caps: Mapping[str, int] | None,
    cap_policy: str,
    memory_budget: int,
    settings: BackendSettings,
    *,
    watch: ValueWatch | None,
) -> AggregateResult:
    guard = guard_updates(
        updates,
        expected=expected,
        cohort_caps=cohort_caps,
        cap_policy=cap_policy,
        memory_budget=memory_budget,
        watch=watch,
        workers=settings.threads,
    )
    if not guard.accepted:
        reasons = "; ".join(f"{r.site}: {r.reason}" for r in guard.reports)
        raise NotEnoughUpdatesError(
            f"Every update was excluded by the input checks, so there is nothing to aggregate. "
            f"Fix the sites' exports and resend. Received: {reasons}"
        )
    excluded = [r for r in guard.reports if r.excluded]
    require_updates(
        strategy,
        len(guard.accepted),
        f"The input checks excluded {len(excluded)} of {len(updates)} updates: "
        + "; ".join(f"{r.site}: {r.reason}" for r in excluded) + "."
        if excluded else "",
    )
    fused = {"distances": True} if strategy.fuses_distances else {}  # in the rule's own pass
    result = strategy.aggregate(guard.accepted, memory_budget=memory_budget, settings=settings,
                                **fused)
    missing = [i for i, s in enumerate(result.report.sites) if s.l2_to_aggregate is None]
    if missing:
        dists = backend.squared_distances(
            [guard.accepted[i] for i in missing], result.arrays, settings=settings,
            memory_budget=memory_budget,
        )
        for i, d in zip(missing, dists.values, strict=True):
            result.report.sites[i].l2_to_aggregate = float(d)
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

