"""The coordinator's privacy modes: which strategy class and aggregator a run gets, and the
per-hospital epsilon recorded in the history.

- ``dp`` level ``patient``: hospitals run DP-SGD and report their spent epsilon (``dp-epsilon``
  metric); it is copied to each train site entry as ``epsilon``.
- ``dp`` level ``hospital``: FedAvg of clipped changes plus noise (`aggregation.hospital_dp`),
  its noise multiplier planned for the run; every hospital's entry gets the run's epsilon.
- ``secure-aggregation``: `server.secure.strategy.SecureStrategy` (SecAgg+ rounds; the
  coordinator sees only the masked sum of count-weighted changes and the total count).
"""

from __future__ import annotations

import logging
from collections.abc import Iterable
from typing import Any

from fedsplit.aggregation.base import AggregationStrategy
from fedsplit.aggregation.hospital_dp import HospitalDPFedAvg, HospitalDPParams, plan_sigma, spent
from fedsplit.protocol.config import RunConfig
from fedsplit.protocol.privacy import DPSpec, SecureSpec, check_run
from fedsplit.server.strategy import RegistryStrategy
from flwr.app import ArrayRecord, ConfigRecord, Message, MetricRecord
from flwr.serverapp import Grid

log = logging.getLogger(__name__)


def privacy_aggregator(cfg: RunConfig, aggregator: AggregationStrategy) -> AggregationStrategy:
    """The run's aggregator under its privacy settings (refusing combinations that cannot work)."""
    check_run(dp=cfg.dp, secure=cfg.secure_aggregation, strategy=aggregator.name,
              attack=cfg.attack, norm=cfg.norm, proximal_mu=cfg.proximal_mu, parallel=cfg.parallel)
    dp = DPSpec.parse(cfg.dp)
    if dp is None or dp.level != "hospital":
        return aggregator
    sigma = plan_sigma(dp.epsilon, dp.delta, dp.rounds or cfg.num_server_rounds)
    return HospitalDPFedAvg(HospitalDPParams(clip=dp.clip, sigma=sigma), seed=cfg.seed)


class PrivateStrategy(RegistryStrategy):
    """`RegistryStrategy` that records each hospital's spent epsilon every round."""

    def __init__(self, aggregator: AggregationStrategy, *args: Any, dp: DPSpec | None = None,
                 **kwargs: Any) -> None:
        super().__init__(aggregator, *args, **kwargs)
        self.dp = dp

    def configure_train(self, server_round: int, arrays: ArrayRecord, config: ConfigRecord,
                        grid: Grid) -> list[Message]:
        """Hospital-level DP clips against the global model sent this round."""
        if isinstance(self.aggregator, HospitalDPFedAvg):
            self.aggregator.set_reference({k: a.numpy() for k, a in arrays.items()})
        return super().configure_train(server_round, arrays, config, grid)

    def aggregate_train(self, server_round: int, replies: Iterable[Message]
                        ) -> tuple[ArrayRecord | None, MetricRecord | None]:
        """Aggregate as usual, then record every hospital's epsilon in the round's history."""
        result = super().aggregate_train(server_round, replies)
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


def strategy_class(cfg: RunConfig) -> type[RegistryStrategy]:
    """The strategy class the run needs: secure (secure-aggregation set), private (dp set) or
    the plain registry strategy."""
    if SecureSpec.parse(cfg.secure_aggregation) is not None:
        from fedsplit.server.secure.strategy import SecureStrategy  # imports this module

        return SecureStrategy
    if DPSpec.parse(cfg.dp) is not None:
        return PrivateStrategy
    return RegistryStrategy


def strategy_kwargs(cfg: RunConfig) -> dict[str, Any]:
    """The extra constructor arguments `strategy_class` needs."""
    cls = strategy_class(cfg)
    if cls is RegistryStrategy:
        return {}
    if cls is PrivateStrategy:
        return {"dp": DPSpec.parse(cfg.dp)}
    return {"dp": DPSpec.parse(cfg.dp), "secure": SecureSpec.parse(cfg.secure_aggregation),
            "timeout": cfg.round_timeout}
