"""`RegistryStrategy`: Flower's round loop with fedsplit's registry doing the aggregation.

Flower's `FedAvg` samples hospitals, sends the global model, collects replies and runs
evaluation; this subclass replaces only the two aggregation hooks. Training replies become
`protocol.Update` objects (validated: finite float arrays, integer count >= 1); a reply that
fails is excluded with its reason instead of ending the run, and the merge itself is
`aggregation.aggregate_updates`, the same code the REST upload path and the CLI use.
"""

from __future__ import annotations

import logging
from collections.abc import Iterable
from typing import Any

from flwr.app import ArrayRecord, Message, MetricRecord
from flwr.serverapp.strategy import FedAvg

import aggregation
from aggregation.base import AggregationStrategy, SiteReport
from protocol.arrays import check_num_examples
from protocol.errors import FedsplitError
from protocol.update import Update
from server.history import RunHistory

log = logging.getLogger(__name__)

NUM_EXAMPLES_KEY = "num-examples"


def reply_site(msg: Message) -> str:
    """The site name a reply carries, else its node id."""
    record = msg.content.config_records.get("site") if msg.has_content() else None
    if record is not None and "name" in record:
        return str(record["name"])
    return f"node-{msg.metadata.src_node_id}"


def _scalars(record: MetricRecord) -> dict[str, float]:
    return {k: float(v) for k, v in record.items() if isinstance(v, int | float)}


def weighted_mean(rows: list[tuple[int, dict[str, float]]]) -> dict[str, float]:
    """Count-weighted mean of each metric over the rows that report it."""
    out: dict[str, float] = {}
    keys = {k for _, m in rows for k in m}
    for key in sorted(keys):
        pairs = [(n, m[key]) for n, m in rows if key in m]
        total = sum(n for n, _ in pairs)
        if total:
            out[key] = sum(n * v for n, v in pairs) / total
    return out


def reply_to_update(msg: Message, server_round: int) -> tuple[Update, dict[str, float]]:
    """Convert a training reply into a validated `Update` and its metrics (raises on bad input)."""
    content = msg.content
    if len(content.array_records) != 1 or len(content.metric_records) != 1:
        raise FedsplitError(
            f"a training reply must hold exactly one ArrayRecord and one MetricRecord. Received: "
            f"{len(content.array_records)} and {len(content.metric_records)}"
        )
    record = next(iter(content.array_records.values()))
    metrics_record = next(iter(content.metric_records.values()))
    if NUM_EXAMPLES_KEY not in metrics_record:
        raise FedsplitError(
            f"the reply's metrics lack {NUM_EXAMPLES_KEY!r}, the sample count that weights it. "
            f"Received: {sorted(metrics_record)}"
        )
    metrics = _scalars(metrics_record)
    count = check_num_examples(metrics_record[NUM_EXAMPLES_KEY], where="reply")
    update = Update.from_array_record(
        record, num_examples=count, site=reply_site(msg), round=server_round,
        metrics={k: v for k, v in metrics.items() if k != NUM_EXAMPLES_KEY},
    )
    return update, metrics


class RegistryStrategy(FedAvg):
    """Flower `FedAvg` round loop whose aggregation is a fedsplit registry strategy.

    Parameters
    ----------
    aggregator : AggregationStrategy
        The registry strategy that merges training replies (``aggregation.get_strategy``).
    history : RunHistory
        Where each round's sites, report, metrics and global model are recorded.
    **kwargs
        Passed to Flower's `FedAvg` (``fraction_train``, ``min_train_nodes``, ...).
    """

    def __init__(self, aggregator: AggregationStrategy, history: RunHistory, **kwargs: Any) -> None:
        super().__init__(**kwargs)
        self.aggregator = aggregator
        self.history = history

    def aggregate_train(
        self, server_round: int, replies: Iterable[Message]
    ) -> tuple[ArrayRecord | None, MetricRecord | None]:
        """Validate replies, exclude bad ones, and merge the rest with the registry strategy."""
        valid, failed = self._check_and_log_replies(list(replies), is_train=True, validate=False)
        updates: list[Update] = []
        rows: list[tuple[int, dict[str, float]]] = []
        sites: list[dict[str, Any]] = []
        excluded: list[SiteReport] = []
        for msg in failed:
            reason = f"the site's ClientApp failed: {msg.error.reason}"
            excluded.append(SiteReport(site=reply_site(msg), num_examples=0, weight=0.0,
                                       excluded=True, reason=reason))
        for msg in valid:
            try:
                update, metrics = reply_to_update(msg, server_round)
            except FedsplitError as e:
                excluded.append(SiteReport(site=reply_site(msg), num_examples=0, weight=0.0,
                                           excluded=True, reason=str(e)))
                continue
            updates.append(update)
            rows.append((update.num_examples, metrics))
            sites.append({"site": update.site, "num_examples": update.num_examples,
                          "metrics": metrics})
        for rep in excluded:
            log.warning("Round %s: excluded %s: %s", server_round, rep.site, rep.reason)
            sites.append({"site": rep.site, "excluded": True, "reason": rep.reason})
        if not updates:
            self.history.record_train(server_round, None, sites, {},
                                      error="no usable training replies; global model unchanged")
            return None, None
        try:
            result = aggregation.aggregate_updates(self.aggregator, updates)
        except FedsplitError as e:
            log.error("Round %s: aggregation failed: %s", server_round, e)
            self.history.record_train(server_round, None, sites, {}, error=str(e))
            return None, None
        result.report.sites.extend(excluded)
        metrics = weighted_mean(rows)
        metrics.pop(NUM_EXAMPLES_KEY, None)
        self.history.record_train(server_round, result, sites, metrics)
        return result.to_update().to_array_record(), MetricRecord(metrics)

    def aggregate_evaluate(
        self, server_round: int, replies: Iterable[Message]
    ) -> MetricRecord | None:
        """Count-weighted mean of the sites' held-out metrics."""
        valid, failed = self._check_and_log_replies(list(replies), is_train=False, validate=False)
        rows: list[tuple[int, dict[str, float]]] = []
        sites: list[dict[str, Any]] = []
        for msg in valid:
            record = next(iter(msg.content.metric_records.values()), None)
            if record is None or NUM_EXAMPLES_KEY not in record:
                sites.append({"site": reply_site(msg), "excluded": True,
                              "reason": "evaluation reply without num-examples"})
                continue
            metrics = _scalars(record)
            rows.append((int(metrics[NUM_EXAMPLES_KEY]), metrics))
            sites.append({"site": reply_site(msg), "num_examples": int(metrics[NUM_EXAMPLES_KEY]),
                          "metrics": metrics})
        for msg in failed:
            sites.append({"site": reply_site(msg), "excluded": True, "reason": msg.error.reason})
        metrics = weighted_mean(rows)
        metrics.pop(NUM_EXAMPLES_KEY, None)
        self.history.record_evaluate(server_round, sites, metrics)
        return MetricRecord(metrics) if metrics else None
