"""Geometric median by smoothed Weiszfeld iterations: RFA (Pillutla, Kakade, Harchaoui 2022).

The geometric median z minimises the count-weighted sum of Euclidean distances (all parameters
of a model form one vector)

    g(z) = sum_k n_k * ||w_k - z||

and moves by a bounded amount whatever a minority of sites (holding under half the total
count) send, where the mean follows any one of them arbitrarily far. Smoothed Weiszfeld
iterations ("Robust Aggregation for Federated Learning", Algorithm 2):

    z_0 = sum_k n_k w_k / sum_k n_k                      (FedAvg)
    alpha_k = n_k / max(nu, ||w_k - z_t||)
    z_{t+1} = sum_k alpha_k w_k / sum_k alpha_k

Stopping rule: after computing z_t (t >= 1) and its distances, stop when t = ``max_iter`` or
when the objective's relative improvement is at most ``eps``,
``g(z_{t-1}) - g(z_t) <= eps * g(z_{t-1})`` (so a step that does not lower g stops it, even
with ``eps=0``). When g(z_t) = 0 (every update equals z_t) nothing is left to improve and no
iteration follows. The result is the last z_t.

Each iteration is exactly one count-weighted average with weights alpha_k (one streamed
``backend.weighted_sum`` pass) plus one pass computing every site's distance to the new z
(``backend.squared_distances``; `aggregation.backend`). The average needs only
``sum_k alpha_k w_k`` and ``sum_k alpha_k``, and each alpha_k only site k's own distance to
the broadcast z, so the rule can also run on securely aggregated weighted sums, each site
computing its distance locally: secure aggregation runs the same iteration (`weiszfeld`) that
way, one secure sum per step (`GeometricMedian.iterate_on_sums`, `server.secure.merge`).

Iterations: close updates converge in 2-3 (the ``eps`` rule stops them). A far-off minority
holding a share q of the count pulls z_0 (the mean) a distance D towards it, and each iteration
shrinks that pull by about q / (1 - q): 3 of 10 sites sending values 10^4 times too large need
14 iterations at the default ``eps``, hence the default cap of 50 (after 10: still 20x the
honest sites' spread away; `tests/aggregation/test_geometric_median.py`).

Memory: nothing is stacked; the iterate z is the output buffer itself (a mean pass does not
read it), and each pass holds a few cache-sized buffers per thread, within the memory budget.
Reads: (``max_iter`` + 1) x 2 passes over the updates at most.

Report: per site its final Weiszfeld weight share alpha_k / sum alpha (the weights that
produced the returned z; count shares when no iteration ran) and its distance to z;
``details`` holds the iterations run, the objective after each, and why it stopped.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import Any, Generic, TypeVar

import numpy as np
from fedsplit.aggregation import backend
from fedsplit.aggregation._blocks import DEFAULT_MEMORY_BUDGET
from fedsplit.aggregation.base import AggregateResult, AggregationStrategy, StrategyParams
from fedsplit.aggregation.building_blocks import inputs_of, make_result, shares_of, site_reports
from fedsplit.aggregation.registry import register
from fedsplit.aggregation.settings import DEFAULT_SETTINGS, BackendSettings
from fedsplit.protocol.update import UpdateSource
from pydantic import Field

Point = TypeVar("Point")
#: one secure Weiszfeld step at a broadcast point: (g(point), the next point)
SumStep = Callable[[dict[str, np.ndarray]], tuple[float, dict[str, np.ndarray]]]


class WeiszfeldStop(Exception):
    """Raised by a step that cannot be taken (e.g. a secure sum failed, or no hospital is left):
    the iteration ends at the last point, the message saying why."""


@dataclass
class WeiszfeldRun(Generic[Point]):
    """Where `weiszfeld` ended: the point, g after each step, why it stopped."""

    point: Point
    objectives: list[float]
    stopped: str  # converged, exact, max_iter, or a step's WeiszfeldStop message


def weiszfeld(step: Callable[[Point], tuple[float, Callable[[], Point]]], start: Point, *,
              max_iter: int, eps: float) -> WeiszfeldRun[Point]:
    """Smoothed Weiszfeld iterations from z_0 = ``start`` with the module docstring's stopping rule.

    ``step(z_t)`` returns ``(g(z_t), advance)``; ``advance()`` returns z_{t+1} (the weighted mean
    with alpha_k = n_k / max(nu, ||w_k - z_t||)) and is called only when the iteration goes on.
    In memory (`GeometricMedian.aggregate`) a step is one distance pass and ``advance`` one
    weighted-mean pass; under secure aggregation (`GeometricMedian.iterate_on_sums`) one secure
    sum gives both. At most ``max_iter`` advances and ``max_iter + 1`` steps.
    """
    point, objectives, stopped = start, [], "max_iter"
    for t in range(max_iter + 1):
        try:
            objective, advance = step(point)
        except WeiszfeldStop as e:
            stopped = str(e)
            break
        objectives.append(objective)
        if objective == 0.0:  # every update equals z: nothing left to improve
            stopped = "exact"
            break
        if t and objectives[-2] - objective <= eps * objectives[-2]:
            stopped = "converged"
            break
        if t == max_iter:
            break
        try:
            point = advance()
        except WeiszfeldStop as e:
            stopped = str(e)
            break
    return WeiszfeldRun(point, objectives, stopped)


class GeometricMedianParams(StrategyParams):
    """Parameters of the geometric median (smoothed Weiszfeld)."""

    max_iter: int = Field(
        default=50,
        ge=1,
        le=1000,
        description=(
            "Most Weiszfeld iterations after the count-weighted mean it starts from; each one "
            "reads every update twice. Close updates converge in 2-3 (eps stops them); a far-off "
            "minority holding a share q of the count needs about log(distance)/log((1-q)/q)."
        ),
    )
    eps: float = Field(
        default=1e-5,
        ge=0.0,
        allow_inf_nan=False,
        description=(
            "Stop when an iteration lowers the objective sum_k n_k ||w_k - z|| by at most eps "
            "times its previous value (0: only once it stops decreasing, or at max_iter)."
        ),
    )
    nu: float = Field(
        default=1e-6,
        gt=0.0,
        allow_inf_nan=False,
        description=(
            "Smoothing: a distance below nu counts as nu in the weights n_k / max(nu, "
            "||w_k - z||), so an update that z reaches does not get an infinite weight."
        ),
    )


@register
class GeometricMedian(AggregationStrategy):
    """Count-weighted geometric median of the updates (RFA)."""

    name = "geometric-median"
    checks_values_in_pass = True  # every value goes through the block passes
    #: each Weiszfeld step is one weighted mean whose weights a hospital computes alone from
    #: the broadcast point: under secure aggregation, one secure sum per step (`iterate_on_sums`)
    iterative_on_sums = True
    summary = (
        "Geometric median (RFA, Pillutla et al. 2022): the point with the smallest count-weighted "
        "sum of distances to the updates, by smoothed Weiszfeld iterations (each one weighted "
        "average); tolerates sites holding under half the count sending arbitrary updates."
    )
    Params = GeometricMedianParams

    def aggregate(
        self, updates: Sequence[UpdateSource], *, memory_budget: int = DEFAULT_MEMORY_BUDGET,
        settings: BackendSettings = DEFAULT_SETTINGS,
    ) -> AggregateResult:
        """Return the smoothed-Weiszfeld geometric median, streamed within the budget."""
        inputs = inputs_of(self, updates)
        counts = inputs.counts.astype(np.float64)
        nu = float(self.params.nu)
        # the weight shares that produced the returned z (count shares when no step ran) and
        # every site's distance to it, for the report
        last: dict[str, np.ndarray] = {"share": shares_of(counts, len(counts))}
        mean = backend.weighted_sum(updates, counts, settings=settings, memory_budget=memory_budget)
        z, working = mean.arrays, mean.working_bytes

        def step(point: dict[str, np.ndarray]) -> tuple[float, Callable[[], dict[str, np.ndarray]]]:
            nonlocal working
            dist = backend.squared_distances(updates, point, settings=settings,
                                             memory_budget=memory_budget)
            working = max(working, dist.working_bytes)
            last["dist"] = dist.values

            def advance() -> dict[str, np.ndarray]:
                alpha = counts / np.maximum(nu, dist.values)
                last["share"] = shares_of(alpha, len(alpha))
                backend.weighted_sum(updates, alpha, settings=settings, memory_budget=memory_budget,
                                     out=point)
                return point  # the iterate is the output buffer itself

            return float(counts @ dist.values), advance

        run = weiszfeld(step, z, max_iter=int(self.params.max_iter), eps=float(self.params.eps))
        objectives, stopped = run.objectives, run.stopped
        sites = site_reports(inputs.headers, last["share"], l2_to_aggregate=last["dist"])
        details = {
            "iterations": len(objectives) - 1,
            "objective": objectives,
            "stopped": stopped,
        }
        return make_result(
            self, inputs, z, sites,
            memory_budget=memory_budget, working_bytes=working, details=details,
        )

    def iterate_on_sums(self, step: SumStep, start: dict[str, np.ndarray]
                        ) -> tuple[dict[str, np.ndarray], dict[str, Any]]:
        """The same iteration (`weiszfeld`) where each step is one secure sum: ``step(z_t)``
        returns (g(z_t), z_{t+1}) at once, or raises `WeiszfeldStop` (the iteration then ends
        at the last point). ``start``: the secure count-weighted mean z_0. Returns the point
        and ``details`` (secure sums taken, the objective after each, why it stopped)."""
        def lazy(point: dict[str, np.ndarray]) -> tuple[float, Callable[[], dict[str, np.ndarray]]]:
            objective, nxt = step(point)
            return objective, lambda: nxt

        run = weiszfeld(lazy, start, max_iter=int(self.params.max_iter), eps=float(self.params.eps))
        return run.point, {"steps": len(run.objectives), "objectives": run.objectives,
                           "stopped": run.stopped}

