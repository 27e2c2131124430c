"""The loop's plain merge step and its evaluation: replies checked against the wire contract,
merged with the registry rule, metrics averaged.

- `PlainMerge` (a `server.bookkeeping.MergeStep`): training replies are checked against the
  wire contract (`protocol.horizontal_wire`) and become `protocol.Update` objects (validated:
  finite float arrays, integer count >= 1); a reply that fails is excluded with its reason
  instead of ending the run, and the merge itself is `aggregation.aggregate_updates`, the same
  code the REST upload path and the CLI use, through `aggregation.Fold`: each reply's arrays
  are folded in as the reply is pulled (`PlainMerge.receive`, called by the exchange helper)
  and dropped from its message (held under the memory budget, else spilled to a temporary
  file), so the coordinator holds no round's replies whole while the others arrive; the fold
  merges them in site order at the end, whatever order they arrived in. A round updates the
  global model only when at least ``quorum`` replies are usable: the count is taken after
  the input checks (layout, count, cohort cap, finite values), so excluded updates never make
  up a quorum.
- `Evaluation`: a global model's federated evaluation from evaluate replies and from train
  replies that carry it (``evaluate-first``: `server.rounds`): one history entry per hospital
  and the weighted mean of their metrics.

Metrics are averaged as Flower's ``aggregate_metricrecords`` does (`weighted_mean`), or by a
Flower user's ``train_metrics_aggr_fn`` / ``evaluate_metrics_aggr_fn`` (Flower's signature
``(list[RecordDict], str) -> MetricRecord``).
"""

from __future__ import annotations

import logging
from collections.abc import Callable, Iterable, Mapping
from typing import NamedTuple

from fedsplit.aggregation.base import AggregationStrategy
from fedsplit.protocol import horizontal_wire as wire
from fedsplit.protocol.aggregation_report import SiteReport
from fedsplit.protocol.errors import ConfigError, FedsplitError
from fedsplit.protocol.horizontal_wire import reply_site
from fedsplit.protocol.record.horizontal import SiteEntry
from fedsplit.server.bookkeeping import Merge, Round, RoundReplies
from flwr.app import Message, MetricRecord, RecordDict
from flwr.serverapp import Grid

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


def split_errors(replies: Iterable[Message], phase: str) -> tuple[list[Message], list[Message]]:
    """(replies with content, error replies), the errors logged with their node."""
    valid: list[Message] = []
    failed: list[Message] = []
    for msg in replies:
        (failed if msg.has_error() else valid).append(msg)
    log.info("%s: received %s results and %s failures", phase, len(valid), len(failed))
    for msg in failed:
        log.info("\t> error in reply from node %d: %s", msg.metadata.src_node_id, msg.error.reason)
    return valid, failed


class _Folded(NamedTuple):
    """A parsed training reply once `aggregation.Fold` holds its arrays: what the round's
    record and metrics still read."""

    num_examples: int
    metrics: dict[str, Metric]
    site: str
    info: dict[str, str]


class MetricsAverage:
    """A user's metrics aggregation function, else the weighted mean without the weight key."""

    def __init__(self, weighted_by_key: str, fn: MetricsAggrFn | None, name: str) -> None:
        self.weighted_by_key, self.fn, self.name = weighted_by_key, fn, name

    def __call__(self, rows: list[tuple[float, Mapping[str, Metric]]],
                 contents: list[RecordDict]) -> dict[str, Metric]:
        """The averaged metrics of the usable replies (``rows``: weight and metrics;
        ``contents``: the replies' records, for the user's function)."""
        if self.fn is not None:
            return _metric_dict(self.fn(contents, self.weighted_by_key), self.name) if contents else {}
        return weighted_mean(rows, skip=(self.weighted_by_key,))


class PlainMerge:
    """The loop's plain merge step (module docstring).

    Parameters
    ----------
    aggregator : AggregationStrategy
        The registry rule that merges the updates (``aggregation.get_strategy``).
    quorum : int (default: 1)
        Fewest usable replies (after the input checks) that update the global model.
    cohort_caps, cap_policy
        Registered cohort size per site and what a larger claimed count gets (`aggregation.guard`).
    backend : aggregation.BackendSettings | None (default: None)
        How the merges' passes run (backend mode, device, threads), for every round: the
        ServerApp builds it once from the coordinator's environment where it starts
        (``FEDSPLIT_AGG_BACKEND``, ``FEDSPLIT_AGG_THREADS``; `server.app.main`). Default: the
        library's defaults (`aggregation.DEFAULT_SETTINGS`; nothing is read from the environment).
    weighted_by_key : str (default: "num-examples")
        The reply metric that weights each reply (its count).
    metrics_aggr_fn : callable | None (default: None)
        Flower's ``train_metrics_aggr_fn``; None: the weighted mean.
    """

    def __init__(self, aggregator: AggregationStrategy, *, quorum: int = 1,
                 cohort_caps: dict[str, int] | None = None, cap_policy: str = "clip",
                 backend: aggregation.BackendSettings | None = None,
                 weighted_by_key: str = wire.NUM_EXAMPLES,
                 metrics_aggr_fn: MetricsAggrFn | None = None) -> None:
        self.aggregator = aggregator
        self.quorum = max(1, quorum)
        self.cohort_caps = cohort_caps or {}
        self.cap_policy = cap_policy
        self.backend = backend if backend is not None else aggregation.DEFAULT_SETTINGS
        self.weighted_by_key = weighted_by_key
        self.average = MetricsAverage(weighted_by_key, metrics_aggr_fn, "train_metrics_aggr_fn")
        self._fold: aggregation.Fold | None = None  # the round's, opened by `prepare`
        #: node -> what `receive` made of its training reply (one per node and round):
        #: folded, or why it was excluded
        self._arrived: dict[int, tuple[_Folded, RecordDict] | str] = {}

    def prepare(self, rnd: Round, grid: Grid, timeout: float | None) -> None:
        """Open the round's fold: each training reply is folded in as it is pulled
        (`receive`), not after the whole exchange."""
        self._drop_fold()
        self._fold = self._new_fold(rnd)

    def receive(self, rnd: Round, msg: Message) -> None:
        """Fold a training reply in as it arrives and drop its arrays from the message (the
        coordinator holds one model per reply only until the fold's budget, then none)."""
        if (self._fold is None or msg.has_error()
                or msg.metadata.message_type != wire.TRAIN):
            return
        self._arrived[msg.metadata.src_node_id] = self._take(self._fold, rnd, msg)

    def merge(self, rnd: Round, replies: RoundReplies) -> Merge:
        """Check the replies against the wire contract, exclude bad ones with their reason,
        merge the rest with the registry rule (`aggregation.aggregate_updates`), and average
        their training metrics; a round with fewer than ``quorum`` usable replies is short."""
        valid, failed = split_errors(replies.replies, "train")
        # in a fixed order (by site name, then node), not the order replies arrived in: the
        # fold merges in that order too (its keys), so the float sums, and so the run, are
        # the same every time
        valid = sorted(valid, key=_order)
        parsed: list[_Folded] = []  # each reply's arrays are the fold's once parsed
        contents: list[RecordDict] = []
        excluded: list[SiteReport] = []
        for msg in failed:
            excluded.append(SiteReport(site=replies.site(msg), num_examples=0, weight=0.0,
                                       excluded=True, reason=wire.failure_reason(msg.error.reason)))
        fold, arrived = self._fold or self._new_fold(rnd), self._arrived
        self._fold, self._arrived = None, {}
        with fold:
            for msg in valid:
                replies.site(msg)
                taken = arrived.pop(msg.metadata.src_node_id, None)
                if taken is None:  # not received during the exchange: folded now
                    taken = self._take(fold, rnd, msg)
                if isinstance(taken, str):
                    excluded.append(SiteReport(site=reply_site(msg), num_examples=0, weight=0.0,
                                               excluded=True, reason=taken))
                    continue
                parsed.append(taken[0])
                contents.append(taken[1])
            # one entry per parsed reply first, in order (aligned with the aggregation report)
            sites = [SiteEntry(site=r.site, num_examples=r.num_examples,
                               metrics=r.metrics, info=r.info) for r in parsed]
            for rep in excluded:
                log.warning("Round %s: excluded %s: %s", rnd.number, rep.site, rep.reason)
                sites.append(SiteEntry(site=rep.site, excluded=True, reason=rep.reason))
            if not parsed:
                return Merge(sites, error="no usable training replies; global model unchanged")
            if len(parsed) < self.quorum:
                return Merge(sites, error=f"only {len(parsed)} valid training replies, fewer "
                                          f"than the quorum of {self.quorum}; global model "
                                          f"unchanged")
            try:
                result = fold.result()
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
        metrics = self.average(
            [(parsed[k].num_examples, parsed[k].metrics) for k in usable],
            [contents[k] for k in usable])
        return Merge(sites, result=result, metrics=metrics)

    def _new_fold(self, rnd: Round) -> aggregation.Fold:
        return aggregation.Fold(self.aggregator, expected=rnd.layout, cohort_caps=self.cohort_caps,
                                cap_policy=self.cap_policy, settings=self.backend,
                                expected_updates=len(rnd.train) or None)

    def _drop_fold(self) -> None:
        """Close a fold a failed exchange left open (its spilled files go with it)."""
        if self._fold is not None:
            self._fold.close()
        self._fold, self._arrived = None, {}

    def _take(self, fold: aggregation.Fold, rnd: Round, msg: Message
              ) -> tuple[_Folded, RecordDict] | str:
        """Parse one training reply and fold its arrays in (keyed by `_order`), dropping them
        from the message; or the reason it is excluded."""
        try:
            reply = wire.parse_train_reply(msg, weight_key=self.weighted_by_key,
                                           server_round=rnd.number)
        except FedsplitError as e:
            return str(e)
        fold.add(reply.update, key=_order(msg))
        del msg.content.array_records[wire.ARRAYS]  # the fold holds (or spilled) them
        return (_Folded(reply.update.num_examples, reply.metrics, reply.site, reply.info),
                _without_evaluation(msg.content))


def _order(msg: Message) -> tuple[str, int]:
    """Where a training reply goes among the round's: by site name, then node."""
    return reply_site(msg), msg.metadata.src_node_id


class Evaluation:
    """A global model's federated evaluation (module docstring).

    ``weighted_by_key``: the metric that weights each hospital's scores (its validation rows);
    ``metrics_aggr_fn``: Flower's ``evaluate_metrics_aggr_fn``, None for the weighted mean."""

    def __init__(self, weighted_by_key: str = wire.NUM_EXAMPLES,
                 metrics_aggr_fn: MetricsAggrFn | None = None) -> None:
        self.weighted_by_key = weighted_by_key
        self.average = MetricsAverage(weighted_by_key, metrics_aggr_fn, "evaluate_metrics_aggr_fn")

    def __call__(self, replies: RoundReplies) -> tuple[list[SiteEntry], dict[str, Metric]]:
        """One history entry per reply (evaluate replies, and train replies carrying an
        evaluation) and the averaged metrics."""
        valid, failed = split_errors(replies.replies, "evaluate")
        rows: list[tuple[float, Mapping[str, Metric]]] = []
        contents: list[RecordDict] = []
        sites: list[SiteEntry] = []
        for msg in valid:
            replies.site(msg)
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
            sites.append(SiteEntry(site=replies.site(msg), excluded=True,
                                   reason=wire.failure_reason(msg.error.reason)))
        return sites, self.average(rows, contents)
