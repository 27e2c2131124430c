"""The coordinator's privacy accounting: `PrivateStrategy` wraps a run's strategy (built by
`server.compose`) and records the per-hospital epsilon in the history every round.

- ``dp`` level ``patient``: hospitals run DP-SGD and report their spent epsilon (``dp-epsilon``
  metric); it is copied to each train site entry as ``epsilon``.
- ``dp`` level ``hospital``: FedAvg of clipped changes plus noise (`aggregation.hospital_dp`),
  its noise multiplier planned for the run; every hospital's entry gets the run's epsilon.
- ``secure-aggregation`` is another wrapper, `server.secure.strategy.SecureStrategy` (SecAgg+
  rounds; the coordinator sees only the masked sum of count-weighted changes and the total
  count); with patient-level dp this one wraps it.
"""

from __future__ import annotations

import logging
from collections.abc import Iterable

from fedsplit.aggregation.hospital_dp import HospitalDPFedAvg, spent
from fedsplit.protocol.privacy import DPSpec
from fedsplit.server.strategy import StrategyWrapper
from flwr.app import ArrayRecord, ConfigRecord, Message, MetricRecord
from flwr.serverapp import Grid
from flwr.serverapp.strategy import Strategy

log = logging.getLogger(__name__)


class PrivateStrategy(StrategyWrapper):
    """Wraps a strategy (as Flower's DP wrappers do) and records each hospital's spent epsilon
    every round; under hospital-level DP it hands the rule the round's global model first."""

    def __init__(self, strategy: Strategy, *, dp: DPSpec) -> None:
        super().__init__(strategy)
        self.dp = dp

    def configure_train(self, server_round: int, arrays: ArrayRecord, config: ConfigRecord,
                        grid: Grid) -> Iterable[Message]:
        """Hospital-level DP clips against the global model sent this round."""
        if isinstance(self.aggregator, HospitalDPFedAvg):
            self.aggregator.set_reference(self.loop.travelling({k: a.numpy() for k, a in arrays.items()}))
        return self.strategy.configure_train(server_round, arrays, config, grid)

    def aggregate_train(self, server_round: int, replies: Iterable[Message]
                        ) -> tuple[ArrayRecord | None, MetricRecord | None]:
        """The wrapped strategy's aggregation, then every hospital's epsilon in the history."""
        result = self.strategy.aggregate_train(server_round, replies)
        self.record_epsilon(server_round + self.round_offset)
        return result

    def record_epsilon(self, server_round: int) -> None:
        """Record the round's privacy accounting in the run record (`RunHistory.record_privacy`):
        each hospital's reported `DP_EPSILON` (patient level) or the run's epsilon (hospital level)."""
        if self.dp is None:
            return
        run_eps = (spent(float(self.aggregator.params.sigma), self.dp.delta, server_round)
                   if isinstance(self.aggregator, HospitalDPFedAvg) else None)
        self.history.record_privacy(server_round, level=self.dp.level,
                                    epsilon_budget=self.dp.epsilon, delta=self.dp.delta,
                                    run_epsilon=run_eps)

