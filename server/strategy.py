"""`RegistryStrategy`: fedsplit's round loop as a Flower strategy, for users of Flower's API.

fedsplit's coordinator runs its rounds with its own loop, `server.rounds.RoundLoop` (one
message per hospital per round; plain or secure merge steps; the dp hook). A Flower user who
keeps Flower's ``Strategy.start`` (train, then a separate evaluate phase, every round) gets the
same merge and the same run record through this thin adapter: a `FedAvg` whose hooks call the
loop's steps instead of Flower's aggregation.

- ``configure_train``: the loop opens the round (`RoundLoop.open`: the model sent, the tensors
  that travel), waits for a quorum (else the round is skipped, with the reason recorded), then
  Flower's own sampling builds the instructions;
- ``aggregate_train``: the loop closes the round (`RoundLoop.close`): the plain merge step
  (`server.merge.PlainMerge`: replies checked against the wire contract, excluded with their
  reason, merged with the registry rule by `aggregation.aggregate_updates`), the server
  optimizer's step, the tensors that do not travel put back, the history write;
- ``configure_evaluate`` / ``aggregate_evaluate``: Flower's sampling, then the loop records the
  evaluation (`RoundLoop.evaluated`, `server.merge.Evaluation`), which ends the round's time.

Flower's round numbers are recorded as they are (Flower's ``start`` does not resume; the
coordinator's loop does).

What a Flower user passes to `FedAvg` is honoured: the sampling arguments (``fraction_*``,
``min_*_nodes``) drive Flower's own sampling; ``weighted_by_key`` names the metric that weights
each reply, both as the update's count and in metric averaging; ``train_metrics_aggr_fn`` and
``evaluate_metrics_aggr_fn`` (Flower's signature ``(list[RecordDict], str) -> MetricRecord``)
replace the default metric averaging, which weights every metric by the weight key and
averages list-valued metrics elementwise, as Flower's ``aggregate_metricrecords``.
``arrayrecord_key`` and ``configrecord_key`` are fixed by the wire contract (``"arrays"``,
``"config"``); any other value, and any argument of another Flower strategy, is refused at
construction with an error naming it.
"""

from __future__ import annotations

import logging
from collections.abc import Iterable, Mapping, Sequence
from typing import Any

from fedsplit.aggregation.base import AggregationStrategy
from fedsplit.aggregation.server_optimizers import ServerOptimizer
from fedsplit.protocol import horizontal_wire as wire
from fedsplit.protocol.errors import ConfigError
from fedsplit.server.bookkeeping import Round
from fedsplit.server.history import RunHistory
from fedsplit.server.merge import Evaluation, MetricsAggrFn, PlainMerge
from fedsplit.server.rounds import RoundLoop
from flwr.app import ArrayRecord, ConfigRecord, Message, MetricRecord
from flwr.serverapp import Grid
from flwr.serverapp.strategy import FedAvg

from fedsplit import aggregation

log = logging.getLogger(__name__)


class RegistryStrategy(FedAvg):
    """Flower `FedAvg` whose aggregation and record are fedsplit's round loop's (module docstring).

    Parameters
    ----------
    aggregator : AggregationStrategy
        The registry strategy that merges training replies (``aggregation.get_strategy``).
    history : RunHistory
        Where each round's sites, report, metrics and global model are recorded.
    quorum : int (default: 1)
        Fewest hospitals a round needs: it waits (at most ``deadline``) for that many to be
        connected, and updates the global model only from at least that many usable replies
        (counted after the input checks).
    deadline : float | None (default: None)
        The per-phase reply deadline, used to bound the wait for a quorum and named in the
        history when a sampled hospital did not answer in time.
    cohort_caps : dict[str, int] | None (default: None)
        Registered cohort size per site; a larger claimed count is clipped or refused.
    cap_policy : str (default: "clip")
        ``clip`` or ``refuse`` (see `aggregation.guard`).
    fraction_train, fraction_evaluate, min_train_nodes, min_evaluate_nodes, min_available_nodes
        Flower's sampling arguments, used by Flower's own sampling.
    weighted_by_key : str (default: "num-examples")
        The reply metric whose value (an integer >= 1) weights each reply, in aggregation and
        in metric averaging; dropped from the averaged metrics, as in Flower.
    arrayrecord_key, configrecord_key : str (default: "arrays", "config")
        Fixed by the wire contract; another value is refused.
    train_metrics_aggr_fn, evaluate_metrics_aggr_fn : callable | None (default: None)
        ``(list[RecordDict], weighted_by_key) -> MetricRecord``, called with the usable replies'
        contents; None: the weighted mean (`server.merge.weighted_mean`).
    server_optimizer : ServerOptimizer | None (default: None)
        A server optimizer stepping on the pseudo-gradient of the rule's aggregate.
    federated : Sequence[str] | None (default: None)
        The tensors that travel back from the hospitals; None: every tensor.
    site_names : Mapping[int, str] | None (default: None)
        Node id -> hospital name, so a hospital whose ClientApp failed is named, never numbered.
    backend : aggregation.BackendSettings | None (default: None)
        How the merges' passes run (`server.merge.PlainMerge`).
    **unsupported
        Any other argument (e.g. FedAvgM's ``server_momentum``) is refused with `ConfigError`.
    """

    def __init__(self, aggregator: AggregationStrategy, history: RunHistory, *, quorum: int = 1,
                 deadline: float | None = None,
                 cohort_caps: dict[str, int] | None = None, cap_policy: str = "clip",
                 fraction_train: float = 1.0, fraction_evaluate: float = 1.0,
                 min_train_nodes: int = 2, min_evaluate_nodes: int = 2,
                 min_available_nodes: int = 2, weighted_by_key: str = wire.NUM_EXAMPLES,
                 arrayrecord_key: str = wire.ARRAYS, configrecord_key: str = wire.CONFIG,
                 train_metrics_aggr_fn: MetricsAggrFn | None = None,
                 evaluate_metrics_aggr_fn: MetricsAggrFn | None = None,
                 server_optimizer: ServerOptimizer | None = None,
                 federated: Sequence[str] | None = None,
                 site_names: Mapping[int, str] | None = None,
                 backend: aggregation.BackendSettings | None = None,
                 **unsupported: Any) -> None:
        if unsupported:
            raise ConfigError(
                f"RegistryStrategy cannot honour {sorted(unsupported)}: it runs Flower's FedAvg "
                f"sampling and merges with a fedsplit registry rule (aggregator), so only "
                f"FedAvg's arguments apply. Choose the merge rule with aggregation.get_strategy "
                f"(fedsplit strategies) and drop these arguments. Received: "
                f"{ {k: unsupported[k] for k in sorted(unsupported)} }"
            )
        for name, value, fixed in (("arrayrecord_key", arrayrecord_key, wire.ARRAYS),
                                   ("configrecord_key", configrecord_key, wire.CONFIG)):
            if value != fixed:
                raise ConfigError(
                    f"RegistryStrategy cannot honour {name}={value!r}: fedsplit's hospital agents "
                    f"read the record named {fixed!r} (protocol/horizontal_wire.py). Leave "
                    f"{name} at its default. Received: {name}={value!r}"
                )
        if not isinstance(weighted_by_key, str) or not weighted_by_key:
            raise ConfigError(f"weighted_by_key must name a reply metric, e.g. 'num-examples'. "
                              f"Received: {weighted_by_key!r}")
        for name, fn in (("train_metrics_aggr_fn", train_metrics_aggr_fn),
                         ("evaluate_metrics_aggr_fn", evaluate_metrics_aggr_fn)):
            if fn is not None and not callable(fn):
                raise ConfigError(f"{name} must be a function (list[RecordDict], str) -> "
                                  f"MetricRecord, or None. Received: {fn!r}")
        super().__init__(
            fraction_train=fraction_train, fraction_evaluate=fraction_evaluate,
            min_train_nodes=min_train_nodes, min_evaluate_nodes=min_evaluate_nodes,
            min_available_nodes=min_available_nodes, weighted_by_key=weighted_by_key,
            arrayrecord_key=arrayrecord_key, configrecord_key=configrecord_key,
            train_metrics_aggr_fn=train_metrics_aggr_fn,
            evaluate_metrics_aggr_fn=evaluate_metrics_aggr_fn,
        )
        self.aggregator = aggregator
        self.history = history
        self.quorum = max(1, quorum)
        #: the loop whose steps the hooks call (its merge step: the plain one)
        self.loop = RoundLoop(
            history,
            PlainMerge(aggregator, quorum=quorum, cohort_caps=cohort_caps, cap_policy=cap_policy,
                       backend=backend, weighted_by_key=weighted_by_key,
                       metrics_aggr_fn=train_metrics_aggr_fn),
            evaluation=Evaluation(weighted_by_key, evaluate_metrics_aggr_fn),
            quorum=quorum, deadline=deadline, server_optimizer=server_optimizer,
            federated=federated, site_names=dict(site_names or {}))
        #: Flower round -> the loop's round, from configure_train to aggregate_evaluate (the
        #: current one only)
        self._rounds: dict[int, Round] = {}
        #: Flower round -> (evaluate instructions sent, why the phase was skipped)
        self._evaluating: dict[int, tuple[list[Message], str | None]] = {}

    def _quorum(self, server_round: int, phase: str, grid: Grid) -> str | None:
        if (reason := self.loop.await_quorum(grid)) is not None:
            log.warning("Round %s (%s): %s", server_round, phase, reason)
        return reason

    def configure_train(self, server_round: int, arrays: ArrayRecord, config: ConfigRecord,
                        grid: Grid) -> list[Message]:
        """The loop opens the round; Flower's sampling, once a quorum is connected."""
        rnd = self.loop.open(server_round, arrays)
        self._rounds = {server_round: rnd}  # Flower's earlier rounds are over
        if (reason := self._quorum(server_round, "train", grid)) is not None:
            rnd.skipped = reason
            return []
        rnd.train = list(super().configure_train(server_round, arrays, config, grid))
        return rnd.train

    def aggregate_train(self, server_round: int, replies: Iterable[Message]
                        ) -> tuple[ArrayRecord | None, MetricRecord | None]:
        """The loop closes the round: merge, server optimizer, history (module docstring)."""
        rnd = self._rounds.get(server_round)
        if rnd is None:  # aggregate_train without configure_train: the model sent is unknown
            rnd = self._rounds[server_round] = self.loop.open(server_round, None)
        return self.loop.close(rnd, list(replies), ends_round=False)

    def configure_evaluate(self, server_round: int, arrays: ArrayRecord, config: ConfigRecord,
                           grid: Grid) -> list[Message]:
        """Flower's sampling for evaluation, once a quorum is connected."""
        if (reason := self._quorum(server_round, "evaluate", grid)) is not None:
            self._evaluating[server_round] = ([], reason)
            return []
        msgs = list(super().configure_evaluate(server_round, arrays, config, grid))
        self._evaluating[server_round] = (msgs, None)
        return msgs

    def aggregate_evaluate(self, server_round: int, replies: Iterable[Message]
                           ) -> MetricRecord | None:
        """The loop records the evaluation of round ``server_round``'s global model (the
        weighted mean of the hospitals' held-out metrics, or ``evaluate_metrics_aggr_fn``),
        which ends the round's time."""
        sent, skipped = self._evaluating.pop(server_round, ([], None))
        rnd = self._rounds.pop(server_round, None)
        return self.loop.evaluated(server_round, sent, list(replies), skipped=skipped,
                                   seconds=rnd.elapsed() if rnd is not None else None)
