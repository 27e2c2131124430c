"""`SecureStrategy`: a strategy wrapper whose training rounds the coordinator sees only as a masked sum.

Each training round, after Flower samples the hospitals (`RegistryStrategy.configure_train`):

1. ``query.secagg`` stage ``setup`` to the sampled hospitals (public keys back);
2. ``query.secagg`` stage ``share-keys`` (encrypted Shamir shares back);
3. the train instruction, with a ``secagg`` record forwarding each hospital's shares: it trains
   and replies with its masked ``[count * q(change), count]`` vector (no weights, no count);
4. (in `aggregate_train`) ``query.secagg`` stage ``unmask`` to those that replied; the sum is
   unmasked and decoded into the count-weighted mean change, added to the global model.

It wraps the run's `RegistryStrategy` (as Flower's DP wrappers wrap a strategy): sampling,
quorum, deadlines, the history and the server optimizer stay the wrapped loop's; only the
training round's messages and its aggregation change, through the loop's public hooks
(`server.bookkeeping`): the instructions it sends and the rounds it skips go into the loop's
round bookkeeping (``loop.book``), and its `SecureStrategy.merge` replaces the loop's merge step
(`RegistryStrategy.use_merge`), so the loop still steps the server optimizer and records every
round in the history. It asks the rule what it supports
(`check_secure_rule`): a ``linear`` rule (FedAvg) is the unmasked mean itself; an
``iterative_on_sums`` rule (geometric median) runs its own iteration from that mean
(`AggregationStrategy.iterate_on_sums`), each step one more secure sum (stages setup,
share-keys, ``point``, unmask; `_iterate`, docs/privacy.md). Any other rule is refused.

A hospital that fails or is late at stage 1 or 2 leaves the round; one that drops at 3 is
removed with its neighbours' shares (up to the reconstruction threshold; `server.secure.secagg`).
Training metrics other than the count (train loss, spent epsilon) travel in the clear and are
averaged unweighted (the coordinator does not learn the counts). Evaluation is Flower's separate
evaluate phase, every round (the one-message round of `server.rounds` is not used here).
"""

from __future__ import annotations

import logging
import time
from typing import Any

import numpy as np
from fedsplit.aggregation.base import AggregateResult, AggregationStrategy
from fedsplit.aggregation.geometric_median import WeiszfeldStop
from fedsplit.protocol import horizontal_wire as wire
from fedsplit.protocol import privacy as pv
from fedsplit.protocol import secure_vector as sv
from fedsplit.protocol.errors import ConfigError, FedsplitError
from fedsplit.protocol.history import AggregationReport, SiteEntry, SiteReport
from fedsplit.protocol.horizontal_wire import reply_site
from fedsplit.protocol.privacy import SecureSpec
from fedsplit.server.bookkeeping import Merge, RoundReplies
from fedsplit.server.secure import unmask
from fedsplit.server.secure.secagg import SecureSum
from fedsplit.server.strategy import RegistryStrategy, StrategyWrapper, weighted_mean
from flwr.app import ArrayRecord, ConfigRecord, Message, RecordDict
from flwr.serverapp import Grid

from fedsplit import aggregation

log = logging.getLogger(__name__)


def secure_rules() -> list[str]:
    """The registered rules secure aggregation runs (those that say they can), by name."""
    return [name for name in aggregation.strategy_names()
            if (rule := aggregation.get_strategy(name)).linear or rule.iterative_on_sums]


def check_secure_rule(rule: AggregationStrategy) -> None:
    """Refuse a rule that must see single updates: secure aggregation shows only sums."""
    if rule.linear or rule.iterative_on_sums:
        return
    raise ConfigError(
        f"Strategy {rule.name} cannot run with secure aggregation: it compares the single "
        f"hospitals' updates, and under secure aggregation the coordinator sees only their "
        f"masked sum. Choose robust or secure: drop --secure-aggregation (robust rules need "
        f"the single updates), or keep it with a rule that runs on secure sums: "
        f"{', '.join(secure_rules())} (fedavg is one secure weighted average per round, the "
        f"documented robust-enough default when each hospital's change is bounded: the secure "
        f"range bound=B refuses larger ones at the hospital; geometric-median is robust, each "
        f"Weiszfeld step one secure weighted average). Received: strategy={rule.name}"
    )


class SecureStrategy(StrategyWrapper):
    """Wraps a `RegistryStrategy` so that its training rounds run SecAgg+ (module docstring).

    It keeps Flower's separate evaluate phase (`server.rounds.separate_evaluate`): its train
    reply is the masked vector (`client.secure`), which carries no evaluation, and each of its
    rounds already runs the setup, share-keys and unmask exchanges besides training.

    Its `merge` is the wrapped loop's merge step (supplied at construction), so the loop's
    ``aggregate_train`` (reached through the wrapper's delegation) unmasks the round."""

    separate_evaluate = True

    def __init__(self, strategy: RegistryStrategy, *, secure: SecureSpec,
                 timeout: float | None = None) -> None:
        super().__init__(strategy)
        check_secure_rule(self.aggregator)
        self.loop.use_merge(self.merge)
        self.secure = secure
        self.timeout = timeout
        self._grid: Grid | None = None
        self._runs: dict[int, tuple[SecureSum, dict[str, np.ndarray]]] = {}
        self.stage_seconds: dict[int, dict[str, float]] = {}

    def _ask(self, grid: Grid, instructions: dict[int, dict[str, Any]]) -> dict[int, dict]:
        """Send one ``query.secagg`` stage; return node -> reply record (failed ones left out)."""
        msgs = [Message(RecordDict({pv.SECAGG: ConfigRecord(cfg)}), dst_node_id=node,
                        message_type=pv.SECAGG_QUERY) for node, cfg in instructions.items()]
        out = {}
        for reply in grid.send_and_receive(msgs, timeout=self.timeout):
            node = reply.metadata.src_node_id
            if not reply.has_content() or pv.SECAGG not in reply.content.config_records:
                reason = reply.error.reason if reply.has_error() else "no secagg record"
                log.warning("Secure aggregation: node %s left the round: %s", node, reason)
                continue
            out[node] = dict(reply.content.config_records[pv.SECAGG])
        return out

    def configure_train(self, server_round: int, arrays: ArrayRecord, config: ConfigRecord,
                        grid: Grid) -> list[Message]:
        """Flower's sampling, then the setup and share-keys stages; the collect stage rides on
        the train instructions."""
        loop = self.loop
        msgs = list(self.strategy.configure_train(server_round, arrays, config, grid))
        r = server_round + self.round_offset
        if not msgs:
            return msgs
        self._grid = grid
        unmask.warm_up(len(msgs))  # the unmasking pool starts while the keys are exchanged
        start = time.monotonic()
        run = SecureSum(self.secure, [m.metadata.dst_node_id for m in msgs], round=r)
        try:
            setup = self._ask(grid, {n: run.setup_config() for n in run.nodes})
            keys = {n: (rep["pk1"], rep["pk2"]) for n, rep in setup.items()}
            t1 = time.monotonic()
            shared = self._ask(grid, run.share_instructions(keys))
            collect = run.collect_instructions(
                {n: (list(rep["dsts"]), list(rep["ciphertexts"])) for n, rep in shared.items()})
        except FedsplitError as e:
            log.warning("Round %s: secure aggregation could not start: %s", r, e)
            loop.book.skip("train", r, f"secure aggregation could not start: {e}")
            return []
        self.stage_seconds[r] = {"setup": t1 - start, "share-keys": time.monotonic() - t1}
        kept = [self._with_record(m, ConfigRecord(collect[m.metadata.dst_node_id]))
                for m in msgs if m.metadata.dst_node_id in collect]
        loop.book.expect("train", r, kept)  # the wrapped loop waits for (and names) these
        # the masked sum covers the tensors that travel (the rest of the model stays as sent)
        self._runs[r] = (run, loop.travelling({k: a.numpy() for k, a in arrays.items()}))
        return kept

    def _iterate(self, r: int, nodes: list[int], start: dict[str, np.ndarray],
                 mean: dict[str, np.ndarray]) -> tuple[dict[str, np.ndarray], dict[str, Any]]:
        """The rule's own iteration (`AggregationStrategy.iterate_on_sums`; the geometric median's
        smoothed Weiszfeld steps) from the secure mean, each step one secure weighted average
        among the hospitals still taking part (fresh keys and masks): each hospital weighs
        itself by its own distance to the broadcast point. A step that fails (too many
        dropouts) ends the iteration at the last point."""
        nu = float(self.aggregator.params.nu)
        taking_part = list(nodes)
        scale = sv.max_distance(sv.flat(mean).size, self.secure.bound) * 2.0 ** -sv.WEIGHT_BITS

        def step(point: dict[str, np.ndarray]) -> tuple[float, dict[str, np.ndarray]]:
            nonlocal taking_part, scale
            try:
                nxt, count, objective, taking_part = self._secure_step(
                    r, taking_part, sv.flat(point), scale, nu, start)
            except FedsplitError as e:
                log.warning("Round %s: secure step failed, keeping the last point: %s", r, e)
                raise WeiszfeldStop(f"a secure step failed ({e}); kept the last point") from e
            if not nxt:
                raise WeiszfeldStop("no hospital left to move towards")
            scale = objective / count if count else scale
            return objective, nxt

        return self.aggregator.iterate_on_sums(step, mean)

    def _secure_step(self, r: int, nodes: list[int], point: np.ndarray, scale: float, nu: float,
                     start: dict[str, np.ndarray]) -> tuple[dict[str, np.ndarray], int, float,
                                                            list[int]]:
        """One step as one secure sum among ``nodes`` (fresh keys and masks): (next point,
        total count, objective g(point), hospitals that took part)."""
        grid = self._grid
        run = SecureSum(self.secure, nodes, round=r)
        setup = self._ask(grid, {n: run.setup_config() for n in run.nodes})
        shared = self._ask(grid, run.share_instructions(
            {n: (rep["pk1"], rep["pk2"]) for n, rep in setup.items()}))
        collect = run.collect_instructions(
            {n: (list(rep["dsts"]), list(rep["ciphertexts"])) for n, rep in shared.items()})
        replies = self._ask(grid, {n: {**cfg, pv.STAGE: pv.POINT, "point": point.tobytes(),
                                       "scale": float(scale), "nu": nu}
                                   for n, cfg in collect.items()})
        masked = {n: np.frombuffer(bytes(rep["masked"]), dtype=np.int64).copy()
                  for n, rep in replies.items()}
        unmask = self._ask(grid, run.unmask_instructions(masked))
        total = run.total({n: (list(rep["nodes"]), list(rep["shares"]))
                           for n, rep in unmask.items()})
        nxt, _weight, count, objective = sv.decode_weiszfeld(total, start, self.secure.bound,
                                                             self.secure.levels)
        return nxt, count, objective, run.u2

    @staticmethod
    def _with_record(msg: Message, record: ConfigRecord) -> Message:
        """A copy of ``msg`` whose content also holds this node's ``secagg`` record.

        Flower's FedAvg gives every train message of a round the SAME ``RecordDict`` object;
        adding a node's record to it in place would hand every hospital the last one's
        (shares from itself, keys it cannot decrypt). Each message gets its own content."""
        content = RecordDict({**dict(msg.content.items()), pv.SECAGG: record})
        return Message(content, dst_node_id=msg.metadata.dst_node_id,
                       message_type=msg.metadata.message_type, group_id=msg.metadata.group_id)

    def merge(self, replies: RoundReplies) -> Merge:
        """The loop's merge step under secure aggregation: unmask the sum of the masked
        replies; the aggregate is the model sent out moved by their weighted mean (or by the
        rule's iteration from it). The loop then steps the server optimizer and records it."""
        loop = self.loop
        r = replies.server_round
        sites: list[SiteEntry] = []
        masked: dict[int, np.ndarray] = {}
        rows: list[tuple[float, dict[str, Any]]] = []
        for msg in replies.replies:
            site = loop.book.site(msg, replies.senders)
            if not msg.has_content() or pv.MASKED not in msg.content.array_records:
                reason = msg.error.reason if msg.has_error() else "no masked vector"
                sites.append(SiteEntry(site=site, excluded=True,
                                       reason=wire.failure_reason(reason) if msg.has_error()
                                       else f"dropped out of secure aggregation: {reason}"))
                continue
            metrics = {k: float(v) for k, v in msg.content.metric_records["metrics"].items()
                       if not isinstance(v, list)}
            masked[msg.metadata.src_node_id] = msg.content.array_records[pv.MASKED]["vector"].numpy()
            rows.append((1.0, metrics))
            info = {k: str(v) for k, v in msg.content.config_records.get("site", {}).items()
                    if k != "name"}
            sites.append(SiteEntry(site=reply_site(msg), metrics=metrics, info=info, secure=True))
        run, start = self._runs.pop(r)
        t0 = time.monotonic()
        try:
            unmask = self._ask(self._grid, run.unmask_instructions(masked))
            total = run.total({n: (list(rep["nodes"]), list(rep["shares"]))
                               for n, rep in unmask.items()})
            mean, count = sv.decode(total, start, self.secure.bound, self.secure.levels)
        except FedsplitError as e:
            return Merge(sites, error=f"secure aggregation failed: {e}; global model unchanged")
        if len(masked) < loop.quorum:
            return Merge(sites, error=f"only {len(masked)} masked replies, fewer than the "
                                      f"quorum of {loop.quorum}; global model unchanged")
        weiszfeld = None
        if self.aggregator.iterative_on_sums:  # else linear: the secure mean is the aggregate
            mean, weiszfeld = self._iterate(r, run.u2, start, mean)
        scale = sv.relative_scale(start)  # running statistics were encoded relative to their size
        arrays = {k: (np.asarray(start[k], np.float64) + mean[k] * scale.get(k, 1.0))
                  .astype(np.asarray(start[k]).dtype) for k in start}
        seconds = {**self.stage_seconds.pop(r, {}), "unmask": time.monotonic() - t0}
        report = AggregationReport(
            strategy=self.aggregator.name, params={"secure": self.secure.to_spec()},
            num_examples=count,
            sites=[SiteReport(site=s.site, num_examples=0, weight=0.0,
                              flags=["secure: count and weight hidden"])
                   for s in sites if not s.excluded],
            details={"secure_aggregation": {
                "hospitals": len(masked), "dropped": len(run.u1) - len(run.u2),
                "share_num": run.share_num, "threshold": run.threshold,
                "quantisation_step": 2 * self.secure.bound / self.secure.levels,
                "stage_seconds": seconds},
                **({"weiszfeld": weiszfeld} if weiszfeld is not None else {})},
        )
        # the secure mean is the aggregate; the loop steps the server optimizer on it, as in
        # plain runs, puts back the tensors that do not travel and records the round
        return Merge(sites, result=AggregateResult(arrays, count, report),
                     metrics=weighted_mean(rows))
