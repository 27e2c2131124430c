"""Hospital-level differential privacy at the coordinator: clip, count-weight, add noise.

`HospitalDPFedAvg` wraps count-weighted FedAvg (Flower's server-side fixed clipping refuses
unequal weights; this one keeps them). With the round's global model ``g`` (`set_reference`),
hospital k's update ``w_k`` (count ``n_k``, total ``N``) contributes its change clipped to norm
``C`` over all trainable parameters:

    d_k = (w_k - g) * min(1, C / ||w_k - g||)
    z   = g + sum_k (n_k / N) d_k + Normal(0, (sigma * C * max_k n_k / N)^2 I)

Sensitivity. The counts are public here (the coordinator sees them; `docs/privacy.md`), so the
weights ``p_k = n_k / N`` are fixed numbers. Two neighbouring rounds differ in one hospital's
contribution being present or replaced by zero (add/remove adjacency on updates, as in
DP-FedAvg, McMahan et al. 2018): ``sum_k p_k d_k`` moves by ``p_j ||d_j|| <= p_max C``. The
noise standard deviation ``sigma * p_max * C`` makes each round a Gaussian mechanism with noise
multiplier ``sigma``. Every hospital takes part in every accounted round (no sampling
amplification is claimed: ``sample_rate=1``), so ``R`` rounds are ``R`` compositions, which
Opacus's RDP accountant converts to (epsilon, delta) (`plan_sigma`, `spent`).

What it protects: whether any one hospital (all its patients at once) took part, against
anyone who sees the global models, as long as the coordinator itself adds the noise honestly.
Buffers (the agreed standardisation) are not trained: the global value is kept for them. Runs
with BatchNorm are refused by the runners (its running statistics would travel unnoised).

Computation. The arithmetic over the updates is the backend's (`aggregation.backend`), as for
every other rule, over the trained tensors only (`TrainedOnly`): one ``squared_distances`` pass
gives each change's norm ``||w_k - g||``; one ``weighted_sum`` pass over the updates and ``g``
itself, with weights ``q_k = (n_k / N) min(1, C / ||w_k - g||)`` and ``1 - sum_k q_k`` for ``g``,
gives ``g + sum_k (n_k / N) d_k`` (the weights sum to 1 and none is negative, so nothing is
subtracted and nothing cancels). The noise is added per tensor in float64, in the order of the
model's tensors. The report's ``working_bytes`` is the larger of the two passes' working memory
and the noise step's (two float64 copies of the largest trained tensor).
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from dataclasses import replace

import numpy as np
from fedsplit.aggregation import backend
from fedsplit.aggregation._blocks import DEFAULT_MEMORY_BUDGET, Recounted
from fedsplit.aggregation.base import AggregateResult, AggregationStrategy, StrategyParams
from fedsplit.aggregation.building_blocks import inputs_of, make_result, site_reports
from fedsplit.aggregation.errors import AggregationError
from fedsplit.aggregation.settings import DEFAULT_SETTINGS, BackendSettings
from fedsplit.protocol.update import Update, UpdateHeader, UpdateSource

#: parameter-name endings of trained tensors; everything else is a buffer kept at the global value
TRAINED = (".weight", ".bias")


def is_trained(name: str) -> bool:
    """Whether the array called ``name`` is a trained parameter (not a fixed buffer)."""
    return name.endswith(TRAINED)


class TrainedOnly(Recounted):
    """An update seen through its trained tensors only (`is_trained`), for the backend's passes.

    Its header lists only those tensors; reads still reach the update where it lies (a weight
    file is read in place: `aggregation._blocks.base` unwraps it), and a value watch on it still
    flags non-finite values."""

    def __init__(self, source: UpdateSource) -> None:
        super().__init__(source, source.header.num_examples)
        self.trained: UpdateHeader = replace(
            source.header, specs=tuple(s for s in source.header.specs if is_trained(s.name)))

    @property
    def header(self) -> UpdateHeader:
        """The wrapped header, with the trained tensors only."""
        return self.trained


def plan_sigma(epsilon: float, delta: float, rounds: int) -> float:
    """Noise multiplier keeping ``rounds`` Gaussian rounds (no sampling) within (epsilon, delta)."""
    from opacus.accountants.utils import get_noise_multiplier

    return float(get_noise_multiplier(target_epsilon=epsilon, target_delta=delta, sample_rate=1.0,
                                      steps=rounds, accountant="rdp"))


def spent(sigma: float, delta: float, rounds_done: int) -> float:
    """Epsilon after ``rounds_done`` noised rounds (Opacus RDP accountant)."""
    if rounds_done <= 0:
        return 0.0
    from opacus.accountants import RDPAccountant

    accountant = RDPAccountant()
    accountant.history = [(sigma, 1.0, rounds_done)]
    return float(accountant.get_epsilon(delta=delta))


class HospitalDPParams(StrategyParams):
    """Clip norm and noise multiplier (set by the runner from the ``dp`` spec)."""

    clip: float = 1.0
    sigma: float = 1.0


class HospitalDPFedAvg(AggregationStrategy):
    """Count-weighted FedAvg of clipped updates plus Gaussian noise (see the module docstring)."""

    name = "fedavg+hospital-dp"
    summary = "FedAvg of norm-clipped changes plus Gaussian noise calibrated to the largest weight."
    Params = HospitalDPParams

    def __init__(self, params: StrategyParams | None = None, *, seed: int | None = None) -> None:
        super().__init__(params)
        self.reference: Mapping[str, np.ndarray] | None = None
        self._rng = np.random.default_rng(seed)

    def set_reference(self, arrays: Mapping[str, np.ndarray] | None) -> None:
        """The global model the round's hospitals started from (None: none now). The mapping
        is kept as given and read when the round aggregates, so one that looks the tensors up
        where the coordinator holds them then (parked on disk once sent) holds no copy."""
        self.reference = arrays

    def aggregate(self, updates: Sequence[UpdateSource], *,
                  memory_budget: int = DEFAULT_MEMORY_BUDGET,
                  settings: BackendSettings = DEFAULT_SETTINGS) -> AggregateResult:
        """Clip each change, weight by count, add noise of std ``sigma * C * max share``, with
        the backend's passes (module docstring)."""
        if self.reference is None:
            raise AggregationError("Hospital-level DP clips each update's change to the round's "
                                   "global model; set_reference was not called. Received: none")
        inputs = inputs_of(self, updates)
        names = [s.name for s in inputs.specs]
        if missing := [n for n in names if n not in self.reference]:
            raise AggregationError(f"The updates hold parameters the global model lacks. "
                                   f"Received: {missing[:5]}")
        clip, sigma = float(self.params.clip), float(self.params.sigma)
        shares = inputs.counts / inputs.counts.sum()
        trained = [s for s in inputs.specs if is_trained(s.name)]
        views = [TrainedOnly(u) for u in updates]
        # the global model's trained tensors, in the updates' layout
        start = {s.name: np.asarray(self.reference[s.name], dtype=s.dtype) for s in trained}
        working = 0
        norms = [0.0] * len(updates)
        if trained:
            dist = backend.squared_distances(views, start, settings=settings,
                                             memory_budget=memory_budget)
            norms = [float(v) for v in dist.values]
            working = dist.working_bytes
        scales = [min(1.0, clip / n) if n > 0 else 1.0 for n in norms]
        std = sigma * clip * float(shares.max())
        out: dict[str, np.ndarray] = {}
        if trained:
            # g + sum_k q_k (w_k - g) = sum_k q_k w_k + (1 - sum_k q_k) g: one weighted sum
            kept = shares * np.asarray(scales)
            weights = [*kept, max(0.0, 1.0 - float(kept.sum()))]
            mean = backend.weighted_sum([*views, Update(arrays=start, num_examples=1)], weights,
                                        settings=settings, memory_budget=memory_budget)
            working = max(working, mean.working_bytes,
                          2 * 8 * max(s.size for s in trained))  # the noise step, per tensor
        for spec in inputs.specs:
            if not is_trained(spec.name):  # buffers keep the global value
                out[spec.name] = np.asarray(self.reference[spec.name], np.float64).astype(spec.dtype)
                continue
            noised = mean.arrays[spec.name].astype(np.float64)
            noised += self._rng.normal(0.0, std, size=spec.shape)
            out[spec.name] = noised.astype(spec.dtype)
        sites = site_reports(inputs.headers, shares,
                             flags=[["clipped"] if s < 1 else [] for s in scales])
        details = {"clip": clip, "noise_multiplier": sigma, "noise_std": std,
                   "update_norms": norms, "clipped": int(sum(s < 1 for s in scales))}
        return make_result(self, inputs, out, sites, memory_budget=memory_budget,
                           working_bytes=working, details=details)
