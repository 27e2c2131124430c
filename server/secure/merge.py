"""`SecureMerge`: the round loop's merge step under secure aggregation: the coordinator sees
each round only as a masked sum.

Each training round of the loop (`server.rounds.RoundLoop`), after it samples the hospitals:

1. (``prepare``) ``query.secagg`` stage ``setup`` to the sampled hospitals (public keys back);
2. (``prepare``) stage ``share-keys`` (encrypted Shamir shares back);
3. (the loop's exchange) the train instruction, with a ``secagg`` record forwarding each
   hospital's shares: it scores the model it received (``evaluate-first``, as in plain runs),
   trains, and replies with its masked ``[count * q(change), count]`` vector (no weights, no
   count) and its evaluation in the clear, which the loop records as in a plain run;
4. (``merge``) stage ``unmask`` to those that replied; the sum is unmasked and decoded into the
   count-weighted mean change, added to the global model.

The stages' seconds go into the round (``Round.stages``) and the aggregation report; the
round's `SecureSum` is the round's merge state (``Round.state``). Sampling, quorum, deadlines,
the history and the server optimizer stay the loop's. It asks the rule what it supports
(`check_secure_rule`): a ``linear`` rule (FedAvg) is the unmasked mean itself; an
``iterative_on_sums`` rule (geometric median) runs its own iteration from that mean
(`AggregationStrategy.iterate_on_sums`), each step one more secure sum (stages setup,
share-keys, ``point``, unmask; `SecureMerge.iterate`, docs/privacy.md). Any other rule is
refused.

A hospital that fails or is late at stage 1 or 2 leaves the round (it is sent the evaluate
instruction instead, so it still scores the previous model); one that drops at 3 is removed
with its neighbours' shares (up to the reconstruction threshold; `server.secure.secagg`).
Training metrics other than the count (train loss, spent epsilon) travel in the clear and are
averaged unweighted (the coordinator does not learn the counts).
"""

from __future__ import annotations

import logging
from dataclasses import dataclass
from typing import Any

import numpy as np
from fedsplit.aggregation.base import AggregateResult, AggregationStrategy
from fedsplit.aggregation.geometric_median import WeiszfeldStop
from fedsplit.protocol import horizontal_wire as wire
from fedsplit.protocol import privacy as pv
from fedsplit.protocol import secure_vector as sv
from fedsplit.protocol.aggregation_report import AggregationReport, SiteReport
from fedsplit.protocol.errors import ConfigError, FedsplitError
from fedsplit.protocol.horizontal_wire import reply_site
from fedsplit.protocol.privacy import SecureSpec
from fedsplit.protocol.record.horizontal import SiteEntry
from fedsplit.server.bookkeeping import Merge, Round, RoundReplies
from fedsplit.server.exchange import send_and_collect
from fedsplit.server.merge import weighted_mean
from fedsplit.server.secure import unmask
from fedsplit.server.secure.secagg import SecureSum
from flwr.app import ConfigRecord, Message, RecordDict
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


@dataclass
class SecureRound:
    """A round's secure sum, kept in the round (``Round.state``) from ``prepare`` to ``merge``:
    the `SecureSum` and the grid and deadline its unmask stage uses."""

    run: SecureSum
    grid: Grid
    timeout: float | None


class SecureMerge:
    """The loop's merge step under SecAgg+ (module docstring).

    Parameters
    ----------
    aggregator : AggregationStrategy
        The registry rule: linear (the secure mean) or iterative on sums (its steps secure).
    secure : SecureSpec
        The range bound and quantisation levels (``secure-aggregation``).
    quorum : int (default: 1)
        Fewest masked replies that update the global model.
    """

    def __init__(self, aggregator: AggregationStrategy, *, secure: SecureSpec,
                 quorum: int = 1) -> None:
        check_secure_rule(aggregator)
        self.aggregator = aggregator
        self.secure = secure
        self.quorum = max(1, quorum)

    @staticmethod
    def _ask(grid: Grid, instructions: dict[int, dict[str, Any]], timeout: float | None
             ) -> dict[int, dict]:
        """Send one ``query.secagg`` stage; return node -> reply record (failed ones left out)."""
        msgs = [Message(RecordDict({pv.SECAGG: ConfigRecord(cfg)}), dst_node_id=node,
                        message_type=pv.SECAGG_QUERY) for node, cfg in instructions.items()]
        out = {}
        for reply in send_and_collect(grid, msgs, timeout=timeout):
            node = reply.metadata.src_node_id
            if not reply.has_content() or pv.SECAGG not in reply.content.config_records:
                reason = reply.error.reason if reply.has_error() else "no secagg record"
                log.warning("Secure aggregation: node %s left the round: %s", node, reason)
                continue
            out[node] = dict(reply.content.config_records[pv.SECAGG])
        return out

    def prepare(self, rnd: Round, grid: Grid, timeout: float | None) -> None:
        """The setup and share-keys stages among the hospitals sampled for training; the
        collect stage rides on their train instructions (``rnd.train`` replaced by copies
        carrying each one's ``secagg`` record, those that left the stages dropped)."""
        if not rnd.train:
            return
        unmask.warm_up(len(rnd.train))  # the unmasking pool starts while the keys are exchanged
        run = SecureSum(self.secure, [m.metadata.dst_node_id for m in rnd.train], round=rnd.number)
        try:
            with rnd.stage("setup"):
                setup = self._ask(grid, {n: run.setup_config() for n in run.nodes}, timeout)
                keys = {n: (rep["pk1"], rep["pk2"]) for n, rep in setup.items()}
            with rnd.stage("share-keys"):
                shared = self._ask(grid, run.share_instructions(keys), timeout)
                collect = run.collect_instructions(
                    {n: (list(rep["dsts"]), list(rep["ciphertexts"])) for n, rep in shared.items()})
        except FedsplitError as e:
            log.warning("Round %s: secure aggregation could not start: %s", rnd.number, e)
            rnd.skipped = f"secure aggregation could not start: {e}"
            rnd.train = []
            return
        rnd.train = [self._with_record(m, ConfigRecord(collect[m.metadata.dst_node_id]))
                     for m in rnd.train if m.metadata.dst_node_id in collect]
        rnd.state = SecureRound(run, grid, timeout)

    def iterate(self, r: int, nodes: list[int], start: dict[str, np.ndarray],
                mean: dict[str, np.ndarray], grid: Grid, timeout: float | None = None
                ) -> tuple[dict[str, np.ndarray], dict[str, Any]]:
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
                    r, taking_part, sv.flat(point), scale, nu, start, grid, timeout)
            except FedsplitError as e:
                log.warning("Round %s: secure step failed, keeping the last point: %s", r, e)
                raise WeiszfeldStop(f"a secure step failed ({e}); kept the last point") from e
            if not nxt:
                raise WeiszfeldStop("no hospital left to move towards")
            scale = objective / count if count else scale
            return objective, nxt

        return self.aggregator.iterate_on_sums(step, mean)

    def _secure_step(self, r: int, nodes: list[int], point: np.ndarray, scale: float, nu: float,
                     start: dict[str, np.ndarray], grid: Grid, timeout: float | None
                     ) -> tuple[dict[str, np.ndarray], int, float, list[int]]:
        """One step as one secure sum among ``nodes`` (fresh keys and masks): (next point,
        total count, objective g(point), hospitals that took part)."""
        run = SecureSum(self.secure, nodes, round=r)
        setup = self._ask(grid, {n: run.setup_config() for n in run.nodes}, timeout)
        shared = self._ask(grid, run.share_instructions(
            {n: (rep["pk1"], rep["pk2"]) for n, rep in setup.items()}), timeout)
        collect = run.collect_instructions(
            {n: (list(rep["dsts"]), list(rep["ciphertexts"])) for n, rep in shared.items()})
        replies = self._ask(grid, {n: {**cfg, pv.STAGE: pv.POINT, "point": point.tobytes(),
                                       "scale": float(scale), "nu": nu}
                                   for n, cfg in collect.items()}, timeout)
        masked = {n: np.frombuffer(bytes(rep["masked"]), dtype=np.int64).copy()
                  for n, rep in replies.items()}
        unmasked = self._ask(grid, run.unmask_instructions(masked), timeout)
        total = run.total({n: (list(rep["nodes"]), list(rep["shares"]))
                           for n, rep in unmasked.items()})
        nxt, _weight, count, objective = sv.decode_weiszfeld(total, start, self.secure.bound,
                                                             self.secure.levels)
        return nxt, count, objective, run.u2

    @staticmethod
    def _with_record(msg: Message, record: ConfigRecord) -> Message:
        """A copy of ``msg`` whose content also holds this node's ``secagg`` record.

        The loop (as Flower's FedAvg) gives every train message of a round the SAME
        ``RecordDict`` object; adding a node's record to it in place would hand every hospital
        the last one's (shares from itself, keys it cannot decrypt). Each message gets its own
        content."""
        content = RecordDict({**dict(msg.content.items()), pv.SECAGG: record})
        return Message(content, dst_node_id=msg.metadata.dst_node_id,
                       message_type=msg.metadata.message_type, group_id=msg.metadata.group_id)

    def receive(self, rnd: Round, msg: Message) -> None:
        """Nothing on arrival: masked vectors are unmasked together (`merge`)."""

    def merge(self, rnd: Round, replies: RoundReplies) -> Merge:
        """Unmask the sum of the masked replies; the aggregate is the model sent out moved by
        their weighted mean (or by the rule's iteration from it). The loop then steps the
        server optimizer and records it."""
        r = rnd.number
        sites: list[SiteEntry] = []
        masked: dict[int, np.ndarray] = {}
        rows: list[tuple[float, dict[str, Any]]] = []
        for msg in replies.replies:
            site = replies.site(msg)
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
        if rnd.state is None or rnd.shared is None:
            return Merge(sites, error="secure aggregation was not set up for this round; "
                                      "global model unchanged")
        run, grid, timeout = rnd.state.run, rnd.state.grid, rnd.state.timeout
        start = rnd.shared  # the masked sum covers the tensors that travel
        try:
            with rnd.stage("unmask"):
                unmasked = self._ask(grid, run.unmask_instructions(masked), timeout)
                total = run.total({n: (list(rep["nodes"]), list(rep["shares"]))
                                   for n, rep in unmasked.items()})
                mean, count = sv.decode(total, start, self.secure.bound, self.secure.levels)
        except FedsplitError as e:
            return Merge(sites, error=f"secure aggregation failed: {e}; global model unchanged")
        if len(masked) < self.quorum:
            return Merge(sites, error=f"only {len(masked)} masked replies, fewer than the "
                                      f"quorum of {self.quorum}; global model unchanged")
        weiszfeld = None
        if self.aggregator.iterative_on_sums:  # else linear: the secure mean is the aggregate
            mean, weiszfeld = self.iterate(r, run.u2, start, mean, grid, timeout)
        scale = sv.relative_scale(start)  # running statistics were encoded relative to their size
        arrays = {k: (np.asarray(start[k], np.float64) + mean[k] * scale.get(k, 1.0))
                  .astype(np.asarray(start[k]).dtype) for k in start}
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
                "stage_seconds": dict(rnd.stages)},
                **({"weiszfeld": weiszfeld} if weiszfeld is not None else {})},
        )
        # the secure mean is the aggregate; the loop steps the server optimizer on it, as in
        # plain runs, puts back the tensors that do not travel and records the round
        return Merge(sites, result=AggregateResult(arrays, count, report),
                     metrics=weighted_mean(rows))
