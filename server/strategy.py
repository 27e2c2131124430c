"""`RegistryStrategy`: Flower's round loop with fedsplit's registry doing the aggregation.

Flower's `FedAvg` samples hospitals, sends the global model, collects replies and runs
evaluation; this subclass replaces only the two aggregation hooks. Training replies are checked
against the wire contract (`protocol.horizontal_wire`) and become `protocol.Update` objects
(validated: finite float arrays, integer count >= 1); a reply that fails is excluded with its
reason instead of ending the run, and the merge itself is `aggregation.aggregate_updates`, the
same code the REST upload path and the CLI use.

What a Flower user passes to `FedAvg` is honoured: the sampling arguments (``fraction_*``,
``min_*_nodes``) drive Flower's own sampling; ``weighted_by_key`` names the metric that weights
each reply, both as the update's count and in metric averaging; ``train_metrics_aggr_fn`` and
``evaluate_metrics_aggr_fn`` (Flower's signature ``(list[RecordDict], str) -> MetricRecord``)
replace the default metric averaging, which weights every metric by the weight key and
averages list-valued metrics elementwise, as Flower's ``aggregate_metricrecords``.
``arrayrecord_key`` and ``configrecord_key`` are fixed by the wire contract (``"arrays"``,
``"config"``); any other value, and any argument of another Flower strategy, is refused at
construction with an error naming it.

With a ``server_optimizer`` (`aggregation.server_optimizers`: Adam, Yogi, Adagrad, AvgM), the
rule's aggregate is not the new global model: the optimizer steps on the pseudo-gradient
(aggregate minus the model sent out that round), whatever the rule, so robust and adaptive
compose; its state is saved with each round's model (`server.history`).

A round updates the global model only when at least ``quorum`` replies are usable: the count
is taken after the input checks of `aggregation.aggregate_updates` (layout, count, cohort cap,
finite values), so excluded updates never make up a quorum.

`StrategyWrapper` is the base of the wrappers the coordinator's factory (`server.compose`)
stacks around this loop, as Flower's DP wrappers wrap a strategy: secure aggregation
(`server.secure.strategy.SecureStrategy`) and the privacy accounting
(`server.privacy.PrivateStrategy`); each delegates every hook it does not change, and reaches
the loop only through its public hooks (`server.bookkeeping`): the round book ``loop.book``
(instructions sent, phases skipped, missing hospitals, site names) and the merge step, which a
wrapper may replace (`RegistryStrategy.use_merge`). Whatever merged the round, the loop steps the
server optimizer and records the round in the history (`RegistryStrategy.aggregate_train`).
"""

from __future__ import annotations

import logging
import time
from collections.abc import Callable, Iterable, Mapping, Sequence
from typing import Any

import numpy as np
from fedsplit.aggregation.base import AggregationStrategy
from fedsplit.aggregation.server_optimizers import ServerOptimizer
from fedsplit.protocol import horizontal_wire as wire
from fedsplit.protocol.arrays import ArraySpec
from fedsplit.protocol.errors import ConfigError, FedsplitError
from fedsplit.protocol.history import SiteEntry, SiteReport
from fedsplit.protocol.horizontal_wire import reply_site
from fedsplit.protocol.update import Update
from fedsplit.server.bookkeeping import Merge, MergeStep, RoundBook, RoundReplies
from fedsplit.server.history import RunHistory
from flwr.app import ArrayRecord, ConfigRecord, Message, MetricRecord, RecordDict
from flwr.serverapp import Grid
from flwr.serverapp.strategy import FedAvg, Strategy

from fedsplit import aggregation

log = logging.getLogger(__name__)

MetricsAggrFn = Callable[[list[RecordDict], str], MetricRecord]
Metric = float | list[float]


def weighted_mean(rows: list[tuple[float, Mapping[str, Metric]]],
                  skip: Iterable[str] = ()) -> dict[str, Metric]:
    """Weighted mean of each metric over the rows that report it (lists elementwise).

    Computed as Flower's ``aggregate_metricrecords`` does (each value times weight / total
    weight, summed), so the numbers are Flower's whenever every row reports the same metrics.
    A metric whose rows disagree on being a list, or on its length, is left out with a warning.
    """
    out: dict[str, Metric] = {}
    skipped = set(skip)
    keys = {k for _, m in rows for k in m if k not in skipped}
    for key in sorted(keys):
        pairs = [(w, m[key]) for w, m in rows if key in m]
        total = sum(w for w, _ in pairs)
        if not total:
            continue
        lists = [isinstance(v, list) for _, v in pairs]
        if any(lists):
            lengths = {len(v) if isinstance(v, list) else None for _, v in pairs}
            if not all(lists) or len(lengths) != 1:
                log.warning("Metric %r left out of the average: the replies disagree on its "
                            "length (list lengths or scalars: %s)", key, sorted(lengths, key=str))
                continue
            acc: list[float] = []
            for w, value in pairs:
                factor = w / total
                acc = [v * factor for v in value] if not acc else [
                    a + v * factor for a, v in zip(acc, value, strict=True)]
            out[key] = acc
        else:
            mean = 0.0
            for i, (w, value) in enumerate(pairs):
                mean = value * (w / total) if i == 0 else mean + value * (w / total)
            out[key] = mean
    return out


def _metric_dict(record: MetricRecord | None, what: str) -> dict[str, Metric]:
    """A metrics aggregation function's result as a dict (for the history)."""
    if record is None:
        return {}
    if not isinstance(record, MetricRecord):
        raise ConfigError(
            f"{what} must return a Flower MetricRecord (Flower's signature "
            f"(list[RecordDict], str) -> MetricRecord). Received: {type(record).__name__}"
        )
    return {k: [float(x) for x in v] if isinstance(v, list) else v for k, v in record.items()}


def _without_evaluation(content: RecordDict) -> RecordDict:
    """A train reply's content without the ``evaluation`` record it may carry (one message per
    round), as a user's ``train_metrics_aggr_fn`` expects Flower's train replies: one
    MetricRecord."""
    if wire.EVALUATION not in content.metric_records:
        return content
    return RecordDict({k: v for k, v in content.items() if k != wire.EVALUATION})


class StrategyWrapper(Strategy):
    """A strategy wrapping another, as Flower's ``DifferentialPrivacy*FixedClipping`` do: every
    hook goes to the wrapped ``strategy`` unless the wrapper overrides it.

    The innermost strategy is always a `RegistryStrategy` (`loop`): the round loop whose rule,
    history and round bookkeeping (``loop.book``) every wrapper shares (`server.compose` builds
    the stack). A wrapper uses the loop's public members only (`server.bookkeeping`).
    """

    def __init__(self, strategy: Strategy) -> None:
        self.strategy = strategy

    @property
    def loop(self) -> RegistryStrategy:
        """The innermost `RegistryStrategy`."""
        inner = self.strategy
        while isinstance(inner, StrategyWrapper):
            inner = inner.strategy
        if not isinstance(inner, RegistryStrategy):
            raise ConfigError(f"A fedsplit strategy wrapper wraps a RegistryStrategy (or another "
                              f"wrapper of one). Received: {type(inner).__name__}")
        return inner

    @property
    def aggregator(self) -> AggregationStrategy:
        """The loop's registry rule."""
        return self.loop.aggregator

    @property
    def history(self) -> RunHistory:
        """The loop's run history."""
        return self.loop.history

    @property
    def round_offset(self) -> int:
        """Rounds completed before this coordinator started (resume)."""
        return self.loop.round_offset

    def configure_train(self, server_round: int, arrays: ArrayRecord, config: ConfigRecord,
                        grid: Grid) -> Iterable[Message]:
        """The wrapped strategy's."""
        return self.strategy.configure_train(server_round, arrays, config, grid)

    def aggregate_train(self, server_round: int, replies: Iterable[Message]
                        ) -> tuple[ArrayRecord | None, MetricRecord | None]:
        """The wrapped strategy's."""
        return self.strategy.aggregate_train(server_round, replies)

    def configure_evaluate(self, server_round: int, arrays: ArrayRecord, config: ConfigRecord,
                           grid: Grid) -> Iterable[Message]:
        """The wrapped strategy's."""
        return self.strategy.configure_evaluate(server_round, arrays, config, grid)

    def aggregate_evaluate(self, server_round: int, replies: Iterable[Message]
                           ) -> MetricRecord | None:
        """The wrapped strategy's."""
        return self.strategy.aggregate_evaluate(server_round, replies)

    def summary(self) -> None:
        """Name the wrapper, then the wrapped strategy's summary."""
        log.info("\t%s wrapping %s", type(self).__name__, type(self.strategy).__name__)
        self.strategy.summary()


class RegistryStrategy(FedAvg):
    """Flower `FedAvg` round loop whose aggregation is a fedsplit registry strategy.

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
        The per-phase reply deadline (the run's ``round-timeout``), used to bound the wait for a
        quorum and named in the history when a sampled hospital did not answer in time.
    round_offset : int (default: 0)
        Rounds already completed by an earlier coordinator (resume): Flower's round ``r`` is
        recorded and sent to hospitals as ``r + round_offset``.
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
        contents; None: the weighted mean (`weighted_mean`).
    server_optimizer : ServerOptimizer | None (default: None)
        A server optimizer stepping on the pseudo-gradient of the rule's aggregate (restore
        its state first when resuming: `server.history.ResumePoint.restore_optimizer`).
    federated : Sequence[str] | None (default: None)
        The tensors that travel back from the hospitals (`client.recipes.Recipe.federated`,
        agreed before round 1); None: every tensor. Hospitals get the whole global model; their
        replies, the rule and the server optimizer cover only these, and the new global model
        keeps every other tensor as it was sent.
    site_names : Mapping[int, str] | None (default: None)
        Node id -> hospital name, as the setup exchange learnt them, so a hospital whose
        ClientApp failed is named, never numbered.
    backend : aggregation.BackendSettings | None (default: None)
        How the merges' passes run (backend mode, device, threads), for every round. Default:
        read from the coordinator's environment once, here (``FEDSPLIT_AGG_BACKEND``,
        ``FEDSPLIT_AGG_THREADS``).
    **unsupported
        Any other argument (e.g. FedAvgM's ``server_momentum``) is refused with `ConfigError`.
    """

    def __init__(self, aggregator: AggregationStrategy, history: RunHistory, *, quorum: int = 1,
                 deadline: float | None = None, round_offset: int = 0,
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
                f"round loop and merges with a fedsplit registry rule (aggregator), so only "
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
        self._train_aggr = train_metrics_aggr_fn
        self._evaluate_aggr = evaluate_metrics_aggr_fn
        self.cohort_caps = cohort_caps or {}
        self.cap_policy = cap_policy
        self._expected: dict[int, list[ArraySpec]] = {}
        self.aggregator = aggregator
        #: how every merge's passes run, built once at start-up (`aggregation.BackendSettings`)
        self.backend = backend if backend is not None else aggregation.BackendSettings.from_environ()
        self.history = history
        self.quorum = max(1, quorum)
        #: the round bookkeeping (instructions sent, phases skipped, hospitals' names), public
        #: for the wrappers (`server.bookkeeping`)
        self.book = RoundBook(site_names=site_names, deadline=deadline)
        self.round_offset = round_offset
        self.federated = tuple(federated) if federated is not None else None
        self._full: dict[int, dict[str, np.ndarray]] = {}
        self.server_optimizer = server_optimizer
        self._current: dict[int, dict[str, np.ndarray]] = {}
        self._merge_step: MergeStep = self.merge

    @property
    def deadline(self) -> float | None:
        """The per-phase reply deadline in seconds (``round-timeout``), or None."""
        return self.book.deadline

    @deadline.setter
    def deadline(self, value: float | None) -> None:
        self.book.deadline = value

    @property
    def site_names(self) -> dict[int, str]:
        """Node id -> hospital name (`RoundBook.site_names`)."""
        return self.book.site_names

    def use_merge(self, step: MergeStep) -> None:
        """Replace the loop's merge step (`merge`) with ``step``: a wrapper that merges a
        round differently (secure aggregation) supplies its own; the loop still steps the
        server optimizer and records the round (`aggregate_train`). Only one wrapper may."""
        if self._merge_step != self.merge:
            raise ConfigError(
                f"This round loop's merge step was already replaced ({self._merge_step!r}); two "
                f"wrappers cannot both merge its rounds. Received: {step!r}")
        self._merge_step = step

    # --- quorum and deadline bookkeeping (sampling stays Flower's) ---------------------------

    def _await_quorum(self, grid: Grid) -> str | None:
        """Wait (bounded by the deadline) until ``quorum`` hospitals are connected; else why not."""
        wait = self.deadline if self.deadline is not None else 3600.0
        limit = time.monotonic() + wait
        while len(nodes := list(grid.get_node_ids())) < self.quorum:
            if time.monotonic() > limit:
                return (f"only {len(nodes)} hospital(s) connected within round-timeout={wait:.0f} s, "
                        f"fewer than the quorum of {self.quorum}; phase skipped, model unchanged")
            time.sleep(1.0)
        return None

    def _configure(self, phase: str, server_round: int, arrays: ArrayRecord, config: ConfigRecord,
                   grid: Grid) -> list[Message]:
        if (reason := self._await_quorum(grid)) is not None:
            log.warning("Round %s (%s): %s", server_round, phase, reason)
            self.book.skip(phase, server_round, reason)
            return []
        configure = super().configure_train if phase == "train" else super().configure_evaluate
        msgs = list(configure(server_round, arrays, config, grid))
        self.book.expect(phase, server_round, msgs)  # Flower sets their ids when it pushes them
        return msgs

    def travelling(self, arrays: Mapping[str, np.ndarray]) -> dict[str, np.ndarray]:
        """The tensors of a model that travel back from the hospitals (``federated``)."""
        if self.federated is None:
            return dict(arrays)
        return {name: arrays[name] for name in self.federated}

    def completed(self, server_round: int, arrays: dict[str, np.ndarray]) -> dict[str, np.ndarray]:
        """The new global model: the model sent out in ``server_round`` (after the resume offset)
        with its travelling tensors replaced by ``arrays``."""
        full = self._full.pop(server_round, None)
        if full is None or self.federated is None:
            return arrays
        return {**full, **arrays}

    def configure_train(self, server_round: int, arrays: ArrayRecord, config: ConfigRecord,
                        grid: Grid) -> list[Message]:
        """Flower's sampling, once a quorum is connected; rounds continue after a resume."""
        r = server_round + self.round_offset
        self._full[r] = {name: a.numpy() for name, a in arrays.items()}
        shared = self.travelling(self._full[r])
        # Every reply must match the travelling part of the model sent out this round (names,
        # shapes, dtypes).
        self._expected[r] = [ArraySpec(name, tuple(int(d) for d in a.shape), np.dtype(a.dtype))
                             for name, a in shared.items()]
        if self.server_optimizer is not None:  # the pseudo-gradient is taken against this model
            self._current[r] = shared
        return self._configure("train", r, arrays, config, grid)

    def configure_evaluate(self, server_round: int, arrays: ArrayRecord, config: ConfigRecord,
                           grid: Grid) -> list[Message]:
        """Flower's sampling for evaluation, once a quorum is connected."""
        return self._configure("evaluate", server_round + self.round_offset, arrays, config, grid)

    def record_short(self, server_round: int, sites: list[SiteEntry], error: str,
                     ) -> tuple[None, None]:
        """Record a short round (the global model stays as it was; ``error`` says why) and
        return Flower's "no new model" answer."""
        self._full.pop(server_round, None)
        log.warning("Round %s: %s", server_round, error)
        self.history.record_train(server_round, None, sites, {}, error=error)
        return None, None

    def aggregate_train(
        self, server_round: int, replies: Iterable[Message]
    ) -> tuple[ArrayRecord | None, MetricRecord | None]:
        """Merge a round's training replies with the merge step (`merge`, or the one a wrapper
        supplied with `use_merge`); then step the server optimizer on the aggregate, put back
        the tensors that do not travel, and record the round in the history (the one place a
        training round is recorded)."""
        server_round += self.round_offset
        start = self._current.pop(server_round, None)
        replies = list(replies)
        senders, missing = self.book.missing("train", server_round, replies)
        expected = self._expected.pop(server_round, None)
        if (skipped := self.book.take_skip("train", server_round)) is not None:
            # nothing was sent; a stray reply is named, and left out with the reason
            sites = [SiteEntry(site=self.book.site(m, senders), excluded=True, reason=skipped)
                     for m in replies]
            self._full.pop(server_round, None)
            self.history.record_train(server_round, None, [*sites, *missing], {}, error=skipped)
            return None, None
        merged = self._merge_step(RoundReplies(server_round, replies, senders, expected))
        sites = [*merged.sites, *missing]
        if merged.result is None:
            return self.record_short(server_round, sites, merged.error
                                     or "no aggregate; global model unchanged")
        result = merged.result
        arrays = result.arrays
        if self.server_optimizer is not None and start is not None:
            arrays = self.server_optimizer.step(start, result.arrays)
        stepped = self.server_optimizer is not None or self.federated is not None
        arrays = self.completed(server_round, arrays)
        self.history.record_train(server_round, result, sites, merged.metrics,
                                  arrays=arrays if stepped else None,
                                  server_opt=self.server_optimizer)
        update = Update(arrays=arrays, num_examples=result.num_examples)
        return update.to_array_record(), MetricRecord(merged.metrics)

    def merge(self, replies: RoundReplies) -> Merge:
        """The loop's merge step: check the replies against the wire contract, exclude bad
        ones with their reason, merge the rest with the registry rule
        (`aggregation.aggregate_updates`), and average their training metrics; a round with
        fewer than ``quorum`` usable replies is short."""
        server_round = replies.server_round
        senders = replies.senders
        valid, failed = self._check_and_log_replies(replies.replies, is_train=True,
                                                    validate=False)
        # in a fixed order (by site name, then node), not the order replies arrived in: the
        # float sums, and so the run, are then the same every time
        valid = sorted(valid, key=lambda m: (reply_site(m), m.metadata.src_node_id))
        parsed: list[wire.TrainReply] = []
        contents: list[RecordDict] = []
        excluded: list[SiteReport] = []
        for msg in failed:
            excluded.append(SiteReport(site=self.book.site(msg, senders), num_examples=0,
                                       weight=0.0, excluded=True,
                                       reason=wire.failure_reason(msg.error.reason)))
        for msg in valid:
            self.book.site(msg, senders)
            try:
                parsed.append(wire.parse_train_reply(msg, weight_key=self.weighted_by_key,
                                                     server_round=server_round))
            except FedsplitError as e:
                excluded.append(SiteReport(site=reply_site(msg), num_examples=0, weight=0.0,
                                           excluded=True, reason=str(e)))
                continue
            contents.append(_without_evaluation(msg.content))
        # one entry per parsed reply first, in order (aligned with the aggregation report)
        sites = [SiteEntry(site=r.site, num_examples=r.update.num_examples, metrics=r.metrics,
                           info=r.info) for r in parsed]
        for rep in excluded:
            log.warning("Round %s: excluded %s: %s", server_round, rep.site, rep.reason)
            sites.append(SiteEntry(site=rep.site, excluded=True, reason=rep.reason))
        if not parsed:
            return Merge(sites, error="no usable training replies; global model unchanged")
        if len(parsed) < self.quorum:
            return Merge(sites, error=f"only {len(parsed)} valid training replies, fewer than "
                                      f"the quorum of {self.quorum}; global model unchanged")
        try:
            result = aggregation.aggregate_updates(
                self.aggregator, [r.update for r in parsed], expected=replies.expected,
                cohort_caps=self.cohort_caps, cap_policy=self.cap_policy, settings=self.backend,
            )
        except FedsplitError as e:
            return Merge(sites, error=str(e))
        # The report holds one entry per update, in input order: updates the input checks
        # excluded (wrong layout, refused count, NaN) leave the quorum and the metrics too.
        usable = []
        for k, rep in enumerate(result.report.sites):
            if rep.excluded:
                sites[k].excluded, sites[k].reason = True, rep.reason
            else:
                usable.append(k)
        result.report.sites.extend(excluded)
        if len(usable) < self.quorum:
            return Merge(sites, error=f"only {len(usable)} usable training replies after the "
                                      f"input checks (of {len(parsed)} received), fewer than "
                                      f"the quorum of {self.quorum}; global model unchanged")
        metrics = self._aggregate_metrics(
            self._train_aggr, "train_metrics_aggr_fn",
            [(parsed[k].update.num_examples, parsed[k].metrics) for k in usable],
            [contents[k] for k in usable],
        )
        return Merge(sites, result=result, metrics=metrics)

    def _aggregate_metrics(self, fn: MetricsAggrFn | None, name: str,
                           rows: list[tuple[float, Mapping[str, Metric]]],
                           contents: list[RecordDict]) -> dict[str, Metric]:
        """The user's metrics aggregation function, else the weighted mean without the weight key."""
        if fn is not None:
            return _metric_dict(fn(contents, self.weighted_by_key), name) if contents else {}
        return weighted_mean(rows, skip=(self.weighted_by_key,))

    def aggregate_evaluate(
        self, server_round: int, replies: Iterable[Message]
    ) -> MetricRecord | None:
        """Weighted mean of the sites' held-out metrics (or ``evaluate_metrics_aggr_fn``) of
        round ``server_round``'s global model; ``replies`` are evaluate replies and train
        replies carrying that model's evaluation (one message per round: `server.rounds`)."""
        server_round += self.round_offset
        replies = list(replies)
        senders, missing = self.book.missing("evaluate", server_round, replies)
        valid, failed = self._check_and_log_replies(replies, is_train=False, validate=False)
        rows: list[tuple[float, Mapping[str, Metric]]] = []
        contents: list[RecordDict] = []
        sites: list[SiteEntry] = []
        for msg in valid:  # evaluate replies, and train replies carrying an evaluation
            self.book.site(msg, senders)
            try:
                parsed = wire.parse_evaluation(msg, weight_key=self.weighted_by_key)
            except FedsplitError as e:
                sites.append(SiteEntry(site=reply_site(msg), excluded=True, reason=str(e)))
                continue
            rows.append((parsed.num_examples, parsed.metrics))
            contents.append(wire.evaluation_content(msg))
            sites.append(SiteEntry(site=parsed.site, num_examples=parsed.num_examples,
                                   metrics=parsed.metrics))
        for msg in failed:
            sites.append(SiteEntry(site=self.book.site(msg, senders), excluded=True,
                                   reason=wire.failure_reason(msg.error.reason)))
        sites.extend(missing)
        if (skipped := self.book.take_skip("evaluate", server_round)) is not None:
            sites.append(SiteEntry(excluded=True, reason=skipped))
        metrics = self._aggregate_metrics(self._evaluate_aggr, "evaluate_metrics_aggr_fn",
                                          rows, contents)
        self.history.record_evaluate(server_round, sites, metrics)
        return MetricRecord(metrics) if metrics else None
