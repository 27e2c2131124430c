"""The coordinator's privacy accounting: `PrivacyHook`, a hook on the round loop
(`server.rounds.RoundLoop`, built by `server.compose`) that records the per-hospital epsilon in
the history every round.

- ``dp`` level ``patient``: hospitals run DP-SGD and report their spent epsilon (``dp-epsilon``
  metric); it is copied to each train site entry as ``epsilon``.
- ``dp`` level ``hospital``: FedAvg of clipped changes plus noise (`aggregation.hospital_dp`),
  its noise multiplier planned for the run; every hospital's entry gets the run's epsilon. The
  hook hands the rule each round's global model first (the changes are clipped against it).
- ``secure-aggregation`` is a merge step of the same loop (`server.secure.merge.SecureMerge`);
  with patient-level dp both run.
"""

from __future__ import annotations

import logging
from collections.abc import Iterator, Mapping

import numpy as np
from fedsplit.aggregation.base import AggregationStrategy
from fedsplit.aggregation.hospital_dp import HospitalDPFedAvg, spent
from fedsplit.protocol.privacy import DPSpec
from fedsplit.server.bookkeeping import Round
from fedsplit.server.history import RunHistory

log = logging.getLogger(__name__)


class SentModel(Mapping[str, np.ndarray]):
    """The tensors round ``rnd`` sent (``rnd.shared``), looked up where the round holds them
    at the time: in memory, or in the files `Round.park` moved them to once the instructions
    were pushed. Handed to the rule as its reference, it keeps no copy of the model alive."""

    def __init__(self, rnd: Round) -> None:
        self.rnd = rnd

    def __getitem__(self, name: str) -> np.ndarray:
        return (self.rnd.shared or {})[name]

    def __iter__(self) -> Iterator[str]:
        return iter(self.rnd.shared or {})

    def __len__(self) -> int:
        return len(self.rnd.shared or {})


class PrivacyHook:
    """Records each hospital's spent epsilon every round (a `server.bookkeeping.RoundHook`);
    under hospital-level DP it hands the rule the round's global model first."""

    def __init__(self, aggregator: AggregationStrategy, history: RunHistory, *, dp: DPSpec) -> None:
        self.aggregator, self.history, self.dp = aggregator, history, dp

    def before(self, rnd: Round) -> None:
        """Hospital-level DP clips against the global model sent this round, read where the
        round holds it when the rule merges (`SentModel`)."""
        if isinstance(self.aggregator, HospitalDPFedAvg) and rnd.shared is not None:
            self.aggregator.set_reference(SentModel(rnd))

    def after(self, rnd: Round) -> None:
        """Record the round's privacy accounting in the run record (`RunHistory.record_privacy`):
        each hospital's reported `DP_EPSILON` (patient level) or the run's epsilon (hospital level)."""
        if isinstance(self.aggregator, HospitalDPFedAvg):
            self.aggregator.set_reference(None)  # the round's model goes with the round
        run_eps = (spent(float(self.aggregator.params.sigma), self.dp.delta, rnd.number)
                   if isinstance(self.aggregator, HospitalDPFedAvg) else None)
        self.history.record_privacy(rnd.number, level=self.dp.level,
                                    epsilon_budget=self.dp.epsilon, delta=self.dp.delta,
                                    run_epsilon=run_eps)
